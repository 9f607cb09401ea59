"""Teacher-forced features of the frozen target: packed, batched prefill forwards.

Sequences are packed whole into rows (first-fit decreasing, :func:`pack_rows`):
a row holds several sequences back to back, each with its own positions
0..n-1 and a block-diagonal causal attention mask, so no token attends across
a sequence boundary and the only padding is the unfilled tail of a row. Rows
are ``width`` tokens wide (at least the longest sequence), so attention never
spans more than one row; ``batch_tokens`` tokens of rows go through one forward
under ``torch.inference_mode``.

Per position the result keeps the token, the final normalised hidden state
(what the LM head reads, in ``store_dtype``), the head's input feature (the
named hidden states concatenated: EAGLE-3's low / middle / high layers; none
for heads that read the final state: Medusa, and EAGLE / MTP by default), the
full-vocabulary logsumexp of the target logits of the *stored* hidden state in
float32 (:func:`specgen.train.data.lm_logits`, so the soft labels training
recomputes over the draft vocabulary sum to 1 over the full vocabulary) and
the target's greedy token: the argmax of the model-dtype hidden state's
logits. The LM head runs once per position: when the stored hidden state is
rounded, the greedy token is recomputed exactly only for the vocabulary
entries whose logit the rounding can have moved past the stored maximum
(:func:`exact_argmax`).

Features are the target's, up to float rounding: a packed batch sums the same
products as an unbatched forward in another order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specgen.train.data import Features, lm_logits

_LOGIT_ROWS = 512  # rows per chunk of full-vocabulary logits
_CANDIDATES = 8  # largest stored logits exact_argmax recomputes per row


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """Sequence indices packed into rows of ``width`` tokens, first-fit decreasing.

    Every sequence lands in exactly one row, whole; a sequence longer than
    ``width`` gets a row of its own. Deterministic: ties keep index order."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        need = lengths[i]
        for r, room in enumerate(free):
            if room >= need:
                rows[r].append(i)
                free[r] -= need
                break
        else:
            rows.append([i])
            free.append(max(width, need) - need)
    return rows


def row_batches(rows: list[list[int]], lengths: list[int], batch_tokens: int) -> list[list[list[int]]]:
    """Consecutive rows grouped so that rows x widest row <= batch_tokens (at least one row each)."""
    batches: list[list[list[int]]] = []
    widest = 0
    for row in rows:
        size = sum(lengths[i] for i in row)
        if batches and max(widest, size) * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(row)
            widest = max(widest, size)
        else:
            batches.append([row])
            widest = size
    return batches


def packed_inputs(rows: list[list[int]], sequences: list[list[int]]):
    """-> (ids [B, W], positions [B, W], allowed [B, W, W] bool, segments [B, W]) for rows of sequences.

    segments[b, j] is the index of the sequence at row b, column j (-1 = padding);
    a token sees the earlier tokens of its own segment (padding: of the padding)."""
    width = max(sum(len(sequences[i]) for i in row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.arange(width).repeat(len(rows), 1)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        at = 0
        for i in row:
            n = len(sequences[i])
            ids[b, at: at + n] = torch.tensor(sequences[i])
            positions[b, at: at + n] = torch.arange(n)
            segments[b, at: at + n] = i
            at += n
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = (segments.unsqueeze(2) == segments.unsqueeze(1)) & causal  # [B, W, W]
    return ids, positions, allowed, segments


def exact_argmax(hidden: torch.Tensor, logits: torch.Tensor, stored: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, row_norm: torch.Tensor) -> torch.Tensor:
    """argmax_v of hidden @ weight.T (+ bias) given the logits of the rounded ``stored`` hidden state.

    hidden, stored [N, d]; logits [N, V] float32 of ``stored``; row_norm: max_v ||weight_v||.
    |logit_v(hidden) - logit_v(stored)| <= ||hidden - stored|| * row_norm, so only the v
    within twice that (plus float32 slack) of the stored maximum can be the argmax.
    Those among the ``_CANDIDATES`` largest stored logits are recomputed from ``hidden``
    (the same sums as the full product, up to float rounding) and the first maximum
    wins, as ``argmax`` picks; a row with more candidates gets the full product."""
    bound = (hidden.to(torch.float32) - stored.to(torch.float32)).norm(dim=-1) * row_norm  # [N]
    k = min(_CANDIDATES, logits.shape[1])
    top, cols = logits.topk(k, dim=-1)  # [N, k] each, descending
    threshold = top[:, 0] - 2 * bound - 1e-4 * (1.0 + top[:, 0].abs())  # [N]
    keep = top >= threshold.unsqueeze(-1)  # [N, k]
    values = (hidden.unsqueeze(1) * weight[cols].to(hidden.dtype)).sum(-1).to(torch.float32)  # [N, k]
    if bias is not None:
        values = values + bias[cols].to(torch.float32)
    values = values.masked_fill(~keep, float("-inf"))
    best = values.max(-1, keepdim=True).values
    first = cols.masked_fill(values != best, logits.shape[1]).min(-1).values  # [N], the lowest id at the max
    full = keep[:, -1].nonzero().squeeze(1)  # rows whose candidates may go past the k kept
    if full.numel():
        first[full] = torch.nn.functional.linear(hidden[full], weight.to(hidden.dtype), bias).argmax(-1)
    return first


def _lm_head(hidden: torch.Tensor, store_dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None,
             row_norm: torch.Tensor):
    """hidden [N, d] (model dtype) -> (stored [N, d], lse [N] float32, greedy [N] long), one product per chunk."""
    stored = hidden.to(store_dtype)
    lse, greedy = [], []
    for c in range(0, hidden.shape[0], _LOGIT_ROWS):
        h, s = hidden[c: c + _LOGIT_ROWS], stored[c: c + _LOGIT_ROWS]
        logits = lm_logits(s, weight, bias)  # [n, V] float32
        lse.append(torch.logsumexp(logits, -1))
        if torch.equal(h.to(torch.float32), s.to(torch.float32)):
            greedy.append(logits.argmax(-1))
        else:
            greedy.append(exact_argmax(h, logits, s, weight, bias, row_norm))
    return stored, torch.cat(lse), torch.cat(greedy)


@torch.inference_mode()
def extract_features(model, sequences: list[list[int]], layers: list[int], vocab_size: int, *,
                     store_dtype: torch.dtype = torch.bfloat16, width: int | None = None,
                     batch_tokens: int = 4096, on_batch: Callable[[int], None] | None = None) -> Features:
    """Features of ``sequences`` (in their order) from packed prefill forwards of ``model``.

    layers: hidden-state indices of the head's input feature ([] = none stored);
    width: row width in tokens (None = the longest sequence); on_batch(tokens) is called after each forward."""
    from specgen.heads.modules import select_features

    device = next(model.parameters()).device
    lm_head = model.get_output_embeddings()
    weight = lm_head.weight[:vocab_size]  # [V, d]
    bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias[:vocab_size]
    row_norm = weight.to(torch.float32).norm(dim=-1).max()
    lengths = [len(s) for s in sequences]
    dtype = next(model.parameters()).dtype
    parts: dict[int, tuple] = {}
    for batch in row_batches(pack_rows(lengths, width or max(lengths)), lengths, batch_tokens):
        ids, positions, allowed, segments = packed_inputs(batch, sequences)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        out = model.base_model(input_ids=ids.to(device), position_ids=positions.to(device),
                               attention_mask=mask[:, None].to(device), output_hidden_states=bool(layers),
                               use_cache=False)
        real = segments >= 0  # [B, W]
        stored, lse, greedy = _lm_head(out.last_hidden_state[real.to(device)], store_dtype, weight, bias, row_norm)
        feature = None if not layers else select_features(out.hidden_states, layers)[real.to(device)]
        owner = segments[real]  # [N] sequence index per real token, each sequence contiguous
        for i in owner.unique_consecutive().tolist():
            at = (owner == i).nonzero().squeeze(1)
            parts[i] = (stored[at].cpu(), None if feature is None else feature[at].to("cpu", store_dtype),
                        lse[at].cpu(), greedy[at].cpu())
        if on_batch is not None:
            on_batch(int(real.sum()))
    return _assemble(sequences, parts, bool(layers))


def _assemble(sequences: list[list[int]], parts: dict[int, tuple], has_feature: bool) -> Features:
    def cat(j: int) -> torch.Tensor:
        return torch.cat([parts[i][j] for i in range(len(sequences))])

    lengths = torch.tensor([0, *(len(s) for s in sequences)])
    return Features(tokens=torch.tensor([t for s in sequences for t in s], dtype=torch.long), hidden=cat(0),
                    feature=cat(1) if has_feature else None, lse=cat(2), argmax=cat(3), offsets=lengths.cumsum(0))
