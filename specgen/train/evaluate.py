"""Held-out evaluation of a draft head against the frozen target.

Per draft position k = 1..D (chain depth for EAGLE/MTP, head for Medusa), over
every held-out start position with D tokens of look-ahead:

* ``accept`` -- mean sum_v min(p_k, q_k): the probability that speculative
  sampling at T = 1 accepts the draft token at k, given it got to k;
* ``greedy`` -- share of positions where argmax q_k is the target's greedy token;
* ``chain_accept`` / ``chain_greedy`` -- means of the cumulative products over
  depths 1..k, the probability that the chain is accepted up to k. Their sums are
  the expected number of accepted draft tokens per round (``expected_accepted``,
  ``expected_greedy_accepted``).

A DSpark head also reports its confidence per position: ``confidence`` (mean c_k)
and ``confidence_error`` (mean |c_k - c*_k|, c*_k = 1 - TV(q_k, p_k) = the ``accept``
figure of that position).

Deeper positions are teacher-forced with the data's tokens, so the chain
figures approximate (they do not simulate) what decoding will see.
"""

from __future__ import annotations

import torch

from specgen.heads.modules import DraftHead
from specgen.train.data import Features
from specgen.train.loop import batch_targets, depth_of, head_logits
from specgen.train.losses import acceptance


@torch.inference_mode()
def evaluate(head: DraftHead, feats: Features, lookup: torch.Tensor, *, unroll: int, device: torch.device,
             batch: int = 512) -> dict:
    depth = depth_of(head, unroll)
    starts = feats.starts(depth)
    was_training = head.training
    head.eval()
    names = ("accept", "greedy", "chain_accept", "chain_greedy")
    if head.cfg.kind == "dspark":
        names += ("confidence", "confidence_error")
    sums = {name: torch.zeros(depth, dtype=torch.float64) for name in names}
    if head.cfg.kind == "eagle3":  # an attention head sees each sequence whole, as when decoding
        chunks = [part for part in torch.split(starts, _sequence_lengths(feats, starts)) if part.numel()]
    else:
        chunks = list(torch.split(starts, batch))
    for pick in chunks:
        inputs, tokens, p, greedy = batch_targets(head, feats, lookup, pick, depth, device)
        if head.cfg.kind == "dspark":
            logits, confidence = head.teacher_forced(inputs, tokens)  # [D, B, Vd], [D, B]
        else:
            logits, confidence = head_logits(head, inputs, tokens), None
        alpha = acceptance(logits, p).double()  # [D, B]
        if confidence is not None:
            confidence = torch.sigmoid(confidence.float()).double()
            sums["confidence"] += confidence.sum(1).cpu()
            sums["confidence_error"] += (confidence - alpha).abs().sum(1).cpu()
        agree = (logits.argmax(-1) == greedy).double()  # greedy = -1 outside the draft vocab: never agrees
        for name, value in (("accept", alpha), ("greedy", agree), ("chain_accept", alpha.cumprod(0)),
                            ("chain_greedy", agree.cumprod(0))):
            sums[name] += value.sum(1).cpu()
    head.train(was_training)
    n = max(1, starts.numel())
    metrics = {name: [round(float(v) / n, 5) for v in total] for name, total in sums.items()}
    metrics["expected_accepted"] = round(sum(metrics["chain_accept"]), 5)
    metrics["expected_greedy_accepted"] = round(sum(metrics["chain_greedy"]), 5)
    metrics["positions"] = int(starts.numel())
    return metrics


def _sequence_lengths(feats: Features, starts: torch.Tensor) -> list[int]:
    """How many of the sorted ``starts`` fall in each sequence."""
    return torch.bucketize(starts, feats.offsets[1:], right=True).bincount(minlength=len(feats.offsets) - 1).tolist()


def table(metrics: dict) -> str:
    """A small markdown table, one row per draft position."""
    lines = ["| k | accept (T=1) | greedy agree | P(chain to k), T=1 | P(chain to k), greedy |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for k, row in enumerate(zip(metrics["accept"], metrics["greedy"], metrics["chain_accept"],
                                metrics["chain_greedy"]), start=1):
        lines.append(f"| {k} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    if "confidence" in metrics:
        lines.append("\nhead confidence c_k, mean / mean |c_k - c*_k|: " + ", ".join(
            f"k={k} {c:.3f} / {e:.3f}"
            for k, (c, e) in enumerate(zip(metrics["confidence"], metrics["confidence_error"]), start=1)))
    lines.append(f"\nexpected accepted draft tokens per round: {metrics['expected_accepted']:.3f} (T=1), "
                 f"{metrics['expected_greedy_accepted']:.3f} (greedy); {metrics['positions']} held-out positions")
    return "\n".join(lines)
