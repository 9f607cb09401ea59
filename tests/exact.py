"""Independent reference for the target's sequence distribution, and a goodness-of-fit test.

``exact_distribution`` enumerates every output sequence of a tiny pipeline with
its exact probability: for each prefix it runs the target on prompt + prefix
from an empty cache and applies the pipeline's processor stack with that prefix
as history. It shares no code with rounds, drafters or cache cropping, so it is
an oracle for them.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from scipy import stats as scipy_stats

from specgen.errors import DeadEndError
from specgen.processors import CommittedCounts, History


def exact_distribution(pipe, prompt_ids: list[int], max_new_tokens: int, stack=None) -> dict[tuple, float]:
    """{generated token tuple: probability} over all outputs (pruned below 1e-12)."""
    stack = stack or pipe.stack
    eos = set(pipe.tokenizer.eos_ids)
    vocab = pipe.tokenizer.vocab_size
    out: dict[tuple, float] = {}

    def visit(prefix: list[int], mass: float) -> None:
        if mass < 1e-12:
            return
        if len(prefix) == max_new_tokens or (prefix and prefix[-1] in eos):
            out[tuple(prefix)] = out.get(tuple(prefix), 0.0) + mass
            return
        raw = pipe.target.forward(pipe.target.new_cache(), prompt_ids + prefix, keep=1)  # [1, vocab]
        counts = CommittedCounts.start(prompt_ids, vocab, torch.device("cpu"))
        counts.commit(prefix)
        probs = stack.probs(raw, History(counts, [], 1))[0]  # [vocab]
        for token in torch.nonzero(probs).flatten().tolist():
            visit(prefix + [token], mass * float(probs[token]))

    visit([], 1.0)
    return out


def exact_outcomes(pipe, prompt_ids: list[int], max_new_tokens: int, stack=None) -> dict[tuple, float]:
    """{(generated token tuple, finish_reason): probability} over all outputs of plain
    decoding (pruned below 1e-12), dead ends included: a prefix where the stack raises
    DeadEndError ends with "dead_end", as the engine does."""
    stack = stack or pipe.stack
    eos = set(pipe.tokenizer.eos_ids)
    vocab = pipe.tokenizer.vocab_size
    out: dict[tuple, float] = {}

    def add(prefix: list[int], reason: str, mass: float) -> None:
        out[(tuple(prefix), reason)] = out.get((tuple(prefix), reason), 0.0) + mass

    def visit(prefix: list[int], mass: float) -> None:
        if mass < 1e-12:
            return
        if prefix and prefix[-1] in eos:
            return add(prefix, "eos", mass)
        if len(prefix) == max_new_tokens:
            return add(prefix, "length", mass)
        raw = pipe.target.forward(pipe.target.new_cache(), prompt_ids + prefix, keep=1)  # [1, vocab]
        counts = CommittedCounts.start(prompt_ids, vocab, torch.device("cpu"))
        counts.commit(prefix)
        try:
            probs = stack.probs(raw, History(counts, [], 1))[0]  # [vocab]
        except DeadEndError:
            return add(prefix, "dead_end", mass)
        for token in torch.nonzero(probs).flatten().tolist():
            visit(prefix + [token], mass * float(probs[token]))

    visit([], 1.0)
    return out


def sample_outcomes(pipe, prompt_ids: list[int], max_new_tokens: int, num: int, **kwargs) -> Counter:
    """Counts of (generated token tuple, finish_reason) over seeds 0..num-1."""
    gens = (pipe.generate(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, seed=seed, **kwargs)
            for seed in range(num))
    return Counter((tuple(gen.token_ids), gen.finish_reason) for gen in gens)


def sample_counts(pipe, prompt_ids: list[int], max_new_tokens: int, num: int, **kwargs) -> Counter:
    """Counts of generated sequences over seeds 0..num-1."""
    return Counter(
        tuple(pipe.generate(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, seed=seed, **kwargs).token_ids)
        for seed in range(num)
    )


def assert_greedy_identity(pipe, prompts: list[list[int]], max_new_tokens: int) -> int:
    """Assert that ``pipe``'s speculative output equals its plain output token for token on every
    prompt (ids); -> how many tokens were drafted in all (a caller asserts it is not 0)."""
    drafted = 0
    for prompt in prompts:
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=max_new_tokens)
        plain = pipe.generate(prompt_ids=prompt, max_new_tokens=max_new_tokens, speculative=False)
        assert spec.token_ids == plain.token_ids, prompt
        drafted += spec.stats.drafted
    return drafted


def goodness_of_fit(counts: Counter, expected: dict[tuple, float], min_expected: float = 5.0) -> tuple[float, float]:
    """(chi-square p-value, total-variation distance) of ``counts`` against ``expected``.

    Outcomes with expected count below ``min_expected`` are pooled into one bin.
    An observed outcome with zero expected probability gives p-value 0.
    """
    total = sum(counts.values())
    if any(seq not in expected for seq in counts):
        return 0.0, 1.0
    big = [seq for seq, p in expected.items() if p * total >= min_expected]
    small = [seq for seq in expected if seq not in set(big)]
    observed = [counts.get(seq, 0) for seq in big]
    wanted = [expected[seq] * total for seq in big]
    if small:
        observed.append(sum(counts.get(seq, 0) for seq in small))
        wanted.append(sum(expected[seq] for seq in small) * total)
    wanted = np.array(wanted) * (sum(observed) / sum(wanted))
    p_value = float(scipy_stats.chisquare(observed, wanted).pvalue)
    tv = 0.5 * sum(abs(counts.get(seq, 0) / total - p) for seq, p in expected.items())
    return p_value, tv


def peeking_draw(pipe, vocab_size: int):
    """A negative control for online stopping: :meth:`ChainDraws.draw` that drops a drawn token (and stops
    the chain) where the target's processed p of it is below q, so drafts the verifier might reject never
    reach it. Patch it in for ``ChainDraws.draw``; the output distribution must then fail the fit."""
    from specgen.drafters.chain_draw import ChainDraws

    draw = ChainDraws.draw

    def peeking(self, raw, greedy_peak_logits, confidence=None):
        token = draw(self, raw, greedy_peak_logits, confidence)
        if token is None:
            return None
        context = list(self.committed.tokens) + [int(t) for t in self.tokens[:-1]]
        target_raw = pipe.target.forward(pipe.target.new_cache(), context, keep=1)  # [1, vocab]
        counts = CommittedCounts.start(context[: self.committed.num_prompt], vocab_size, torch.device("cpu"))
        counts.commit(context[self.committed.num_prompt:])
        target_p = float(pipe.stack.probs(target_raw, History(counts, [], 1))[0, int(token)])
        if target_p < float(self.rows[-1][int(token)]):
            self.tokens.pop(), self.rows.pop(), self.peaks.pop()
            if self.on_device:
                self.checks.pop()
            return None
        return token

    return peeking
