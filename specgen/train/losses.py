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

A DSpark head (:mod:`specgen.heads.dspark`) also predicts its own acceptance c_k:
:func:`confidence_target` is its label c* = 1 - TV(q, p) and :func:`confidence_loss`
fits c_k to it (``bce`` or ``mse``); :func:`summed_depth_loss` is its draft loss.
"""

from __future__ import annotations

import torch

#: keeps log() finite when a draft puts no mass on the target's support
EPS = 1e-9

LOSSES = ("ce", "kl", "lk", "chain_tv")
CONFIDENCE_LOSSES = ("bce", "mse")


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


def summed_depth_loss(name: str, logits: torch.Tensor, p: torch.Tensor,
                      target: torch.Tensor | None = None) -> torch.Tensor:
    """The loss ``name`` summed over the depths [D, N, Vd]: D times :func:`depth_loss` (its mean over
    depths), and ``chain_tv`` as it is (already a sum over the chain)."""
    value = depth_loss(name, logits, p, target)
    return value if name == "chain_tv" else value * logits.shape[0]


def confidence_target(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """c* = 1 - TV(q, p) per position, q = softmax(logits) detached: [..., Vd] -> [...] in [0, 1].

    TV is over the full vocabulary, where q is zero outside the draft vocabulary and p keeps
    the mass this slice lacks; then 1 - TV = sum_v min(p(v), q(v)) over the draft vocabulary
    (:func:`acceptance`), the probability that speculative sampling accepts a token drawn from q."""
    return acceptance(logits.detach(), p.detach())


def confidence_loss(name: str, confidence_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean loss of predicted confidences c = sigmoid(confidence_logits) [...] against ``target`` [...]
    in [0, 1]: ``bce`` (binary cross-entropy with soft labels) or ``mse`` ((c - target)^2)."""
    logits, target = confidence_logits.float(), target.float()
    if name == "bce":
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, target)
    if name == "mse":
        return (torch.sigmoid(logits) - target).pow(2).mean()
    raise ValueError(f"unknown confidence loss {name!r}; expected one of {', '.join(CONFIDENCE_LOSSES)}")
