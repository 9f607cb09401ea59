"""Tool calling: the model answers a request with one JSON tool call, which is then run.

    python examples/tool_call.py "What's the weather like in Lyon, France?"
    python examples/tool_call.py            # a few built-in requests

The call is constrained by grammars/tool_call.schema.json (an ``anyOf`` over three
tools, each with nested, typed arguments), so it always parses and names a real
tool with the right arguments; the tools here are local stand-ins. ``--override
key=value`` goes to ``specgen.pipeline``; keys the script sets on every request (the
grammar, ``max_new_tokens``, ``seed``, ``system``, the prompts) are refused with the
flag to use instead.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import specgen
from specgen.config.compose import refuse_owned
from specgen.config.options import parse_seed

SCHEMA = pathlib.Path(__file__).resolve().parent.parent / "grammars" / "tool_call.schema.json"
SYSTEM = ("You can call one tool. Tools: get_weather(location: {city, country_code}, unit: celsius|fahrenheit); "
          "send_email(to: [addresses], subject, body); search_web(query, max_results). "
          'Reply with a JSON object {"tool": ..., "arguments": {...}}.')
#: Keys the script sets on every request, so an --override of one is refused.
OWN_KEYS = {**dict.fromkeys(("grammar", "grammar.kind", "grammar.schema", "grammar.pattern"), "use --schema"),
            "max_new_tokens": "use --max-new-tokens", "seed": "use --seed",
            "system": "the system message lists the tools (SYSTEM in the script)",
            **dict.fromkeys(("prompt", "prompt_file"), "give the requests as arguments")}
REQUESTS = [
    "What's the weather like in Lyon, France? Use celsius.",
    "Email bob@example.com that the meeting moved to 3pm.",
    "Find me five articles about speculative decoding.",
]


def get_weather(location: dict, unit: str) -> str:
    degrees = 21 if unit == "celsius" else 70
    return f"{degrees}° {unit} and sunny in {location['city']} ({location['country_code']})"


def send_email(to: list[str], subject: str, body: str) -> str:
    return f"queued an email to {', '.join(to)} with subject {subject!r} ({len(body)} characters)"


def search_web(query: str, max_results: int) -> str:
    return f"{max_results} results for {query!r}"


TOOLS = {"get_weather": get_weather, "send_email": send_email, "search_web": search_web}


def call_tool(pipe, request: str, schema: dict, *, max_new_tokens: int = 256, seed: int = 0) -> dict:
    """{"request", "call" (dict or None), "result", "finish_reason"} for one request."""
    gen = pipe.generate(request, system=SYSTEM, schema=schema, max_new_tokens=max_new_tokens, seed=seed)
    if gen.finish_reason != "eos":
        return {"request": request, "call": None, "result": None, "finish_reason": gen.finish_reason}
    call = json.loads(gen.text)
    result = TOOLS[call["tool"]](**call["arguments"])
    return {"request": request, "call": call, "result": result, "finish_reason": gen.finish_reason}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requests", nargs="*", help="user requests (default: three examples)")
    parser.add_argument("--schema", type=pathlib.Path, default=SCHEMA)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="specgen config override (repeatable)")
    args = parser.parse_args(argv)
    try:
        seed = parse_seed(args.seed, "--seed")
        refuse_owned(args.override, OWN_KEYS)
        schema = json.loads(args.schema.read_text(encoding="utf-8"))
        pipe = specgen.pipeline(*args.override)
        for request in args.requests or REQUESTS:
            outcome = call_tool(pipe, request, schema, max_new_tokens=args.max_new_tokens, seed=seed)
            print(f"> {request}")
            print(f"  call:   {json.dumps(outcome['call'])}")
            print(f"  result: {outcome['result'] or outcome['finish_reason']}")
    except (OSError, json.JSONDecodeError, specgen.SpecgenError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
