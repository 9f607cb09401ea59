"""The outlines-core backend: a regex DFA walked by every token, computed ahead of time.

JSON schemas become one regex (outlines-core's translation), so keywords a
regular language cannot enforce are refused up front (:data:`UNSUPPORTED`).
Compiling is bounded: a regex over :data:`MAX_REGEX_CHARS` is refused naming the
schema part that makes it large, and every compile runs in a child process with a
time limit (``spec.compile_timeout_s``) and a memory limit
(:data:`CHILD_MEMORY_BYTES`), so no grammar can hang or exhaust the caller's memory
(even a short regex such as ``(a|b)*a(a|b){20}`` has a huge DFA). Compiled indexes
are cached on disk, so the child runs once per grammar and tokenizer.

Two workarounds for outlines-core 0.2.14, invisible to callers:

* it drops a token whose bytes minus the last one complete a match while the
  whole token does not (regex-automata reports matches one byte late), so
  ``(at)*`` would refuse a second "at" and ``[0-9]+(\\.[0-9]+)?`` any decimals;
* its DFA also allows a match to start anywhere, which makes bounded
  repetitions such as JSON ``maxLength: 20`` take minutes to compile.

So we compile ``\\x01(?:regex)\\x00`` with virtual tokens for the two control
bytes and leave every real token containing them out of the vocabulary: no real
token walk can start or complete a match, nothing is dropped, the start marker
pins the match start, and a state is final exactly when the virtual end token
may follow it.
"""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys

import numpy as np
import torch

from specgen.errors import ConfigError, first_line
from specgen.grammar.backend import (
    CompiledAutomaton,
    GrammarBackend,
    cache_key,
    compile_progress,
    dist_version,
    read_cached,
    strip_anchors,
    write_cached,
)
from specgen.grammar.schema_check import Unsupported, check_one_of, check_schema, find_pointer, subschemas
from specgen.grammar.spec import GrammarSpec, ascii_classes
from specgen.grammar.vocabulary import TokenBytes

_REGULAR = "a regular language cannot enforce it"
#: Keywords outlines-core ignores: a schema using them could produce invalid output.
UNSUPPORTED = {
    **dict.fromkeys(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"],
                    "outlines-core ignores numeric bounds"),
    **dict.fromkeys(["uniqueItems", "contains", "minContains", "maxContains", "minProperties", "maxProperties",
                     "propertyNames", "patternProperties", "dependentRequired", "dependentSchemas",
                     "dependencies", "if", "then", "else", "not", "unevaluatedProperties", "unevaluatedItems",
                     "additionalItems"], _REGULAR),
}
FORMATS = ("date", "time", "date-time", "email", "uuid", "uri")
MAX_REGEX_CHARS = 200_000
CHILD_MEMORY_BYTES = 4 << 30

_CHILD = """
import pickle, resource, sys
job = pickle.load(sys.stdin.buffer)
resource.setrlimit(resource.RLIMIT_AS, (job["memory"], job["memory"]))
import outlines_core as oc
try:
    index = oc.Index(job["regex"], oc.Vocabulary(job["eos"], job["groups"]))
except ValueError as exc:
    sys.stderr.write(str(exc)); sys.exit(3)
sys.stdout.buffer.write(index.__reduce__()[1][0])
"""


class OutlinesAutomaton(CompiledAutomaton):
    """An ``outlines_core.Index`` of ``\\x01(?:regex)\\x00``; states are the index's integers.

    The virtual start token is consumed once to reach ``initial_state``; the
    virtual end token marks completion. Neither, nor outlines' own EOS id, is
    ever returned as an allowed id.
    """

    def __init__(self, index, markers: tuple[int, int, int]):
        self.index = index
        start_id, self._end_id, self._outlines_eos = markers
        self._hidden = [start_id, self._end_id, self._outlines_eos]
        self.initial_state = int(index.get_next_state(index.get_initial_state(), start_id))

    def next_state(self, state: int, token: int) -> int | None:
        if token in self._hidden:
            return None
        nxt = self.index.get_next_state(state, token)
        return None if nxt is None else int(nxt)

    def allowed_ids(self, state: int) -> torch.Tensor:
        ids = self.index.get_allowed_tokens(state) or []
        array = np.fromiter(ids, dtype=np.int64, count=len(ids))
        return torch.from_numpy(array[~np.isin(array, self._hidden)])  # [num_allowed]

    def is_final(self, state: int) -> bool:
        return self.index.get_next_state(state, self._end_id) is not None


class OutlinesBackend(GrammarBackend):
    """outlines-core 0.2.x (see the module docstring)."""

    name = "outlines_core"
    recipe = "markers-v2"

    def __init__(self):
        import outlines_core

        self._oc = outlines_core
        version = getattr(outlines_core, "__version__", None) or dist_version("outlines_core")
        self.version = f"{version}-{self.recipe}"
        self._vocabularies: dict[str, tuple] = {}

    def check(self, spec: GrammarSpec) -> None:
        if spec.kind == "json_schema":
            _check_outlines_schema(spec.schema)
            self.regex(spec)

    def regex(self, spec: GrammarSpec) -> str:
        """The full-match regex of ``spec`` (ASCII classes); Unsupported past the size budget."""
        if spec.kind == "regex":
            return spec.source
        from outlines_core.json_schema import build_regex_from_schema

        try:
            regex = build_regex_from_schema(spec.source, whitespace_pattern=spec.whitespace)
        except (ValueError, TypeError) as exc:
            message = first_line(exc)
            if "Unsupported JSON Schema structure" in message:
                raise Unsupported(f"outlines-core cannot translate part of {spec.description}: {message[:160]}; "
                                  "use grammar.backend=llguidance") from exc
            raise ConfigError(f"invalid or unsupported JSON schema: {message}") from exc
        if len(regex) > MAX_REGEX_CHARS:
            where = largest_part(spec.schema, spec.whitespace)
            raise Unsupported(f"the JSON schema is too large for grammar.backend=outlines_core: its regex has "
                              f"{len(regex):,} characters (budget {MAX_REGEX_CHARS:,}), mostly from {where}; "
                              "use grammar.backend=llguidance or simplify that part")
        try:
            return ascii_classes(regex)
        except ConfigError:
            return regex

    def _vocabulary(self, vocab: TokenBytes):
        """({bytes: ids} without the control bytes, (start id, end id, outlines EOS id)); memoised."""
        if vocab.fingerprint not in self._vocabularies:
            if len(self._vocabularies) >= 4:
                self._vocabularies.clear()
            groups = {data: ids for data, ids in vocab.grouped().items() if b"\x00" not in data and b"\x01" not in data}
            start_id, end_id = vocab.vocab_size, vocab.vocab_size + 1
            eos = next((i for i in vocab.eos_ids if not vocab.by_id[i]), vocab.vocab_size + 2)
            groups.update({b"\x01": [start_id], b"\x00": [end_id]})
            self._vocabularies[vocab.fingerprint] = (groups, (start_id, end_id, eos))
        return self._vocabularies[vocab.fingerprint]

    def compile(self, spec: GrammarSpec, vocab: TokenBytes) -> CompiledAutomaton:
        groups, markers = self._vocabulary(vocab)
        regex = self.regex(spec)
        marked = f"\\x01(?:{strip_anchors(regex)})\\x00"
        key = cache_key(self, marked, vocab)
        blob = read_cached(key)
        if blob is not None:
            try:
                return OutlinesAutomaton(self._oc.Index.from_binary(blob), markers)
            except Exception:  # a corrupt or foreign cache entry: rebuild it
                pass
        with compile_progress(spec.description):
            index = self._oc.Index.from_binary(self._compile_in_child(spec, marked, groups, markers[2]))
        write_cached(key, index.__reduce__()[1][0])
        return OutlinesAutomaton(index, markers)

    def _compile_in_child(self, spec: GrammarSpec, marked: str, groups: dict, eos: int) -> bytes:
        job = pickle.dumps({"regex": marked, "groups": groups, "eos": eos, "memory": CHILD_MEMORY_BYTES})
        try:
            done = subprocess.run([sys.executable, "-c", _CHILD], input=job, capture_output=True,
                                  timeout=spec.compile_timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise Unsupported(self._too_big(spec, f"did not compile within {spec.compile_timeout_s:g} s")) from None
        if done.returncode == 3:
            raise self._explain(spec, marked, done.stderr.decode("utf-8", "replace"))
        if done.returncode != 0:
            raise Unsupported(self._too_big(spec, f"ran out of its {CHILD_MEMORY_BYTES >> 30} GiB memory budget"))
        return done.stdout

    def _too_big(self, spec: GrammarSpec, what: str) -> str:
        where = largest_part(spec.schema, spec.whitespace) if spec.kind == "json_schema" else "the regex"
        return (f"{spec.description} {what} with grammar.backend=outlines_core (the largest part is {where}); "
                "use grammar.backend=llguidance, raise grammar.compile_timeout_s, or simplify that part")

    def _explain(self, spec: GrammarSpec, marked: str, message: str) -> ConfigError:
        short = spec.description
        if "incompatible" in message or "no transitions" in message:
            if not self._language_nonempty(marked):
                return ConfigError(f"the grammar matches no string at all (empty language): {short}")
            detail = message.split("missing tokens corresponding to", 1)[-1].strip(" .")
            return ConfigError(f"the tokenizer cannot express this grammar: no token sequence spells "
                               f"some required text ({detail[:80]}); grammar: {short}")
        bad_pattern = _pattern_error(spec) if spec.kind == "json_schema" else None
        if bad_pattern is not None:
            return bad_pattern
        return Unsupported(f"outlines-core cannot compile {short}: {first_line(ValueError(message))[:200]}")

    def _language_nonempty(self, marked: str) -> bool:
        """True if some string matches: every string is spelt by single bytes."""
        singles = {bytes([b]): [b] for b in range(256)}
        try:
            self._oc.Index(marked, self._oc.Vocabulary(256, singles))
        except ValueError:
            return False
        return True


def _check_outlines_schema(schema) -> None:
    check_schema(schema, UNSUPPORTED, "outlines_core")
    check_one_of(schema, "outlines_core")
    _walk_outlines_limits(schema, "#")


def _walk_outlines_limits(schema, path: str) -> None:
    """What the regex translation gets wrong although the keyword is supported elsewhere."""
    if not isinstance(schema, dict):
        return
    if "allOf" in schema and len(schema["allOf"]) > 1:
        raise Unsupported(f"JSON schema keyword 'allOf' with several schemas at {path} is not supported by "
                          "grammar.backend=outlines_core; merge them or use grammar.backend=llguidance")
    properties = schema.get("properties") or {}
    missing = [r for r in schema.get("required", []) if r not in properties]
    if missing and schema.get("type", "object") == "object":
        raise Unsupported(f"JSON schema at {path}: required {missing} not listed in properties is not supported "
                          "by grammar.backend=outlines_core; use grammar.backend=llguidance")
    if "format" in schema and schema.get("format") not in FORMATS:
        raise Unsupported(f"JSON schema keyword 'format' ({schema['format']!r}) at {path} is not supported by "
                          f"grammar.backend=outlines_core (it knows {', '.join(FORMATS)})")
    for sub, where in subschemas(schema, path):
        _walk_outlines_limits(sub, where)


def largest_part(schema: dict, whitespace: str) -> str:
    """The JSON pointer of the deepest subschema whose own regex is over a quarter of its parent's."""
    from outlines_core.json_schema import build_regex_from_schema

    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    path, node = "#", schema
    size = len(build_regex_from_schema(json.dumps(schema), whitespace_pattern=whitespace))
    while True:
        best = None
        for sub, where in subschemas(node, path):
            if not isinstance(sub, dict) or where.startswith(("#/$defs", "#/definitions")):
                continue
            try:
                length = len(build_regex_from_schema(json.dumps({**defs, **sub}), whitespace_pattern=whitespace))
            except (ValueError, TypeError):
                continue
            if best is None or length > best[0]:
                best = (length, sub, where)
        if best is None or best[0] * 4 < size:
            return path
        size, node, path = best


def _pattern_error(spec: GrammarSpec) -> ConfigError | None:
    """The first ``pattern`` of the schema that is not a regex, named with its pointer and the reason
    (outlines-core's own error says only that its automaton failed to build); None: every one parses."""
    errors: list[tuple[str, re.error]] = []

    def broken(sub) -> bool:
        pattern = sub.get("pattern")
        if not isinstance(pattern, str):
            return False
        try:
            re.compile(pattern)
        except re.error as exc:
            if "bad escape" not in str(exc):  # \p{L}, \x{41}: valid for the backends' Rust syntax
                errors.append((pattern, exc))
                return True
        return False

    pointer = find_pointer(spec.schema, broken)
    if pointer is None:
        return None
    pattern, exc = errors[-1]
    return ConfigError(f"invalid regex {pattern!r} ({exc}) in {pointer}/pattern of {spec.description}")
