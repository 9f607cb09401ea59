"""Batch invariance, measured through the target protocol: do the logits of a position fed with
others equal those of the same position fed alone, bit for bit?

An ``exact``/``greedy`` guarantee rests on that equality (a verify pass must compute the p that
plain decoding would), so every backend measures it at load with these probes
(``Target.verify_gap``), over the widths and trees its run verifies. A probe feeds a fixed
``prefix`` of tokens once, then the candidates both ways on the same KV handle, and returns the
largest absolute logit difference: 0.0 is the only value that keeps the guarantee.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from specgen.sampling.tree_structure import ROOT, ancestor_matrix, tree_depths, tree_paths

#: Tokens of the fixed prefix the probes feed first.
GAP_PREFIX = 16


def probe_tokens(vocab_size: int, count: int) -> list[int]:
    """``count`` fixed token ids spread over the vocabulary (the same for every backend)."""
    return [(7919 * i + 11) % vocab_size for i in range(count)]


def chain_gap_probe(target, prefix: int, length: int) -> Callable[[int], float]:
    """-> gap(width) for width <= ``length``: on one KV handle of ``target``, ``prefix`` fixed
    tokens are fed once and ``length`` tokens after them one by one; gap feeds the first
    ``width`` of those together after the prefix and compares. One handle throughout: where a
    sequence's entries lie in a backend's cache pool may change the logits too, which is not
    what is measured."""
    tokens = probe_tokens(target.vocab_size, prefix + length)
    cache = target.new_cache()
    target.forward(cache, tokens[:prefix], keep=1)
    alone = torch.cat([target.forward(cache, [t], keep=1) for t in tokens[prefix:]])  # [length, vocab]

    def gap(width: int) -> float:
        cache.crop(prefix)
        together = target.forward(cache, tokens[prefix: prefix + width], keep=width)  # [width, vocab]
        return float((together - alone[:width]).abs().max())

    return gap


def chain_gaps(target, widths: Iterable[int], prefix: int = GAP_PREFIX) -> dict[int, float]:
    """{width: gap} for every chain width in ``widths`` (each at least 1), on one probe."""
    widths = sorted(set(widths))
    if not widths:
        return {}
    probe = chain_gap_probe(target, prefix, max(widths))
    return {w: probe(w) for w in widths}


def prefix_gap(target, prompt: int = 40, decoded: int = 6, rest: int = 40, after: int = 8, floor: int = 1) -> float:
    """Prefix reuse (``Capabilities.prefix_reuse``) as a prefix cache does it: the largest |logit|
    difference between a handle that holds a prefix as a run leaves it (a ``prompt`` fed in one
    forward, ``decoded`` tokens one at a time, then synced to a longer prompt as a prefix cache does:
    :meth:`~specgen.models.target.TokenCache.keep_prefix_of` with ``floor``, the backend's
    ``prefill_floor``) and then fed the rest in one forward, and a fresh handle fed every id in one
    forward; compared on that forward's last row and the ``after`` rows of a forward of ``after``
    further tokens on each. The two feed the same positions in differently composed forwards; 0.0: a
    cached prefix gives a fresh prefill's logits bit for bit."""
    tokens = probe_tokens(target.vocab_size, prompt + decoded + rest + after)
    total = prompt + decoded + rest
    kept, fresh = target.new_cache(), target.new_cache()
    try:
        target.forward(kept, tokens[:prompt], keep=1)
        for token in tokens[prompt: prompt + decoded]:
            target.forward(kept, [token], keep=1)
        kept.crop(prompt + decoded - 1)
        start = kept.keep_prefix_of(tokens[:total], floor)
        reused = torch.cat([target.forward(kept, tokens[start:total], keep=1),
                            target.forward(kept, tokens[total:], keep=after)])  # [1 + after, vocab]
        whole = torch.cat([target.forward(fresh, tokens[:total], keep=1),
                           target.forward(fresh, tokens[total:], keep=after)])  # [1 + after, vocab]
    finally:
        kept.release()
        fresh.release()
    return float((reused - whole).abs().max())


def span_splits(n: int, chunk: int, floor: int) -> list[int]:
    """The widths of the forwards an ``n``-token prefill is fed in: ``chunk`` tokens each from its first
    token, the rest last; where that rest is narrower than ``floor`` (the fewest tokens whose forward
    computes as a wide one does) and the last two forwards can both hold ``floor``, those two are
    split evenly instead (the larger first), so every forward of the prefill computes alike."""
    sizes = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    if len(sizes) >= 2 and sizes[-1] < floor and chunk + sizes[-1] >= 2 * floor:
        total = chunk + sizes.pop()
        sizes[-1:] = [total - total // 2, total // 2]
    return sizes


def worst(gaps: dict[int, float]) -> tuple[float, int]:
    """(largest gap, its width; the narrowest on a tie) of a {width: gap} map; (0.0, 0) when empty."""
    if not gaps:
        return 0.0, 0
    at = max(gaps, key=lambda w: (gaps[w], -w))
    return gaps[at], at


def probe_tree(branches: int, depth: int) -> list[int]:
    """Parents of a probe tree: ``branches`` chains of ``depth`` nodes under the root, numbered
    level by level, so every prefix of the node list is a tree too (``parents[i] < i``)."""
    parents = []
    for level in range(depth):
        for branch in range(branches):
            parents.append(ROOT if level == 0 else (level - 1) * branches + branch)
    return parents


def tree_gaps(target, parents: list[int], sizes: Iterable[int], read_rows, prefix: int = GAP_PREFIX
              ) -> dict[int, float]:
    """{tokens fed: gap} of tree forwards (``target.forward_tree``) over the first n nodes of
    ``parents`` for n in ``sizes``: each node's logits against its path fed one token at a time
    after the same prefix. ``read_rows(out, n)`` -> [n + 1, vocab] float32, the rows of a tree
    forward read as the run reads them (row 0: the root)."""
    nodes = probe_tokens(target.vocab_size, prefix + 1 + len(parents))[prefix + 1:]
    tokens = probe_tokens(target.vocab_size, prefix + 1)
    cache = target.new_cache()
    target.forward(cache, tokens[:prefix], keep=1)
    root = target.forward(cache, tokens[prefix:], keep=1)  # [1, vocab]
    alone: list[torch.Tensor | None] = [None] * len(parents)  # node -> [1, vocab]: its path fed one token at a time
    leaves = set(range(len(parents))) - set(parents)
    for path in (p for p in tree_paths(parents) if p[-1] in leaves):  # every node lies on a leaf's path
        cache.crop(prefix + 1)
        for node in path:
            alone[node] = target.forward(cache, [nodes[node]], keep=1)
    gaps = {}
    for n in sorted({min(max(1, s), len(parents)) for s in sizes}):
        cache.crop(prefix)
        sub = parents[:n]
        out = target.forward_tree(cache, tokens[prefix:], nodes[:n], ancestor_matrix(sub), tree_depths(sub))
        rows = read_rows(out, n)  # [n + 1, vocab]
        single = torch.cat([root, *alone[:n]])  # [n + 1, vocab]
        gaps[n + 1] = float((rows - single).abs().max())
    return gaps
