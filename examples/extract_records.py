"""Extract structured records from text into JSONL, one JSON-schema constrained generation per note.

    python examples/extract_records.py --schema grammars/invoice.schema.json \
        --input examples/data/invoices.txt --output records.jsonl

--input is a text file whose notes are separated by blank lines, or a directory
of .txt files (one note per file). Each output line is
``{"source": ..., "record": {...} | null, "finish_reason": ...}`` and counts (``tokens``
generated, ``accepted`` / ``drafted`` draft tokens, ``prompt_cached``: prompt tokens the prefix
cache gave): ``record`` is the parsed JSON whenever generation completed (finish_reason
"eos"), and then it validates against the schema by construction. Extra ``--override key=value``
arguments go to ``specgen.pipeline`` (e.g. ``--override sampling.temperature=0.7``);
the schema is the pipeline's grammar (``grammar=json_schema``), so the
``grammar.*`` keys apply too (``--override grammar.backend=outlines_core``). Keys the
script sets itself (the grammar, ``max_new_tokens``, ``seed``, the prompts and the
output) are refused with the flag to use instead, never silently ignored.

Like ``specgen``'s JSONL mode, everything is checked before the output is touched
(the schema, the notes, the output path, the pipeline with its compiled grammar),
each bad input is one ``error: ...`` line with exit status 2, and an existing
non-empty --output is refused unless ``--resume`` is given: then the records
already there are kept (a torn last line is dropped), only the notes without one
are extracted, and the file ends in input order.

``--instructions FILE`` puts that file's text (field rules, examples) in every note's prompt,
after the first sentence and before the note, so every prompt starts with the same tokens: where
the prefix cache is on (the default), a batch slot or a later note prefills them once and only the
note after them is new.

``--batch-size N`` (default 8) extracts N notes at a time on the batched engine
(``specgen.batch.stream_batch``, continuous batching); lines are still written in
input order and the progress bar advances as each note finishes. ``--batch-size 1``
runs one note after another on ``pipe.generate``. A note's record law (greedy: its
text) is the same either way.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Iterator

from tqdm import tqdm

import specgen
from specgen.batch import stream_batch
from specgen.config.checks import check_output_file
from specgen.config.compose import refuse_owned
from specgen.events import FinishEvent
from specgen.cli.jsonl_output import sort_records
from specgen.config.options import parse_int, parse_seed

PROMPT = "Extract the {title} from the text below as a JSON object with the fields {fields}.\n\n{instructions}Text:\n{text}"
_SCHEMA_FLAG = "the grammar is the --schema file: give the schema with --schema"
#: Keys the script sets itself (from --schema, or on every request), so an --override of one is refused.
OWN_KEYS = {**dict.fromkeys(("grammar", "grammar.schema", "grammar.kind", "grammar.pattern"), _SCHEMA_FLAG),
            "max_new_tokens": "use --max-new-tokens", "seed": "use --seed",
            **dict.fromkeys(("prompt", "prompt_file"), "the notes come from --input"), "output": "use --output"}


def read_text(path: pathlib.Path, name: str) -> str:
    """The UTF-8 text of ``path``; SpecgenError naming ``name`` and the file when it cannot be read."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise specgen.PromptError(f"{name} {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
                                  f"at offset {exc.start})") from None
    except OSError as exc:
        raise specgen.ConfigError(f"cannot read {name} {path}: {exc.strerror or exc}") from None


def read_schema(path: pathlib.Path) -> dict:
    """The JSON schema object in ``path``; SpecgenError naming the file when it is not one."""
    try:
        schema = json.loads(read_text(path, "--schema"))
    except json.JSONDecodeError as exc:
        raise specgen.ConfigError(f"--schema {path} is not valid JSON: {exc.msg} at line {exc.lineno} "
                                  f"column {exc.colno}") from None
    except RecursionError:
        raise specgen.ConfigError(f"--schema {path} nests JSON too deeply to parse") from None
    if not isinstance(schema, dict):
        raise specgen.ConfigError(f"--schema {path} must hold a JSON object (a JSON schema), "
                                  f"got {type(schema).__name__}")
    return schema


def read_notes(path: pathlib.Path) -> list[tuple[str, str]]:
    """(source name, text) per note: blank-line separated paragraphs, or one per .txt file.

    SpecgenError naming the file for a missing input, text that is not UTF-8, or no notes at all."""
    if path.is_dir():
        notes = [(p.name, read_text(p, "--input").strip()) for p in sorted(path.glob("*.txt"))]
        notes = [(source, text) for source, text in notes if text]
    elif path.exists():
        paragraphs = [p.strip() for p in read_text(path, "--input").split("\n\n")]
        notes = [(f"{path.name}#{i + 1}", p) for i, p in enumerate(p for p in paragraphs if p)]
    else:
        raise specgen.ConfigError(f"--input {path} does not exist")
    if not notes:
        raise specgen.PromptError(f"--input {path} holds no notes (blank-line separated text, or .txt files)")
    return notes


def kept_records(path: pathlib.Path, sources: list[str], resume: bool) -> tuple[dict[str, dict], int]:
    """The records already in ``path`` by source, and the byte length of the part to keep.

    Without ``resume`` a non-empty file is refused; with it, a torn last line (no newline) is left
    out and any complete line that is not a record of one of ``sources`` is refused (another
    input's output, or not an output at all)."""
    data = path.read_bytes() if path.is_file() else b""
    if data and not resume:
        raise specgen.ConfigError(f"--output {path} already holds records; add --resume to continue it, "
                                  "or choose another file")
    records: dict[str, dict] = {}
    kept = 0
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        try:
            record = json.loads(line) if line.endswith(b"\n") else None
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            record = None
        if record is None and not line.endswith(b"\n"):
            break  # a torn last line (a crash mid-write): run that note again
        if not isinstance(record, dict) or record.get("source") not in sources or record["source"] in records:
            raise specgen.ConfigError(f"--output {path} line {number} is not a record of a note in this --input; "
                                      "it cannot be resumed (choose another output file)")
        records[record["source"]] = record
        kept += len(line)
    return records, kept


def extract(pipe, schema: dict, notes: list[tuple[str, str]], *, max_new_tokens: int = 512,
            seed: int = 0, progress: bool = True, batch_size: int = 8,
            grammar_in_pipeline: bool = False, instructions: str = "") -> Iterator[dict]:
    """One result dict per note, in input order (see the module docstring).

    grammar_in_pipeline: ``pipe`` was built with ``schema`` as its grammar (each request then
    passes none); otherwise each request passes ``schema``. instructions: text every prompt holds
    before its note (see the module docstring)."""
    title = schema.get("title", "record").lower()
    fields = ", ".join(schema.get("properties", {})) or "of the schema"
    shared = f"{instructions.strip()}\n\n" if instructions.strip() else ""
    prompts = [PROMPT.format(title=title, fields=fields, instructions=shared, text=text) for _, text in notes]
    options = {"max_new_tokens": max_new_tokens, "seed": seed, **({} if grammar_in_pipeline else {"schema": schema})}
    with tqdm(total=len(notes), desc="extracting", unit="note", disable=not progress, file=sys.stderr) as bar:
        if batch_size == 1:
            for (source, _), prompt in zip(notes, prompts):
                gen = pipe.generate(prompt, **options)
                bar.update()
                yield _result(source, gen)
            return
        done: dict[int, object] = {}
        upcoming = 0
        for index, event in stream_batch(pipe, prompts, batch_size=batch_size, **options):
            if not isinstance(event, FinishEvent):
                continue
            done[index] = event.generation
            bar.update()
            while upcoming in done:  # hold a note back until every earlier note is out
                yield _result(notes[upcoming][0], done.pop(upcoming))
                upcoming += 1


def _result(source: str, gen) -> dict:
    record = json.loads(gen.text) if gen.finish_reason == "eos" else None
    return {"source": source, "record": record, "finish_reason": gen.finish_reason,
            "tokens": len(gen.token_ids), "accepted": gen.stats.accepted, "drafted": gen.stats.drafted,
            "prompt_cached": gen.stats.prefill_reused}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schema", required=True, type=pathlib.Path, help="JSON schema file")
    parser.add_argument("--input", required=True, type=pathlib.Path, help="notes file or directory of .txt")
    parser.add_argument("--output", required=True, type=pathlib.Path, help="JSONL file to write")
    parser.add_argument("--instructions", type=pathlib.Path, default=None,
                        help="text file put in every note's prompt before the note (shared rules or examples)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the records already in --output and extract only the missing notes")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="notes extracted together (continuous batching); 1 = one after another")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="specgen config override (repeatable), grammar.* keys included")
    return parser


def check_overrides(overrides: list[str], schema_path: pathlib.Path) -> list[str]:
    """The pipeline's overrides: ``grammar=json_schema`` with --schema, then the user's (which may
    set the other ``grammar.*`` keys, but none of :data:`OWN_KEYS`: ConfigError naming the flag to use)."""
    refuse_owned(overrides, OWN_KEYS)
    return ["grammar=json_schema", f"grammar.schema={schema_path}", *overrides]


def write_results(path: pathlib.Path, kept: int, results: Iterator[dict], position: dict[str, int]) -> int:
    """Append ``results`` to ``path`` after its first ``kept`` bytes, each line flushed as it comes; the
    file is then put in input order (``position`` of each source), however the run ends. -> how many
    results hold a record."""
    complete = 0
    try:
        with path.open("ab") as out:
            out.truncate(kept)
            for result in results:
                out.write((json.dumps(result, ensure_ascii=False) + "\n").encode("utf-8"))
                out.flush()
                complete += result["record"] is not None
    finally:
        sort_records(path, lambda record: position[record["source"]])
    return complete


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        batch_size = parse_int(args.batch_size, "--batch-size", minimum=1)
        max_new_tokens = parse_int(args.max_new_tokens, "--max-new-tokens", minimum=1)
        seed = parse_seed(args.seed, "--seed")
        schema = read_schema(args.schema)
        notes = read_notes(args.input)
        instructions = read_text(args.instructions, "--instructions") if args.instructions else ""
        check_output_file(args.output, "--output", example="records.jsonl")
        position = {source: i for i, (source, _) in enumerate(notes)}
        records, kept = kept_records(args.output, list(position), args.resume)
        pipe = specgen.pipeline(*check_overrides(args.override, args.schema))
        todo = [note for note in notes if note[0] not in records]
        results = extract(pipe, schema, todo, max_new_tokens=max_new_tokens, seed=seed, batch_size=batch_size,
                          grammar_in_pipeline=True, instructions=instructions)
        complete = write_results(args.output, kept, results, position)
    except specgen.SpecgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot write --output {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    complete += sum(record.get("record") is not None for record in records.values())
    resumed = f" ({len(records)} resumed)" if records else ""
    print(f"{complete}/{len(notes)} records complete -> {args.output}{resumed}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
