"""The built-in logit processors.

Each processor is a pure function of ``(logits, history)``: it validates its
arguments at construction, never keeps state between calls, and works row-wise
on a batch of positions, so evaluating N candidate positions at once gives the
same rows as N separate single-position calls.

Contract for ``__call__``: ``logits`` is [num_positions, vocab] float32 owned by
the caller's stack (it may be modified in place); the return value is the
processed logits of the same shape. Forbidden tokens get ``-inf``.

Penalty semantics follow vLLM/OpenAI: the repetition penalty looks at prompt and
generated tokens (HF ``RepetitionPenaltyLogitsProcessor`` divides positive and
multiplies negative logits); frequency and presence penalties look at generated
tokens only and subtract ``freq * count + presence * (count > 0)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specgen.errors import ConfigError
from specgen.config.options import check_temperature
from specgen.processors.history import History

NEG_INF = float("-inf")


class Processor:
    """Base class: subclasses set the two capability flags and implement ``__call__``.

    argmax_invariant: the processor never changes which token has the largest
        logit, so greedy decoding may skip it (temperature, top-k/p, min-p).
    pure: the processor is a function of (logits, history) only and can be
        evaluated on hypothetical histories; exact speculation requires it.
    host_tokens: it reads the history's token ids (``tail``/``full``), not only its
        counts, so a drafter must read each drafted token back before the next step.
    """

    name = "processor"
    argmax_invariant = False
    pure = True
    host_tokens = False

    def __call__(self, logits: torch.Tensor, history: History) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{self.name}({args})"


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


class Temperature(Processor):
    name = "temperature"
    argmax_invariant = True

    def __init__(self, temperature: float):
        _check(temperature > 0, f"sampling.temperature must be > 0 here (0 means greedy), got {temperature}")
        self.temperature = check_temperature(float(temperature), "sampling.temperature")

    def __call__(self, logits, history):
        return logits.div_(self.temperature)


class TopK(Processor):
    name = "top_k"
    argmax_invariant = True

    def __init__(self, top_k: int):
        _check(int(top_k) == top_k and top_k >= 1, f"sampling.top_k must be a positive integer, got {top_k}")
        self.top_k = int(top_k)

    def __call__(self, logits, history):
        if self.top_k >= logits.shape[-1]:
            return logits
        kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]  # [N, 1]
        return logits.masked_fill_(logits < kth, NEG_INF)


class TopP(Processor):
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``.

    Ties at the boundary are all kept (the rule is "probability >= that of the
    last token needed"), so the result does not depend on sort order. On the CPU
    only the top candidates are sorted, k growing until the mass is reached (one
    host read per try); elsewhere the whole row is sorted, which reads nothing back.
    """

    name = "top_p"
    argmax_invariant = True

    def __init__(self, top_p: float):
        _check(0 < top_p <= 1, f"sampling.top_p must be in (0, 1], got {top_p}")
        self.top_p = float(top_p)

    def __call__(self, logits, history):
        probs = torch.softmax(logits.to(torch.float64), dim=-1)  # [N, V]
        vocab = probs.shape[-1]
        k = min(vocab, 256) if probs.device.type == "cpu" else vocab
        while True:
            top = torch.topk(probs, k, dim=-1).values  # [N, k], descending
            mass = torch.cumsum(top, dim=-1)
            if k == vocab or bool((mass[:, -1] >= self.top_p).all()):
                break
            k = min(vocab, k * 8)
        needed = torch.searchsorted(mass, torch.full_like(mass[:, :1], self.top_p))  # [N, 1]
        threshold = top.gather(-1, needed.clamp_max(k - 1))  # [N, 1]
        return logits.masked_fill_(probs < threshold, NEG_INF)


class MinP(Processor):
    name = "min_p"
    argmax_invariant = True

    def __init__(self, min_p: float):
        _check(0 <= min_p <= 1, f"sampling.min_p must be in [0, 1], got {min_p}")
        self.min_p = float(min_p)

    def __call__(self, logits, history):
        probs = torch.softmax(logits.to(torch.float64), dim=-1)  # [N, V]
        threshold = probs.max(dim=-1, keepdim=True).values * self.min_p
        return logits.masked_fill_(probs < threshold, NEG_INF)


class RepetitionPenalty(Processor):
    name = "repetition_penalty"

    def __init__(self, penalty: float):
        _check(penalty > 0, f"sampling.repetition_penalty must be > 0, got {penalty}")
        self.penalty = float(penalty)

    def __call__(self, logits, history):
        seen = history.seen_counts > 0  # [N, V]
        penalised = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
        return torch.where(seen, penalised, logits)


class FrequencyPresencePenalty(Processor):
    name = "frequency_presence_penalty"

    def __init__(self, frequency_penalty: float = 0.0, presence_penalty: float = 0.0):
        for key, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
            _check(-2.0 <= value <= 2.0, f"sampling.{key} must be in [-2, 2], got {value}")
        self.frequency_penalty = float(frequency_penalty)
        self.presence_penalty = float(presence_penalty)

    def __call__(self, logits, history):
        counts = history.generated_counts  # [N, V]
        return logits - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).float()


class MinNewTokens(Processor):
    """Forbid the EOS ids until ``min_new_tokens`` tokens have been generated."""

    name = "min_new_tokens"

    def __init__(self, min_new_tokens: int, eos_ids: Sequence[int]):
        _check(int(min_new_tokens) == min_new_tokens and min_new_tokens >= 0,
               f"sampling.min_new_tokens must be a non-negative integer, got {min_new_tokens}")
        self.min_new_tokens = int(min_new_tokens)
        self.eos_ids = [int(i) for i in eos_ids]

    def __call__(self, logits, history):
        if not self.eos_ids:
            return logits
        too_early = (history.num_generated < self.min_new_tokens).to(logits.device)  # [N] bool
        eos = torch.tensor(self.eos_ids, device=logits.device)  # [E]
        logits[:, eos] = logits[:, eos].masked_fill(too_early.unsqueeze(-1), NEG_INF)  # no host read
        return logits


def banned_after(sequences: Sequence[Sequence[int]], history: History, row: int) -> set[int]:
    """The ids the bad-word ``sequences`` forbid at ``row``: each sequence's last token when
    the history there ends with the rest of it (a one-token sequence is always forbidden)."""
    return {seq[-1] for seq in sequences if history.tail(row, len(seq) - 1) == list(seq[:-1])}


class BadWords(Processor):
    """Forbid token sequences: a single-token entry is always banned, a longer one
    bans its last token whenever the history ends with the rest of it."""

    name = "bad_words"
    host_tokens = True

    def __init__(self, sequences: Sequence[Sequence[int]], vocab_size: int):
        cleaned = []
        for seq in sequences:
            seq = [int(t) for t in seq]
            _check(len(seq) > 0, "sampling.bad_words contains an empty entry")
            _check(all(0 <= t < vocab_size for t in seq), f"sampling.bad_words entry {seq} is outside the vocabulary")
            cleaned.append(seq)
        self.sequences = cleaned

    def __call__(self, logits, history):
        for row in range(logits.shape[0]):
            for token in banned_after(self.sequences, history, row):
                logits[row, token] = NEG_INF
        return logits
