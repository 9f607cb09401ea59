"""The command-line entry points: ``entry`` (the console scripts, each inside a Ctrl-C guard),
``main`` (the ``specgen`` command), ``export`` (``specgen export``) and the ``specgen``
command's JSONL mode (``jsonl``, with its ``jsonl_input`` and ``jsonl_output`` files).

Nothing is imported here: :mod:`specgen.cli.entry` must stay light so that Ctrl-C while
torch loads exits with one line.
"""
