"""The engine: one pipeline that turns a request into events, a round at a time.

``pipeline`` (:class:`~specgen.engine.pipeline.Pipeline`: the generation loop),
``request`` (one checked request and its bookkeeping), ``state`` (a request's
state with the round transaction's commit and rollback), ``round`` (one
speculative round as a transaction, one plain step), ``scoring`` (the logprobs
of committed tokens), ``chat`` (a conversation as messages) and ``assemble``
(a composed config -> a :class:`Pipeline`: components, alignment, guarantee).
Nothing is imported here, so a submodule loads only what it needs.
"""
