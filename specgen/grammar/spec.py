"""Grammar specs -> one regex, with every bad input turned into a ConfigError.

A spec is the ``grammar`` config group (or what ``generate(schema=..., regex=...)``
builds)::

    {"kind": "none"}
    {"kind": "regex", "pattern": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}   (or "pattern_file": path)
    {"kind": "json_schema", "schema": <dict | JSON text | file path | pydantic model class>,
     "whitespace": "[ ]?"}

Both kinds may set ``backend`` (default ``outlines``). JSON schemas are turned
into a regex by outlines-core. Keywords that regex cannot enforce (numeric
bounds, ``uniqueItems``, ``not`` ...) are refused, so every complete output of a
schema run validates against the schema.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass

from specgen.errors import ConfigError, first_line

#: Whitespace allowed between JSON tokens: at most one space keeps small models on track
#: ("" gives compact JSON, whose longer forced runs suit speculation).
DEFAULT_WHITESPACE = r"[ ]?"

_MISSING = (None, "", "???")
_SPEC_KEYS = {"json_schema": {"kind", "schema", "whitespace", "backend"},
              "regex": {"kind", "pattern", "pattern_file", "backend"}, "none": {"kind"}}

# Keywords outlines-core ignores: a schema using them could produce invalid output.
_UNENFORCED = {
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
    "contains", "minContains", "maxContains", "minProperties", "maxProperties", "propertyNames",
    "patternProperties", "dependentRequired", "dependentSchemas", "dependencies", "if", "then",
    "else", "not", "unevaluatedProperties", "unevaluatedItems", "additionalItems",
    "contentEncoding", "contentMediaType", "contentSchema",
}
# Keywords whose value is a schema / a list of schemas / a map of schemas.
_SUBSCHEMA = ("items", "additionalProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


@dataclass(frozen=True)
class GrammarSpec:
    """kind: "json_schema" | "regex"; regex: what the backend compiles; description: for messages."""

    kind: str
    regex: str
    description: str
    backend: str = "outlines"


def parse_spec(spec: Mapping | None) -> GrammarSpec | None:
    """Validate a grammar spec; None for ``kind: none``."""
    if spec is None:
        return None
    if not isinstance(spec, Mapping):
        raise ConfigError(f"grammar must be a mapping with a 'kind', got {type(spec).__name__}")
    kind = spec.get("kind", "none")
    if kind not in _SPEC_KEYS:
        raise ConfigError(f"grammar.kind must be one of json_schema, regex, none; got {kind!r}")
    unknown = sorted(set(spec) - _SPEC_KEYS[kind])
    if unknown:
        raise ConfigError(f"unknown grammar keys for kind={kind}: {', '.join(unknown)}")
    if kind == "none":
        return None
    backend = str(spec.get("backend") or "outlines")
    if kind == "regex":
        pattern = _pattern(spec.get("pattern"), spec.get("pattern_file"))
        return GrammarSpec("regex", pattern, f"regex {_short(pattern)}", backend)
    schema, source = load_schema(spec.get("schema"))
    whitespace = spec.get("whitespace")
    whitespace = DEFAULT_WHITESPACE if whitespace is None else str(whitespace)
    return GrammarSpec("json_schema", schema_to_regex(schema, whitespace), f"json_schema {source}", backend)


def _pattern(pattern, pattern_file) -> str:
    """The regex from ``pattern`` or from the first line of ``pattern_file``."""
    if pattern in (None, "???"):
        pattern = None
    if pattern is not None and pattern_file not in _MISSING:
        raise ConfigError("give grammar.pattern or grammar.pattern_file, not both")
    if pattern_file not in _MISSING:
        path = pathlib.Path(str(pattern_file)).expanduser()
        if not path.is_file():
            raise ConfigError(f"regex file {str(pattern_file)!r} does not exist")
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if len(lines) != 1:
            raise ConfigError(f"regex file {str(pattern_file)!r} must hold exactly one non-empty line")
        return lines[0]
    if not isinstance(pattern, str):
        raise ConfigError("grammar=regex needs grammar.pattern (a regular expression string) or grammar.pattern_file")
    return pattern


def load_schema(value) -> tuple[dict, str]:
    """(schema dict, short description) from a dict, JSON text, file path or pydantic model class."""
    if value in _MISSING:
        raise ConfigError("grammar=json_schema needs grammar.schema (a file path, JSON text or a dict)")
    if isinstance(value, type):
        dump = getattr(value, "model_json_schema", None)
        if dump is None:
            raise ConfigError(f"schema class {value.__name__} is not a pydantic model (no model_json_schema)")
        return dump(), value.__name__
    if isinstance(value, Mapping):
        return _plain(value), _short(json.dumps(_plain(value), sort_keys=True))
    if isinstance(value, bool):
        raise ConfigError("boolean schemas (true/false) are not supported; give an object schema")
    if not isinstance(value, (str, pathlib.Path)):
        raise ConfigError(f"grammar.schema must be a dict, JSON text, a file path or a pydantic model "
                          f"class; got {type(value).__name__}")
    text = str(value).strip()
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"grammar.schema is not valid JSON: {exc}") from exc
        return _plain(parsed), _short(text)
    path = pathlib.Path(text).expanduser()
    if not path.is_file():
        raise ConfigError(f"schema file {text!r} does not exist (give a path to a .json file or inline JSON)")
    try:
        parsed = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"schema file {text!r} is not valid JSON: {exc}") from exc
    if not isinstance(parsed, Mapping):
        raise ConfigError(f"schema file {text!r} must contain a JSON object, not {type(parsed).__name__}")
    return _plain(parsed), path.name


def _plain(value):
    """Deep copy into plain dict/list (OmegaConf containers included)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or (hasattr(value, "__iter__") and type(value).__name__ == "ListConfig"):
        return [_plain(v) for v in value]
    return value


def check_schema(schema, path: str = "#") -> None:
    """Refuse structures that are invalid or that the regex translation cannot enforce."""
    if not isinstance(schema, Mapping):
        raise ConfigError(f"invalid JSON schema at {path}: expected an object, got {json.dumps(schema)[:60]}")
    for key in sorted(set(schema) & _UNENFORCED):
        raise ConfigError(f"unsupported JSON schema feature {key!r} at {path}: constrained decoding cannot "
                          "enforce it; remove it (or validate it after generation)")
    if "allOf" in schema and len(schema["allOf"] or []) > 1:
        raise ConfigError(f"unsupported JSON schema feature 'allOf' with several schemas at {path}; merge them")
    properties = schema.get("properties", {})
    required = schema.get("required", [])
    if not isinstance(properties, Mapping):
        raise ConfigError(f"invalid JSON schema at {path}/properties: expected an object")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ConfigError(f"invalid JSON schema at {path}/required: expected a list of property names")
    missing = [r for r in required if properties and r not in properties]
    if missing:
        raise ConfigError(f"invalid JSON schema at {path}: required {missing} not listed in properties")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise ConfigError(f"invalid JSON schema at {path}/enum: expected a non-empty list")
    for key in _SUBSCHEMA:
        if isinstance(schema.get(key), Mapping):
            check_schema(schema[key], f"{path}/{key}")
    for key in _SUBSCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list):
                raise ConfigError(f"invalid JSON schema at {path}/{key}: expected a list of schemas")
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{path}/{key}/{i}")
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            check_schema(sub, f"{path}/{key}/{name}")


def schema_to_regex(schema: dict, whitespace: str = DEFAULT_WHITESPACE) -> str:
    """The regex of ``schema``'s JSON documents (outlines-core translation)."""
    from outlines_core.json_schema import build_regex_from_schema

    check_schema(schema)
    try:
        return build_regex_from_schema(json.dumps(schema), whitespace_pattern=whitespace)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"invalid or unsupported JSON schema: {first_line(exc)}") from exc


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
