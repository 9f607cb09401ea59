"""Run settings: finding and composing the Hydra config, and checking what a user or a request sets.

``compose`` (the conf/ directory and Hydra composition), ``schema`` (structured-config
schemas), ``checks`` (a composed run config's values, before anything loads),
``options`` (validation of request options) and ``paths`` (output paths before
anything is written). Nothing is imported here.
"""
