"""DSpark drafter: a semi-autoregressive block drafter (:mod:`specgen.heads.dspark`).

Each round runs the head's backbone once, on the target feature of the newest
processed token and the newest committed token, for the base rows U_1..U_K of
every position it may draft. Then, step by step, position k's logits are U_k
corrected by the low-rank Markov head with the token drawn at k - 1, and the
token is drawn through :class:`~specgen.drafters.chain_draw.ChainDraws` exactly as
MTP draws: q is the processed draft distribution each token was sampled from
(zero outside the draft vocabulary), or the processed argmax under greedy decoding.

The planner's confidence for step k is the head's own c_k, not max q: c_k reads the
backbone state of k and the token drawn at k - 1, both known before token k is
drawn, so a chain stopped on it stays a stopping time of the drafter's information
and verification stays exact.
"""

from __future__ import annotations

import torch

from specgen.drafters.base import EMPTY, Proposal
from specgen.drafters.chain_draw import ChainDraws
from specgen.drafters.learned import LearnedDrafter, LearnedSession, load_for_target
from specgen.errors import ConfigError

#: c_k is kept inside (0, 1]: the stopper treats a confidence of exactly 0 as "no estimate".
_LEAST_CONFIDENCE = 1e-6


class DsparkSession(LearnedSession):
    stops_online = True

    @torch.inference_mode()
    def propose(self, budget: int, stopper=None) -> Proposal:
        root = self.root(budget)
        if root is None:
            return EMPTY
        feature, token = root
        head = self.head
        count = min(budget, head.cfg.block_size)
        draws = ChainDraws(self.ctx, strict_first=False, stopper=stopper)  # every step here is a draft position
        previous = torch.tensor([token], device=feature.device)  # [1] x_0, the newest committed token
        states, base = head.block(feature, previous, count)  # [1, K, d], [1, K, Vd]: once per round
        for k in range(count):
            logits = head.markov(base[:, k], previous)  # [1, Vd]
            confidence = head.confidence(states[:, k], previous)[0].clamp(_LEAST_CONFIDENCE, 1.0)  # []
            drawn = draws.draw(self.full_logits(logits), logits[0], confidence=confidence)
            if drawn is None or not draws.more():
                break
            previous = drawn if isinstance(drawn, torch.Tensor) else torch.tensor([drawn], device=feature.device)
        return draws.finish()


class DsparkDrafter(LearnedDrafter):
    """Drafts a chain of at most the head's block size from the target's last feature: not
    batched, as it reads features. ``auto_max_tokens`` is the head's block size."""

    name = "dspark"
    session_class = DsparkSession
    auto_max_tokens = 6


def build(*, runtime, head_file: str, num_tokens: int | str = "auto", kind: str = "dspark", head=None,
          dtype=None) -> DsparkDrafter:
    """Hydra factory. ``head`` (architecture) is read by specgen-train only;
    ``dtype``: the head's (None = the target's). ConfigError when a fixed ``num_tokens``
    exceeds the head's block size (one backbone pass drafts at most that many)."""
    loaded, path, vocab_size = load_for_target(runtime, head_file, "dspark", dtype)
    block = int(loaded.cfg.block_size)
    drafter = DsparkDrafter(loaded, vocab_size, num_tokens, path)
    if drafter.num_tokens != "auto" and drafter.num_tokens > block:
        raise ConfigError(f"drafter.num_tokens={drafter.num_tokens} exceeds the dspark head's block size {block} "
                          f"({path}); use drafter.num_tokens=auto or at most {block}, or train a head with "
                          f"train.head.block_size={drafter.num_tokens}")
    drafter.auto_max_tokens = block
    return drafter
