"""Many requests advancing together: ragged verification and continuous batching.

Every active row is a :class:`specgen.engine.state.Request` whose ``target_cache`` is a
row of the target's batched cache (:meth:`specgen.models.target.Target.new_batch`, a
:class:`~specgen.models.target.BatchCache`; this package sees nothing else of it). A step
runs plan + draft for every row (its own drafter
session and γ; with num_tokens="auto" the rows' draft lengths are chosen together
against the batched cost table, :mod:`specgen.batch.drafting`, because one row's long
draft widens every row's forward; a row without a drafter runs a plain step), then ONE
target forward over every row's feed (its uncached committed tokens + its
candidates, ``BatchCache.forward``), then each row's process / accept / commit with its own processor
stack, grammar and RNG -- the same functions :mod:`specgen.engine.round` uses for a
single request, so a row's output law equals a single-request run's.

How the rows' caches are laid out is the backend's: on torch one batch-B cache shared
by row views, padded to the widest feed and compacted when dead slots pile up
(:mod:`specgen.models.batch_kv`); on llama.cpp and the quantized path each row keeps
entries of its own. A fresh row's prompt goes in a forward of its own before its first
step where the cache says so (``BatchCache.prefills_apart``), else in that step; a prompt
longer than the cache's ``prefill_chunk`` is fed a chunk per step, ending on the splits its
solo run decodes at, or, where the backend measured that splits change no logit, sized by time
(``BatchCache.prefill_take``), while the other rows decode; prompts without a first token share one
chunk of prompt per step, shortest first: :func:`~specgen.batch.steps.prefill_chunks`.

A step is a transaction over all its rows: an exception anywhere (the batched
forward included) restores every row to its state before the step. A grammar
dead end in one row ends that row only, as in the single-request engine.
Drafters that are not ``batchable`` (tree drafters and those reading target
features: eagle, medusa, mtp, dspark) and compiled targets are not batched yet and are
refused with a ConfigError (:func:`specgen.drafters.batch_refusal` decides).

One step loop (:class:`Batch`), two clients: :func:`stream_batch` admits a list
given up front; :class:`BatchScheduler` is online (a thread admits requests as
they are submitted and slots free up, and drops cancelled ones between steps).
"""

from specgen.batch.scheduler import BatchScheduler, Cancelled, Handle, StepError
from specgen.batch.steps import (Batch, Row, RowSpec, admit, generate_batch, prepare, step, stream_batch,
                                 unbatched_reason)

__all__ = ["Batch", "BatchScheduler", "Cancelled", "Handle", "Row", "RowSpec",
           "StepError", "admit", "generate_batch", "prepare", "step", "stream_batch", "unbatched_reason"]
