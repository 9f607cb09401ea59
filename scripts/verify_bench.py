"""Whether the chain fast path of :func:`specgen.sampling.verify` pays: a drafted chain verified by
the chain verifier (``parents=None``, every row at hand) against the same chain walked as a tree
(``parents=[-1, 0, 1, ...]``, the rows prefetched), arms interleaved in one process.

    python scripts/verify_bench.py --vocab 49152 --gammas 4,8 --repeats 200

Prints the fastest and the median microseconds per verification of each arm (noise only adds time:
on a loaded machine read the fastest), and tree / chain of each, for sampled drafts (draft_probs
given) and one-hot drafts (draft_probs None), and the host reads per verification of a read_once
round's call (the chain with ``draw_ahead=True``; what a GPU stalls on), counted with
:func:`specgen.bench.host_reads.counting_reads`. Inputs are random rows of float64 probabilities,
the draft tokens drawn from the draft rows, so rounds accept about as often as the rows agree.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specgen.bench.host_reads import counting_reads
from specgen.sampling import chain_parents, sample_token, verify


def _inputs(vocab: int, gamma: int, seed: int, sampled: bool):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(gamma + 1, vocab, generator=gen, dtype=torch.float64) * 3  # [gamma + 1, vocab]
    target = torch.softmax(logits, dim=-1)  # [gamma + 1, vocab]
    draft = torch.softmax(logits[:gamma] + torch.randn(gamma, vocab, generator=gen, dtype=torch.float64), dim=-1)
    tokens = [sample_token(row, gen) for row in draft]  # [gamma]
    return target, (draft if sampled else None), tokens  # draft: [gamma, vocab] or None


def _reads(vocab: int, gamma: int, sampled: bool, repeats: int) -> tuple[float, float]:
    """Mean host reads per verification: the chain with draw_ahead (read_once rounds), the tree walk."""
    counts = [0, 0]
    for r in range(repeats):
        target, draft, tokens = _inputs(vocab, gamma, r, sampled)
        for i, (parents, ahead) in enumerate([(None, True), (chain_parents(gamma), False)]):
            with counting_reads() as count:
                verify(tokens, parents, target, torch.Generator().manual_seed(r), draft_probs=draft, draw_ahead=ahead)
            counts[i] += count[0]
    return counts[0] / repeats, counts[1] / repeats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--gammas", default="4,8")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| draft | γ | chain µs, fastest | tree µs, fastest | tree / chain | chain µs, median | tree µs, median "
          "| tree / chain | reads, chain (draw ahead) | reads, tree |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for sampled in (True, False):
        for gamma in (int(g) for g in args.gammas.split(",")):
            times: dict[str, list[float]] = {"chain": [], "tree": []}
            for r in range(args.repeats):
                target, draft, tokens = _inputs(args.vocab, gamma, r, sampled)
                arms = [("chain", None), ("tree", chain_parents(gamma))]
                for name, parents in arms if r % 2 else arms[::-1]:  # interleaved, alternating order
                    gen = torch.Generator().manual_seed(r)
                    start = time.perf_counter()
                    verify(tokens, parents, target, gen, draft_probs=draft)
                    times[name].append(time.perf_counter() - start)
            cells = []
            for summary in (min, statistics.median):
                chain, tree = (summary(times[k]) * 1e6 for k in ("chain", "tree"))
                cells.append(f"{chain:.0f} | {tree:.0f} | {tree / chain:.2f}")
            cells.append(" | ".join(f"{reads:.2f}" for reads in _reads(args.vocab, gamma, sampled, args.repeats)))
            print(f"| {'sampled' if sampled else 'one-hot'} | {gamma} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
