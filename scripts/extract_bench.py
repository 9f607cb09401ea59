"""Wall time of an extraction job whose notes share long instructions, prefix cache on against off.

One process holds two pipelines on the same model and settings (the default model unless
overrides say otherwise, ``grammar=json_schema`` with ``--schema``), one with the default
``prefix_cache`` and one with ``prefix_cache.entries=0`` (every prompt prefilled whole, as
before the cache existed). Each runs ``examples/extract_records.py``'s :func:`extract` over the
same notes with the same ``--instructions`` at each ``--batch-sizes`` (1: one note after another
on ``pipe.generate``; N: the batched engine, N notes at a time), the two arms in alternating
order per repeat so drift in the machine's load falls on both alike, each from an empty cache.
The notes are made here from a fixed seed (names, years, occupations, countries; none of them is
used to tune anything), so the job is the same on every machine.

    python scripts/extract_bench.py [--notes 64] [--batch-sizes 1,8] [--repeats 1] [--threads 1]
        [--schema grammars/person.schema.json] [--instructions examples/data/person_rules.txt]
        [--max-new-tokens 64] [override ...]

Prints per batch size the prompt's shared tokens, each arm's wall time (median of the repeats),
their ratio, the prompt tokens the cache gave, and whether every record (text, finish reason and
token count) is the same in both arms and at every batch size. Wall-clock numbers depend on
machine load: report the load with them.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import random
import statistics
import time

import specgen

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIRST = ["Ines", "Kofi", "Mei", "Lars", "Amara", "Pavel", "Lucia", "Hiro", "Nadia", "Omar", "Greta", "Tariq"]
LAST = ["Okafor", "Brandt", "Sato", "Moreau", "Silva", "Novak", "Haddad", "Lindgren", "Costa", "Ivanova"]
JOBS = ["beekeeper", "bridge engineer", "night nurse", "violin maker", "tax adviser", "ferry captain",
        "botanist", "bus driver", "court interpreter", "pastry chef", "geologist", "locksmith"]
COUNTRIES = ["Portuguese", "Kenyan", "Norwegian", "Chilean", "Vietnamese", "Polish", "Egyptian", "Canadian"]
SHAPES = [
    "{name}, a {country} {job}, was born in {year}.",
    "Born in {year}, {name} has worked as a {job} for most of her life.",
    "{name} ({year}) is a {job} from a small town; colleagues describe a patient, careful worker.",
    "Our new {job}, {name}, joined the team this spring after years abroad.",
    "The {country} {job} {name} gave a short talk at the library on Thursday evening.",
]


def make_notes(count: int, seed: int = 7) -> list[tuple[str, str]]:
    """``count`` (source, text) notes about made-up people, the same for a given seed."""
    rng = random.Random(seed)
    notes = []
    for i in range(count):
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        text = rng.choice(SHAPES).format(name=name, country=rng.choice(COUNTRIES), job=rng.choice(JOBS),
                                         year=rng.randint(1930, 2004))
        notes.append((f"note#{i + 1}", text))
    return notes


def load_extract():
    """:func:`extract` of examples/extract_records.py (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("extract_records", ROOT / "examples" / "extract_records.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.extract, module.read_schema


def run(extract, pipe, schema, notes, instructions, batch_size, max_new) -> tuple[float, list, int]:
    """One job from an empty prefix cache -> (seconds, comparable records, prompt tokens the cache gave)."""
    pipe.prefix_cache.clear()
    start = time.perf_counter()
    results = list(extract(pipe, schema, notes, max_new_tokens=max_new, batch_size=batch_size, progress=False,
                           grammar_in_pipeline=True, instructions=instructions))
    seconds = time.perf_counter() - start
    records = [(r["source"], r["record"], r["finish_reason"], r["tokens"]) for r in results]
    reused = sum(r["prompt_cached"] for r in results)
    return seconds, records, reused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notes", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", default="1")
    parser.add_argument("--schema", type=pathlib.Path, default=ROOT / "grammars" / "person.schema.json")
    parser.add_argument("--instructions", type=pathlib.Path, default=ROOT / "examples" / "data" / "person_rules.txt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    extract, read_schema = load_extract()
    schema = read_schema(args.schema)
    instructions = args.instructions.read_text(encoding="utf-8")
    notes = make_notes(args.notes)
    common = (f"threads={args.threads}", "grammar=json_schema", f"grammar.schema={args.schema}", *args.overrides)
    arms = {"cache on": specgen.pipeline(*common, progress=False),
            "cache off": specgen.pipeline(*common, "prefix_cache.entries=0", progress=False)}
    for pipe in arms.values():  # warm-up, not counted: cost tables, grammar compilation, first allocations
        run(extract, pipe, schema, notes[:2], instructions, 1, args.max_new_tokens)
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    seconds = {(name, size): [] for name in arms for size in sizes}
    cached = {(name, size): 0 for name in arms for size in sizes}
    outputs = {}
    for repeat in range(args.repeats):
        for size in sizes:
            for name in (list(arms) if repeat % 2 == 0 else list(reversed(arms))):
                took, records, reused = run(extract, arms[name], schema, notes, instructions, size,
                                            args.max_new_tokens)
                seconds[name, size].append(took)
                cached[name, size] = reused
                outputs.setdefault((name, size), records)
                assert outputs[name, size] == records, f"{name} at batch {size} changed between repeats"
    pipe = arms["cache on"]
    shared = pipe.encode(extract_prompt_head(schema, instructions))  # its template's end is not shared
    print(f"model {pipe.config.target.get('name')}  notes {len(notes)}  threads {args.threads}  "
          f"repeats {args.repeats}  max_new_tokens {args.max_new_tokens}  shared prompt head ~{len(shared)} tokens")
    for size in sizes:
        on, off = (statistics.median(seconds[name, size]) for name in ("cache on", "cache off"))
        print(f"batch {size:2d}: cache off {off:7.1f} s  cache on {on:7.1f} s  on/off {on / off:5.2f}x  "
              f"prompt tokens from the cache {cached['cache on', size]}")
    reference = next(iter(outputs.values()))
    same = all(records == reference for records in outputs.values())
    print(f"every record equal in both arms and at every batch size: {same}")


def extract_prompt_head(schema: dict, instructions: str) -> str:
    """The prompt of a note with no text: what every note's prompt starts with."""
    title = schema.get("title", "record").lower()
    fields = ", ".join(schema.get("properties", {}))
    return (f"Extract the {title} from the text below as a JSON object with the fields {fields}.\n\n"
            f"{instructions.strip()}\n\nText:\n")


if __name__ == "__main__":
    main()
