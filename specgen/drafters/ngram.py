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


class NgramIndex:
    """Every n-gram (min_ngram <= n <= max_ngram) of a growing token list, by the positions
    where it ends: :meth:`lookup` answers what :func:`lookup` does in time independent of
    the list's length. :meth:`update` indexes what was appended and un-indexes what was cut
    (a rollback), so a round costs the tokens that changed plus one comparison of the lists."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []  # the indexed list; the n-grams ending before its last token are in ends
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the positions of its last token, ascending
        self._truncations: int | None = None  # the list's truncation count at the last update

    def update(self, tokens: list[int], truncations: int | None = None) -> None:
        """Index ``tokens`` (the list as it is now). ``truncations``: how often the list was cut so far
        (:attr:`specgen.processors.CommittedCounts.truncations`); where it is the last update's and the
        list is no shorter, the list only grew and the indexed part is not compared again."""
        old = self.tokens
        same = min(len(old), len(tokens))
        grew = truncations is not None and truncations == self._truncations and len(tokens) >= len(old)
        self._truncations = truncations
        if not grew and old[:same] != tokens[:same]:
            same = next(i for i, (a, b) in enumerate(zip(old, tokens)) if a != b)
        kept = min(same - 1, len(tokens) - 2, len(old) - 2)  # the last end whose n-grams are unchanged
        for end in range(len(old) - 2, kept, -1):  # latest first: each is the last of its n-grams' positions
            for key in self._keys(old, end):
                positions = self.ends[key]
                positions.pop()
                if not positions:
                    del self.ends[key]
        for end in range(kept + 1, len(tokens) - 1):  # every end but the last token's (the suffix itself)
            for key in self._keys(tokens, end):
                self.ends.setdefault(key, []).append(end)
        old[same:] = tokens[same:]  # the indexed list becomes tokens, copying only what changed

    def _keys(self, tokens: list[int], end: int):
        for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
            yield tuple(tokens[end - n + 1: end + 1])

    def lookup(self, budget: int) -> tuple[list[int], int]:
        """:func:`lookup` of the indexed list: (continuation, matched n) or ([], 0)."""
        tokens, length = self.tokens, len(self.tokens)
        if budget <= 0 or length < self.min_ngram + 1:
            return [], 0
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            positions = self.ends.get(tuple(tokens[-n:]))
            if positions:
                end = positions[-1]
                return tokens[end + 1: end + 1 + budget], n
        return [], 0


class NgramSession(DraftSession):
    shadows = True

    def __init__(self, drafter: NgramDrafter, ctx: DraftContext):
        self.drafter = drafter
        self.ctx = ctx
        self.index = NgramIndex(drafter.max_ngram, drafter.min_ngram)

    def propose(self, budget: int) -> Proposal:
        drafter = self.drafter
        forced = forced_tokens(self.ctx, drafter.encode, budget) if drafter.encode is not None else []
        if forced:  # the history ends in text only this round holds: scan it
            found, n = lookup(self.ctx.committed.tokens + forced, budget - len(forced), drafter.max_ngram,
                              drafter.min_ngram)
        else:
            committed = self.ctx.committed
            self.index.update(committed.tokens, committed.truncations)
            found, n = self.index.lookup(budget)
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
