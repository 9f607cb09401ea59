"""SmoothQuant-style smoothing for the ``w8a8`` kernel: per-channel factors folded into the weights.

A ``w8a8`` layer quantizes each activation row on one grid (its minimum to its
maximum), so a few outlier input channels crush the others. For an input
channel j with calibrated largest activation ``a_j`` and largest weight ``w_j``
(over the layer's output rows), ``s_j = a_j ** alpha / w_j ** (1 - alpha)``
moves part of the range into the weights: the input is divided by ``s`` and the
weight's column j multiplied by it, which computes the same product in exact
arithmetic. The division is folded where it is free:

* q/k/v and gate/up: into the RMSNorm weight before them;
* the LM head: into the final RMSNorm weight;
* o_proj: into v_proj's output rows (attention mixes each value channel only with
  itself; one factor per key/value head and head dim, shared by its query heads);
* down_proj: into up_proj's output rows (SiLU(gate) * up is linear in up).

So the forward is unchanged apart from its weights, and stays batch invariant. The
statistics come from :data:`CALIBRATION_TEXT` (fixed, shipped here: no evaluation
prompt), fed through the float32 transformers model at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The fixed calibration text (specgen's own documentation prose; never a benchmark prompt).
CALIBRATION_TEXT = (
    "specgen is a toolkit for fast local text generation with speculative decoding that does not change what "
    "the model says. A drafter proposes a few tokens, the target model verifies them in one forward pass, and "
    "rejection sampling keeps the target's output distribution. Every run declares its guarantee: exact, greedy, "
    "approximate with the reason, or off with the reason. Configuration files compose a target model, a drafter, "
    "a stack of logit processors and grammar constraints such as a JSON schema or a regular expression into one "
    "pipeline. The planner chooses how many draft tokens to verify in each round from a cost table measured on "
    "this model, data type, device and thread count, and from the drafter's own confidence in past rounds.\n\n"
    "Prompt lookup finds the last few tokens earlier in the context and proposes what followed them there; it "
    "costs almost nothing and helps most when the answer repeats the question, as in code edits, summaries and "
    "extraction. A small draft model of the same family proposes tokens for any text, at the price of its own "
    "forward passes. Learned heads on the target's hidden features propose trees of candidates, and the target "
    "verifies a whole tree in one pass with an attention mask.\n\n"
    "Why is the output unchanged? For each draft token the target's probability p and the drafter's probability "
    "q are compared: the token is kept with probability min(1, p / q), and on the first rejection a replacement "
    "is drawn from the normalized residual max(0, p - q). The kept tokens follow the target's distribution "
    "exactly. Under greedy decoding the rule keeps a token when it is the target's argmax.\n\n"
    "def verify(target, cache, draft):\n    logits = target.forward(cache, draft, keep=len(draft) + 1)\n"
    "    return [int(row.argmax()) for row in logits]\n\n"
    "Install it in a virtual environment, run the quick start, then read the benchmark notes: they list the "
    "commands, the machines and the dates of every figure, and how the cost of one verification step grows "
    "with the number of tokens it checks."
)
#: The share of each channel's range moved into the weights.
ALPHA = 0.5


@dataclass
class Smoothing:
    """Calibrated largest input magnitudes [in] per linear, by ``(layer index, name)`` with names
    ``qkv``, ``output``, ``gate_up``, ``down`` (layer None: ``head``), and the ``alpha`` to use."""

    maxima: dict[tuple[int | None, str], torch.Tensor]
    alpha: float = ALPHA

    def factors(self, key: tuple[int | None, str], weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] -> s [in]: ``a ** alpha / w ** (1 - alpha)``, within 1e-3..1e3."""
        return self._ratio(self.maxima[key], weight.abs().amax(0))  # [in]

    def _ratio(self, activation: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
        """Largest activations and weights per channel (same shape) -> the factors."""
        return (activation.clamp_min(1e-5) ** self.alpha / column.clamp_min(1e-5) ** (1 - self.alpha)).clamp(1e-3, 1e3)

    def apply(self, index: int, weights: dict[str, torch.Tensor], heads: int, kv_heads: int) -> None:
        """Fold the factors into one layer's float32 ``weights`` in place (names: attention_norm,
        q, k, v, v_bias (or absent), output, mlp_norm, gate, up, down; all [out, in] or [d])."""
        groups = heads // kv_heads
        output = weights["output"]  # [d, heads * hd]
        per_head = self.maxima[(index, "output")].view(kv_heads, groups, -1).amax(1)  # [kv, hd]
        column = output.abs().amax(0).view(kv_heads, groups, -1).amax(1)  # [kv, hd]
        s = self._ratio(per_head, column)  # [kv, hd]
        weights["v"] = weights["v"] / s.reshape(-1, 1)
        if weights.get("v_bias") is not None:
            weights["v_bias"] = weights["v_bias"] / s.reshape(-1)
        weights["output"] = output * s[:, None, :].expand(-1, groups, -1).reshape(1, -1)
        s = self.factors((index, "down"), weights["down"])  # [inter]
        weights["up"], weights["down"] = weights["up"] / s[:, None], weights["down"] * s
        for norm, names, key in (("attention_norm", ("q", "k", "v"), "qkv"), ("mlp_norm", ("gate", "up"), "gate_up")):
            s = self.factors((index, key), torch.cat([weights[name] for name in names]))  # [d]
            weights[norm] = weights[norm] / s
            for name in names:
                weights[name] = weights[name] * s

    def apply_head(self, norm: torch.Tensor, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(final norm [d], LM head [vocab, d]) -> both with the head's factors folded in."""
        s = self.factors((None, "head"), head)  # [d]
        return norm / s, head * s


@torch.inference_mode()
def calibrate(model: torch.nn.Module, ids: list[int], alpha: float = ALPHA) -> Smoothing:
    """Feed ``ids`` through the transformers ``model`` (float32) and record every linear input's
    largest magnitude per channel."""
    maxima: dict[tuple[int | None, str], torch.Tensor] = {}

    def record(key):
        def hook(module, inputs):
            seen = inputs[0].detach().float().abs().flatten(0, -2).amax(0)  # [in]
            maxima[key] = seen if key not in maxima else torch.maximum(maxima[key], seen)
        return hook

    watched = [(model.get_output_embeddings(), (None, "head"))]
    for index, block in enumerate(model.model.layers):
        watched += [(block.self_attn.q_proj, (index, "qkv")), (block.self_attn.o_proj, (index, "output")),
                    (block.mlp.gate_proj, (index, "gate_up")), (block.mlp.down_proj, (index, "down"))]
    handles = [module.register_forward_pre_hook(record(key)) for module, key in watched]
    try:
        model(torch.tensor([ids]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return Smoothing(maxima, alpha)
