"""Many requests advancing together: ragged verification and continuous batching.

Every active row is a :class:`specgen.state.Request` whose ``target_cache`` is a
row of the batched cache of the target's backend (:func:`~specgen.batch.kv.batch_cache`):
on torch a :class:`RowCache`, a view of one row of a shared batch-B DynamicCache
(:class:`BatchKV`, described below); on llama.cpp one KV stream of a context of the
batch's own (:class:`specgen.models.llama_cpp.LlamaBatch`). A step runs plan + draft for every row (its own drafter
session and γ; with num_tokens="auto" the rows' draft lengths are chosen together
against the batched cost table, :mod:`specgen.batch.plan`, because one row's long
draft widens every row's forward; a row without a drafter runs a plain step), then ONE
target forward over every row's feed (its uncached committed tokens + its
candidates), then each row's process / accept / commit with its own processor
stack, grammar and RNG -- the same functions :mod:`specgen.round` uses for a
single request, so a row's output law equals a single-request run's.

The shared torch cache: each forward appends the same number w of slots to every row
(w = the widest feed; shorter feeds are padded with dummies nobody attends to, and
linear layers skip them where they can, :func:`specgen.models.packed_linear.real_tokens`).
A fresh row's prompt is prefilled in a forward of its own and stored in its batch
entry's dead slots (a refill takes over the finished row's), appending only what
does not fit (on llama.cpp, whose rows keep cells of their own, it goes in the row's
first step instead: ``LlamaBatch.prefills_apart``; a prompt longer than the backend's
``prefill_chunk`` is fed a chunk per step while the other rows decode: ending on the splits its
solo run decodes at, or, where the model measures that splits change no logit, sized by time
(``LlamaBatch.prefill_take``); prompts without a first token share one chunk of prompt per step,
shortest first: :func:`~specgen.batch.steps.prefill_chunks`).
A row lists the slots holding its tokens (``RowCache.slots``); the 4D additive
mask lets each new token see its row's listed slots and its own feed causally;
positions are per row (token i of a row sits at position i). Rolling a row back
drops slots from its list (nothing is copied). :meth:`BatchKV.compact` gathers
each row's slots left-aligned into fresh tensors when dead slots pile up.

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

from specgen.batch.kv import COMPACT_SLACK, BatchKV, RowCache
from specgen.batch.scheduler import BatchScheduler, Cancelled, Handle, StepError
from specgen.batch.steps import (Batch, Row, RowSpec, admit, generate_batch, prepare, step, stream_batch,
                                 unbatched_reason)

__all__ = ["COMPACT_SLACK", "Batch", "BatchKV", "BatchScheduler", "Cancelled", "Handle", "Row", "RowCache", "RowSpec",
           "StepError", "admit", "generate_batch", "prepare", "step", "stream_batch", "unbatched_reason"]
