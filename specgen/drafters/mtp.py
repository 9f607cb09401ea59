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
from specgen.drafters.learned import LearnedDrafter, LearnedSession, load_for_target
from specgen.processors import History
from specgen.sampling import NoAllowedToken, sample_token


class MtpSession(LearnedSession):
    @torch.inference_mode()
    def propose(self, budget: int) -> Proposal:
        root = self.root(budget)
        if root is None:
            return EMPTY
        state, token = root
        stack, committed = self.ctx.stack, self.ctx.committed
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        peaks: list[torch.Tensor] = []  # max q before each draw: the planner's confidence
        for step in range(budget):
            state, logits = self.head.step(state, torch.tensor([token], device=state.device))  # [1, d], [1, Vd]
            raw = self.full_logits(logits)  # [1, vocab]
            history = History(committed, tokens, num_positions=1, start=step)
            try:
                if stack.greedy:
                    token = stack.argmax(raw, history)[0]
                else:
                    q_row = stack.probs(raw, history)[0]  # [vocab] float64
                    token = sample_token(q_row, self.ctx.generator)
            except NoAllowedToken:
                break  # the processors leave no draft-vocabulary token here: stop the chain
            if not stack.greedy:
                rows.append(q_row)
            peaks.append(torch.softmax(logits[0].float(), dim=-1).max() if stack.greedy else q_row.max())
            tokens.append(token)
        if not tokens:
            return EMPTY
        return Proposal(tokens, None if stack.greedy else torch.stack(rows), confidence=torch.stack(peaks).tolist())


class MtpDrafter(LearnedDrafter):
    name = "mtp"
    session_class = MtpSession
    auto_max_tokens = 6


def build(*, runtime, head_file: str, num_tokens: int = 4, kind: str = "mtp", head=None, dtype=None) -> MtpDrafter:
    """Hydra factory. ``head`` (architecture) is read by specgen-train only;
    ``dtype``: the head's (None = the target's)."""
    loaded, path, vocab_size = load_for_target(runtime, head_file, "mtp", dtype)
    return MtpDrafter(loaded, vocab_size, num_tokens, path)
