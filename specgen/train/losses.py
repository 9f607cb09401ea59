"""Training losses for draft heads: pure functions of draft logits and target probabilities.

Shapes: ``logits`` [..., Vd] are the head's logits over the draft vocabulary;
``p`` [..., Vd] are the target's probabilities *over the full vocabulary*
restricted to the draft ids, so ``p.sum(-1) <= 1`` (mass outside the draft
vocabulary is simply absent: a draft can never propose those tokens).

* :func:`ce` -- hard distillation of the target's greedy token.
* :func:`kl` -- forward KL(p || q) up to the (constant) entropy of p.
* :func:`lk` -- ``-log sum_v min(p, q)``: maximises the acceptance probability
  ``1 - TV(p, q)`` of one draft token under speculative sampling at T = 1.
* :func:`chain_tv` -- for a chain of depths: ``-sum_k prod_{j<=k} alpha_j``,
  the expected number of accepted tokens of the chain.
"""

from __future__ import annotations

import torch

#: keeps log() finite when a draft puts no mass on the target's support
EPS = 1e-9

LOSSES = ("ce", "kl", "lk", "chain_tv")


def acceptance(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """alpha = sum_v min(p(v), q(v)) per position, q = softmax(logits): [..., Vd] -> [...]."""
    q = torch.softmax(logits.float(), dim=-1)
    return torch.minimum(p.float(), q).sum(-1)


def ce(logits: torch.Tensor, p: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
    """Mean -log q(t) over positions, t = the target's greedy token as a draft index.

    ``target`` [...] gives t explicitly (-1 = the target's argmax lies outside the
    draft vocabulary: the position is skipped); without it t = argmax p.
    """
    if target is None:
        target = p.argmax(-1)
    logq = torch.log_softmax(logits.float(), dim=-1)
    keep = target >= 0
    if not bool(keep.any()):
        return logq.sum() * 0.0
    picked = logq.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return -(picked[keep]).mean()


def kl(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mean forward KL(p || q) up to a constant: -sum_v p(v) log q(v)."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    return -(p.float() * logq).sum(-1).mean()


def lk(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mean -log sum_v min(p(v), q(v)) = -log(1 - TV(p, q)) when p sums to 1."""
    return -torch.log(acceptance(logits, p) + EPS).mean()


def chain_tv(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """logits, p [D, N, Vd] (depth first) -> mean over N of -sum_k prod_{j<=k} alpha_j."""
    alphas = acceptance(logits, p)  # [D, N]
    return -torch.cumprod(alphas, dim=0).sum(0).mean()


def depth_loss(name: str, logits: torch.Tensor, p: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
    """The loss ``name`` for a stack of depths [D, N, Vd]: chain_tv over the chain,
    the others averaged over depths. target [D, N]: draft-index greedy tokens for ce."""
    if name == "chain_tv":
        return chain_tv(logits, p)
    if name == "ce":
        return ce(logits, p, target)
    if name == "kl":
        return kl(logits, p)
    if name == "lk":
        return lk(logits, p)
    raise ValueError(f"unknown loss {name!r}; expected one of {', '.join(LOSSES)}")
