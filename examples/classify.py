"""Classify texts with an enum schema: the model can only answer with one of the labels.

    python examples/classify.py --input examples/data/reviews.txt
    python examples/classify.py --labels spam,ham "WIN A FREE CRUISE NOW" "Lunch at noon?"

Labels come from grammars/sentiment.schema.json by default or from --labels
(an enum schema built on the fly). Prints one ``label<TAB>text`` line per input
and a label histogram at the end. ``--override key=value`` goes to ``specgen.pipeline``;
keys the script sets on every request (the grammar, ``max_new_tokens``, the prompts)
are refused with the flag to use instead.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections import Counter

import specgen
from specgen.config.compose import refuse_owned
from specgen.config.options import parse_int

SCHEMA = pathlib.Path(__file__).resolve().parent.parent / "grammars" / "sentiment.schema.json"


#: Keys the script sets on every request, so an --override of one is refused.
OWN_KEYS = {**dict.fromkeys(("grammar", "grammar.kind", "grammar.schema", "grammar.pattern"),
                            "the labels come from --labels (default: the sentiment schema)"),
            "max_new_tokens": "use --max-new-tokens", **dict.fromkeys(("prompt", "prompt_file"), "give texts or --input")}


def label_schema(labels: list[str]) -> dict:
    """{"label": one of ``labels``} as a JSON schema."""
    if len(labels) < 2 or len(set(labels)) != len(labels):
        raise specgen.ConfigError(f"--labels needs at least two distinct labels, got {labels}")
    return {"title": "Classification", "type": "object", "properties": {"label": {"enum": labels}},
            "required": ["label"], "additionalProperties": False}


def classify(pipe, texts: list[str], schema: dict, *, max_new_tokens: int = 32) -> list[str | None]:
    """The label of each text (None if generation did not complete)."""
    labels = schema["properties"]["label"]["enum"]
    out = []
    for text in texts:
        prompt = f"Classify the text as one of: {', '.join(labels)}.\n\nText: {text}"
        gen = pipe.generate(prompt, schema=schema, max_new_tokens=max_new_tokens)
        out.append(json.loads(gen.text)["label"] if gen.finish_reason == "eos" else None)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("texts", nargs="*", help="texts to classify")
    parser.add_argument("--input", type=pathlib.Path, help="file with one text per line")
    parser.add_argument("--labels", help="comma-separated labels (default: the sentiment schema's)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="token limit of each answer")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="specgen config override (repeatable)")
    args = parser.parse_args(argv)
    try:
        texts = list(args.texts)
        if args.input:
            texts += [line.strip() for line in args.input.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not texts:
            parser.error("give texts or --input")
        if args.labels:
            schema = label_schema([label.strip() for label in args.labels.split(",") if label.strip()])
        else:
            schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
        max_new_tokens = parse_int(args.max_new_tokens, "--max-new-tokens", minimum=1)
        refuse_owned(args.override, OWN_KEYS)
        pipe = specgen.pipeline(*args.override)
        labels = classify(pipe, texts, schema, max_new_tokens=max_new_tokens)
    except (OSError, json.JSONDecodeError, specgen.SpecgenError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for label, text in zip(labels, texts):
        print(f"{label}\t{text}")
    print(dict(Counter(labels)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
