"""Measure grammar costs on the default model: mask cost per token and constrained speed-up.

    python scripts/grammar_bench.py [--schema person|invoice] [--whitespace ""] [--threads 1] [--runs 2]

1. Mask cost inside a JSON string (smollm2 tokenizer, 49152 ids): the first visit
   of a state (building its mask from outlines-core) and the per-row cost of the
   grammar processor once states are cached, for 1 row (plain decoding) and
   5 rows (a verify step with 4 draft tokens).
2. Constrained generation, speculative vs plain, side by side on the same prompts
   (greedy, the default drafter): tokens/s, the ratio, and the share of wall time
   spent inside the grammar processor.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import torch

import specgen
from specgen.grammar import GrammarProcessor, grammar_processor
from specgen.processors import CommittedCounts, History, ProcessorStack

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPTS = {
    "person": [
        "Extract the person as JSON: Ada Lovelace, born 1815, English mathematician.",
        "Extract the person as JSON: Alan Turing (born 1912) was a British computer scientist.",
        "Extract the person as JSON: Grace Hopper, an American computer scientist born in 1906.",
    ],
    "invoice": [
        "Extract the invoice as JSON: Invoice INV-7 from Acme Corp, 2024-03-15, paid in EUR. 2 x widget at 9.50.",
        "Extract the invoice as JSON: Northwind invoice 31, 2024-05-02, sent, USD: 3 chairs at 40, 1 desk at 200.",
    ],
}


STRING_PREFIX = {"person": '{"name": "', "invoice": '{"invoice_number": "'}


def mask_costs(pipe, spec: dict, prefix_text: str) -> dict[str, float]:
    """Microseconds: cold mask build, then cached per-row processor cost for 1 and 5 rows."""
    info = pipe.tokenizer
    proc = grammar_processor({"kind": "json_schema", **spec}, info)
    if spec.get("whitespace") == "":
        prefix_text = prefix_text.replace(": ", ":")
    prefix = info.tokenizer.encode(prefix_text, add_special_tokens=False)
    body = info.tokenizer.encode("Ada Lovelace was a very famous English mathematician " * 8, add_special_tokens=False)
    automaton = proc.automaton
    state = automaton.state_after(prefix)
    start = time.perf_counter()
    automaton._build_mask(state)
    cold = (time.perf_counter() - start) * 1e6
    costs = {"cold_state_us": cold}
    for rows in (1, 5):
        fresh = GrammarProcessor(automaton)
        counts = CommittedCounts.start([1], info.vocab_size, torch.device("cpu"))
        counts.commit(prefix)
        logits = torch.randn(rows, info.vocab_size)
        times = []
        for i in range(len(body) - rows):
            candidates = body[i : i + rows - 1]
            history = History(counts, candidates, rows)
            start = time.perf_counter()
            fresh(logits.clone(), history)
            times.append(time.perf_counter() - start)
            counts.commit([body[i]])
        costs[f"cached_{rows}_rows_us_per_row"] = statistics.median(times) * 1e6 / rows
    return costs


def timed_processor(pipe, spent: list[float]):
    """Wrap GrammarProcessor.__call__ so the time spent inside it is added to ``spent``."""
    original = GrammarProcessor.__call__

    def wrapper(self, logits, history):
        start = time.perf_counter()
        try:
            return original(self, logits, history)
        finally:
            spent[0] += time.perf_counter() - start

    GrammarProcessor.__call__ = wrapper


def side_by_side(pipe, spec: dict, prompts: list[str], runs: int, max_new_tokens: int) -> dict[str, float]:
    """Plain and speculative constrained generation alternated on the same prompts (grammar in the stack)."""
    spent = [0.0]
    timed_processor(pipe, spent)
    base = pipe.stack
    pipe.stack = ProcessorStack([grammar_processor({"kind": "json_schema", **spec}, pipe.tokenizer), *base.processors],
                                greedy=base.greedy)
    totals = {True: [0, 0.0, 0.0], False: [0, 0.0, 0.0]}  # tokens, wall, grammar seconds
    try:
        for _ in range(runs):
            for prompt in prompts:
                for speculative in (False, True):
                    spent[0] = 0.0
                    start = time.perf_counter()
                    gen = pipe.generate(prompt, max_new_tokens=max_new_tokens, speculative=speculative)
                    wall = time.perf_counter() - start
                    totals[speculative][0] += len(gen.token_ids)
                    totals[speculative][1] += wall
                    totals[speculative][2] += spent[0]
    finally:
        pipe.stack = base
    out = {}
    for speculative, (tokens, wall, grammar) in totals.items():
        name = "speculative" if speculative else "plain"
        out[f"{name}_tok_s"] = tokens / wall
        out[f"{name}_grammar_share"] = grammar / wall
    out["ratio"] = out["speculative_tok_s"] / out["plain_tok_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schema", choices=sorted(PROMPTS), default="person")
    parser.add_argument("--whitespace", default="[ ]?", help='JSON whitespace regex ("" = compact)')
    parser.add_argument("--threads", default="1")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--override", action="append", default=[])
    args = parser.parse_args()
    pipe = specgen.pipeline(f"threads={args.threads}", *args.override, progress=False)
    spec = {"schema": str(ROOT / "grammars" / f"{args.schema}.schema.json"), "whitespace": args.whitespace}
    print(f"guarantee={pipe.guarantee} vocab={pipe.tokenizer.vocab_size} schema={args.schema} "
          f"whitespace={args.whitespace!r}")
    for key, value in mask_costs(pipe, spec, STRING_PREFIX[args.schema]).items():
        print(f"{key}: {value:.1f}")
    for key, value in side_by_side(pipe, spec, PROMPTS[args.schema], args.runs, args.max_new_tokens).items():
        print(f"{key}: {value:.3f}")


if __name__ == "__main__":
    main()
