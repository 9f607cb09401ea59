"""Drafting under a grammar, measured side by side (docs/grammar.md, "Tree drafters under a grammar").

    python scripts/grammar_drafting_bench.py tau --drafter eagle --override drafter.num_tokens=4
    python scripts/grammar_drafting_bench.py extract

``tau``: τ (tokens per target forward) of a tree drafter on scripts/grammar_bench.py's
person/invoice prompts, three modes interleaved per prompt in one process: no grammar,
the grammar with the tree ranked by raw head logits (the behaviour before masked
drafting), and the grammar with masked drafting.

``extract``: examples/extract_records.py's notes, constrained plain (speculative=false)
against constrained + speculative (ngram, eagle auto, eagle γ=4), interleaved per note;
tok/s, tokens per target call and the share of wall time spent in grammar work (the
grammar processor, the tree drafters' masks and walks, the n-gram grammar lookahead),
timed by wrapping those functions.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import specgen
import specgen.drafters.learned as learned
from specgen.grammar import grammar_processor

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "examples"))

from grammar_bench import PROMPTS  # noqa: E402 (a sibling script)


def tau(drafter: str, overrides: list[str], max_new_tokens: int) -> None:
    pipe = specgen.pipeline("threads=1", f"drafter={drafter}", *overrides, progress=False)
    masked, base = learned.tree_grammar, pipe.stack
    totals = {mode: [0, 0, 0.0] for mode in ("none", "raw", "masked")}  # tokens, target calls, wall
    try:
        for schema, prompts in PROMPTS.items():
            grammar = grammar_processor({"kind": "json_schema",
                                         "schema": str(ROOT / "grammars" / f"{schema}.schema.json")}, pipe.tokenizer)
            for prompt in prompts:
                for mode in totals:
                    pipe.stack = base if mode == "none" else base.with_grammar(grammar)
                    learned.tree_grammar = (lambda ctx, ids: None) if mode == "raw" else masked
                    start = time.perf_counter()
                    stats = pipe.generate(prompt, max_new_tokens=max_new_tokens, seed=0).stats
                    total = totals[mode]
                    total[0] += stats.new_tokens
                    total[1] += stats.target_calls
                    total[2] += time.perf_counter() - start
                    print(f"{schema:8s} {mode:7s} tau={stats.new_tokens / stats.target_calls:.2f} "
                          f"drafted/round={stats.drafted / max(stats.rounds, 1):.1f}", flush=True)
    finally:
        pipe.stack, learned.tree_grammar = base, masked
    for mode, (tokens, calls, wall) in totals.items():
        print(f"TOTAL {mode:7s} tau={tokens / calls:.3f} tok/s={tokens / wall:.1f}")


def extract(max_new_tokens: int) -> None:
    import extract_records

    import specgen.drafters.grammar_lookahead as lookahead
    from specgen.drafters import tree_grammar
    from specgen.grammar import GrammarProcessor

    spent = [0.0]

    def timed(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(owner, name, wrapper)

    timed(GrammarProcessor, "__call__")
    for name in ("allowed", "root", "advance"):
        timed(tree_grammar.TreeGrammar, name)
    timed(lookahead, "forced_tokens")
    configs = {"plain": ("speculative=false",), "ngram": (), "eagle-auto": ("drafter=eagle",),
               "eagle-4": ("drafter=eagle", "drafter.num_tokens=4")}
    pipes = {name: specgen.pipeline("threads=1", *o, progress=False) for name, o in configs.items()}
    totals = {name: [0, 0.0, 0.0, 0] for name in configs}  # tokens, wall, grammar s, target calls
    for schema_name, data in (("invoice", "invoices.txt"), ("person", "people.txt")):
        schema = json.loads((ROOT / "grammars" / f"{schema_name}.schema.json").read_text())
        for note in extract_records.read_notes(ROOT / "examples" / "data" / data):
            for name, pipe in pipes.items():
                spent[0] = 0.0
                start = time.perf_counter()
                (row,) = extract_records.extract(pipe, schema, [note], max_new_tokens=max_new_tokens, progress=False,
                                                 batch_size=1)  # generate(): tree drafters are not batched
                wall = time.perf_counter() - start
                calls = row["tokens"] - row["accepted"]  # one target call per round, each adds accepted + 1
                total = totals[name]
                total[0] += row["tokens"]
                total[1] += wall
                total[2] += spent[0]
                total[3] += calls
                print(f"{note[0]:16s} {name:10s} tokens={row['tokens']:4d} wall={wall:6.1f}s "
                      f"grammar={100 * spent[0] / wall:4.1f}% finish={row['finish_reason']}", flush=True)
    plain_rate = totals["plain"][0] / totals["plain"][1]
    for name, (tokens, wall, grammar, calls) in totals.items():
        rate = tokens / wall
        print(f"TOTAL {name:10s} tok/s={rate:5.2f} vs plain {rate / plain_rate:4.2f}x  "
              f"tokens/call={tokens / max(calls, 1):4.2f}  grammar share={100 * grammar / wall:4.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    tau_parser = sub.add_parser("tau", help="τ with no grammar, raw-ranked and masked trees")
    tau_parser.add_argument("--drafter", default="eagle", choices=["eagle", "medusa"])
    tau_parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    tau_parser.add_argument("--max-new-tokens", type=int, default=80)
    extract_parser = sub.add_parser("extract", help="extract_records.py, constrained plain vs speculative")
    extract_parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    if args.mode == "tau":
        tau(args.drafter, args.override, args.max_new_tokens)
    else:
        extract(args.max_new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
