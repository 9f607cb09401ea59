"""The state of one request, with the round transaction's commit and rollback.

Everything a round may change lives here: committed tokens and their counts,
target and draft KV caches, the two RNGs, the text stream (detokeniser + stop
buffer) and the finish reason. :meth:`Request.commit` is the only way tokens
enter it; :meth:`Request.restore` is the only rollback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from specgen.drafters import DraftSession
from specgen.events import FinishReason
from specgen.models import KVCache
from specgen.planning.planner import Planner
from specgen.processors import CommittedCounts
from specgen.sampling.logprobs import TokenLogprob
from specgen.text import TextState, TextStream


@dataclass
class Snapshot:
    length: int
    target_cache_length: int
    draft_mark: object
    target_rng: torch.Tensor
    draft_rng: torch.Tensor
    text: TextState
    finish_reason: FinishReason | None


class Request:
    """prompt_ids: the encoded prompt; limits come from the pipeline call."""

    def __init__(self, *, prompt_ids: list[int], vocab_size: int, device: torch.device, target_cache: KVCache,
                 text: TextStream, eos_ids: list[int], max_new_tokens: int, seed: int):
        self.committed = CommittedCounts.start(prompt_ids, vocab_size, device)
        self.target_cache = target_cache
        self.text = text
        self.eos_ids = set(eos_ids)
        self.max_new_tokens = max_new_tokens
        self.target_rng = torch.Generator(device=device).manual_seed(seed)
        self.draft_rng = torch.Generator(device=device).manual_seed(seed ^ 0x5DEECE66D)
        self.draft: DraftSession | None = None
        self.planner: Planner | None = None  # how much this request drafts (set when it opens)
        self.finish_reason: FinishReason | None = None
        self.logprobs: list[TokenLogprob] = []  # the generated tokens' (when the request asks for them)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # the prompt's (echo), first None
        self.scored: list[TokenLogprob] | None = None  # the last commit's kept tokens' (what their events carry)

    @property
    def generated(self) -> list[int]:
        return self.committed.tokens[self.committed.num_prompt :]

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.committed.num_generated

    def draft_room(self, context_length: int) -> int:
        """Draft tokens a round may propose: never past max_new_tokens or the context."""
        return max(0, min(self.remaining - 1, context_length - len(self.committed.tokens) - 1))

    def snapshot(self) -> Snapshot:
        return Snapshot(len(self.committed.tokens), len(self.target_cache),
                        None if self.draft is None else self.draft.mark(),
                        self.target_rng.get_state(), self.draft_rng.get_state(), self.text.snapshot(), self.finish_reason)

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Run a round: on any exception (KeyboardInterrupt and a closed stream
        included) every piece of state returns to where it was, then it re-raises."""
        snap = self.snapshot()
        try:
            yield
        except BaseException:
            self.restore(snap)
            raise

    def restore(self, snap: Snapshot) -> None:
        """Roll every piece of state back to ``snap`` (used when a round fails)."""
        self.committed.truncate(snap.length)
        self.target_cache.sync(self.committed.tokens)
        self.target_cache.crop(snap.target_cache_length)
        if self.draft is not None:
            self.draft.rollback(snap.draft_mark)
        self.target_rng.set_state(snap.target_rng)
        self.draft_rng.set_state(snap.draft_rng)
        self.text.restore(snap.text)
        self.finish_reason = snap.finish_reason
        del self.logprobs[snap.length - self.committed.num_prompt:]

    def release(self, keep_target: bool = False) -> None:
        """The request is over (finished, failed or closed): its KV handles go back to their
        models (:meth:`~specgen.models.target.TokenCache.release`); nothing is read after.
        keep_target: the target handle is left to the caller (to park in a prefix cache)."""
        if not keep_target:
            self.target_cache.release()
        if self.draft is not None:
            self.draft.close()

    def commit(self, tokens: list[int], num_accepted: int) -> list[tuple[int, str]]:
        """Commit a round's tokens (accepted prefix + one); return (token, text) pairs.

        Stops at EOS, at ``max_new_tokens`` and when a stop string completes; the
        tokens after such a point are dropped. Caches keep only what the
        committed tokens back.
        """
        kept: list[tuple[int, str]] = []
        for token in tokens:
            if self.finish_reason is not None:
                break
            kept.append((token, self.text.push(token)))
            if self.text.stopped:
                self.finish_reason = "stop"
            elif token in self.eos_ids:
                self.finish_reason = "eos"
            elif self.committed.num_generated + len(kept) >= self.max_new_tokens:
                self.finish_reason = "length"
        self.committed.commit([t for t, _ in kept])
        self.target_cache.sync(self.committed.tokens)
        if self.draft is not None:
            self.draft.observe(num_accepted)
        return kept
