"""``specgen-serve``: an OpenAI-compatible HTTP server over one pipeline.

Modules: ``protocol`` (OpenAI request bodies -> per-request options, response
bodies and SSE chunks), ``worker`` (the scheduler: one thread owns the pipeline
and serves requests one at a time), ``sampling`` (per-request temperature /
top_p as a rebuilt processor stack), ``metrics`` (Prometheus text), ``app`` (the
Starlette routes), ``cli`` (the Hydra entry point, uvicorn).
"""

from specgen.serve.app import create_app, served_model_name

__all__ = ["create_app", "served_model_name"]
