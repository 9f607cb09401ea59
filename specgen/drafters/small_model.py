"""An independent small language model as drafter.

The draft model has its own KV cache and samples each candidate from the same
processor stack as the target, evaluated on its own history (committed tokens +
its earlier candidates), through :class:`~specgen.drafters.chain_draw.ChainDraws`:
the recorded ``draft_probs`` are exactly the distributions it sampled from, so
verification is exact; drafted tokens stay on the device unless a processor reads
token ids. When the stack allows nothing at a later draft step (e.g. the grammar
has no continuation after the tokens drawn so far) the chain stops there and
proposes those tokens: a stopping rule that looks only at the drafter's own
draws, so it keeps exactness.
"""

from __future__ import annotations

import torch

from specgen.drafters.base import EMPTY, DraftContext, Drafter, DraftSession, HFAssistant, Proposal
from specgen.drafters.chain_draw import ChainDraws
from specgen.models import resolve_drafter_dtype
from specgen.models.target import Target, hf_model_of


class SmallModelSession(DraftSession):
    def __init__(self, lm: Target, ctx: DraftContext):
        self.lm = lm
        self.ctx = ctx
        self.cache = lm.new_cache()

    stops_online = True

    def propose(self, budget: int, stopper=None) -> Proposal:
        committed = self.ctx.committed
        budget = min(budget, self.lm.context_length - len(committed.tokens))  # the draft model's own window
        if budget <= 0:
            return EMPTY
        draws = ChainDraws(self.ctx, strict_first=True, stopper=stopper)  # step 0 follows the committed tokens only
        feed = self.cache.uncached(committed.tokens)
        for step in range(budget):
            raw = self.lm.forward(self.cache, feed, keep=1, check=False)  # [1, vocab]; NaN refused by the draws
            token = draws.draw(raw, raw[0])
            if token is None or not draws.more():
                break
            if step + 1 < budget:
                feed = token if isinstance(token, torch.Tensor) else [token]
        proposal = draws.finish()
        self.cache.resolve(draws.drawn)  # the ids of the draws fed as device tensors
        return proposal

    def sync(self) -> None:
        self.cache.sync(self.ctx.committed.tokens)

    def close(self) -> None:
        self.cache.release()

    def mark(self) -> int:
        return len(self.cache)

    def rollback(self, mark: int) -> None:
        self.sync()
        self.cache.crop(mark)


class SmallModelDrafter(Drafter):
    """lm: the draft model (vocabulary aligned with the target's); tokenizer: its TokenizerInfo."""

    name = "small_model"

    def __init__(self, lm: Target, tokenizer, num_tokens: int = 4):
        super().__init__(num_tokens)
        self.lm = lm
        self.tokenizer = tokenizer

    def session(self, ctx: DraftContext) -> DraftSession:
        return SmallModelSession(self.lm, ctx)

    @property
    def extra_memory_bytes(self) -> int:
        return self.lm.memory_bytes

    @property
    def draft_model(self) -> Target:
        return self.lm

    @property
    def hf_assistant(self) -> HFAssistant | None:
        """Assisted generation with the draft model, when a transformers model backs it."""
        model = hf_model_of(self.lm)
        return None if model is None else HFAssistant("hf_assisted", model=model)


def build(*, runtime, source, kind: str = "small_model", num_tokens: int = 4, dtype=None) -> SmallModelDrafter:
    """Hydra factory: load the draft model described by ``source``, in ``dtype`` (None = the target's;
    q is whatever the draft model computes, so its dtype never changes the guarantee)."""
    lm = runtime.target.lm
    loaded = runtime.load(source, name="drafter", dtype=resolve_drafter_dtype(dtype, lm.dtype, lm.device),
                          vocab_size=runtime.target.tokenizer.vocab_size)
    return SmallModelDrafter(loaded.lm, loaded.tokenizer, num_tokens=num_tokens)
