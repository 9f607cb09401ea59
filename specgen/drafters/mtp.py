"""MTP drafter: one shared multi-token-prediction module applied recursively.

Each step maps (state, token) to the next state and a distribution over the
draft vocabulary: the first state is the target feature of the newest processed
token, later ones are the module's own. Candidates form a chain sampled from q
after the processor stack (q is exactly what was sampled from, zero outside the
draft vocabulary), or the processed argmax under greedy decoding.
"""

from __future__ import annotations

import torch

from specgen.drafters.base import EMPTY, Proposal
from specgen.drafters.chain_draw import ChainDraws
from specgen.drafters.learned import LearnedDrafter, LearnedSession, load_for_target


class MtpSession(LearnedSession):
    stops_online = True

    @torch.inference_mode()
    def propose(self, budget: int, stopper=None) -> Proposal:
        root = self.root(budget)
        if root is None:
            return EMPTY
        state, token = root
        draws = ChainDraws(self.ctx, strict_first=False, stopper=stopper)  # every step here is a draft position
        token = torch.tensor([token], device=state.device)  # [1]
        for _ in range(budget):
            state, logits = self.head.step(state, token)  # [1, d], [1, Vd]
            drawn = draws.draw(self.full_logits(logits), logits[0])  # raw [1, vocab]
            if drawn is None or not draws.more():
                break
            token = drawn if isinstance(drawn, torch.Tensor) else torch.tensor([drawn], device=state.device)
        return draws.finish()


class MtpDrafter(LearnedDrafter):
    """Drafts a chain (not a tree) from the target's last feature: not batched, as it reads features."""

    name = "mtp"
    session_class = MtpSession
    auto_max_tokens = 6


def build(*, runtime, head_file: str, num_tokens: int = 4, kind: str = "mtp", head=None, dtype=None) -> MtpDrafter:
    """Hydra factory. ``head`` (architecture) is read by specgen-train only;
    ``dtype``: the head's (None = the target's)."""
    loaded, path, vocab_size = load_for_target(runtime, head_file, "mtp", dtype)
    return MtpDrafter(loaded, vocab_size, num_tokens, path)
