"""Prompt-lookup drafting (n-gram matching over the request's own tokens).

Finds the most recent earlier occurrence of the last n tokens (n from
``max_ngram`` down to ``min_ngram``) and proposes what followed it. The proposal
is deterministic, so q is one-hot and exact verification accepts token x with
probability p(x). Under a grammar, the text the grammar forces next is proposed
first (:mod:`specgen.drafters.grammar_lookahead`) and the lookup continues after it.
"""

from __future__ import annotations

from specgen.drafters.base import EMPTY, DraftContext, Drafter, DraftSession, HFAssistant, Proposal
from specgen.drafters.grammar_lookahead import forced_tokens


def lookup(tokens: list[int], budget: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """(continuation of the latest earlier match of the longest matching suffix n-gram,
    that n-gram's length); ([], 0) without a match.

    Plain Python over the host-side token list: nothing is read back from a device."""
    length = len(tokens)
    if budget <= 0 or length < min_ngram + 1:
        return [], 0
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = tokens[-n:]
        last = pattern[-1]
        for end in range(length - 2, n - 2, -1):  # end: index of a match's last token, before the suffix itself
            if tokens[end] == last and tokens[end - n + 1: end + 1] == pattern:
                return tokens[end + 1: end + 1 + budget], n
    return [], 0


class NgramSession(DraftSession):
    def __init__(self, drafter: NgramDrafter, ctx: DraftContext):
        self.drafter = drafter
        self.ctx = ctx

    def propose(self, budget: int) -> Proposal:
        drafter = self.drafter
        forced = forced_tokens(self.ctx, drafter.encode, budget) if drafter.encode is not None else []
        history = self.ctx.committed.tokens + forced
        found, n = lookup(history, budget - len(forced), drafter.max_ngram, drafter.min_ngram)
        # confidence: 1 for grammar-forced text, else grows with the matched n-gram's length
        confidence = [1.0] * len(forced) + [n / (drafter.max_ngram + 1)] * len(found)
        return Proposal(forced + found, confidence=confidence) if forced or found else EMPTY


class NgramDrafter(Drafter):
    name = "ngram"
    deterministic = True

    def __init__(self, num_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1, encode=None):
        """encode: text -> token ids of the target's tokenizer, for grammar lookahead (None = off)."""
        super().__init__(num_tokens)
        self.encode = encode
        if not 1 <= min_ngram <= max_ngram:
            from specgen.errors import ConfigError

            raise ConfigError(f"drafter needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = int(max_ngram)
        self.min_ngram = int(min_ngram)

    def session(self, ctx: DraftContext) -> DraftSession:
        return NgramSession(self, ctx)

    @property
    def hf_assistant(self) -> HFAssistant:
        return HFAssistant("hf_prompt_lookup", max_ngram=self.max_ngram)


def build(*, runtime, kind: str = "ngram", num_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1,
          grammar_lookahead: bool = True) -> NgramDrafter:
    """Hydra factory (``_target_`` of conf/drafter/ngram.yaml)."""
    tokenizer = runtime.target.tokenizer.tokenizer

    def encode(text: str) -> list[int]:
        return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]

    return NgramDrafter(num_tokens=num_tokens, max_ngram=max_ngram, min_ngram=min_ngram,
                        encode=encode if grammar_lookahead else None)
