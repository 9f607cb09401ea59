"""Walk a JSON schema and refuse, up front, what a backend cannot enforce.

Every refusal names the keyword and its JSON pointer (``#/properties/qty``), so a
schema is never compiled with a keyword silently ignored. What each backend
cannot enforce is data (a set of keyword names) passed to :func:`check_schema`;
the structural checks (a subschema that is not an object, a list that is not a
list, a remote ``$ref``) are shared.

Annotation-only keywords (``title``, ``description``, ``default``, ``examples``,
``$comment``, ``deprecated``, ``readOnly``, ``writeOnly``, ``content*``) constrain
nothing in JSON Schema 2020-12, so they are accepted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

from specgen.errors import ConfigError

#: Keywords whose value is one schema / a list of schemas / a map of name -> schema.
SUBSCHEMA = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
             "unevaluatedProperties", "unevaluatedItems", "additionalItems")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


class Unsupported(ConfigError):
    """A valid schema or regex that this backend cannot enforce (another backend may)."""


def pointer_part(name: str) -> str:
    """``name`` escaped as one JSON-pointer segment."""
    return str(name).replace("~", "~0").replace("/", "~1")


def subschemas(schema: Mapping, path: str) -> Iterator[tuple[object, str]]:
    """(subschema, pointer) for each direct subschema of ``schema``; raises on a malformed container."""
    for key in SUBSCHEMA:
        if key in schema and not isinstance(schema[key], bool):
            if isinstance(schema[key], list) and key == "items":
                yield from ((sub, f"{path}/items/{i}") for i, sub in enumerate(schema[key]))
            else:
                yield schema[key], f"{path}/{key}"
    for key in SUBSCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                raise ConfigError(f"invalid JSON schema at {path}/{key}: expected a non-empty list of schemas")
            yield from ((sub, f"{path}/{key}/{i}") for i, sub in enumerate(schema[key]))
    for key in SUBSCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], Mapping):
                raise ConfigError(f"invalid JSON schema at {path}/{key}: expected an object")
            yield from ((sub, f"{path}/{key}/{pointer_part(name)}") for name, sub in schema[key].items()
                        if not isinstance(sub, bool))


def find_pointer(schema, predicate, path: str = "#") -> str | None:
    """The pointer of the first subschema (depth first) for which ``predicate`` is true, else None."""
    if not isinstance(schema, Mapping):
        return None
    if predicate(schema):
        return path
    try:
        children = list(subschemas(schema, path))
    except ConfigError:
        return None
    for sub, where in children:
        found = find_pointer(sub, predicate, where)
        if found is not None:
            return found
    return None


def check_schema(schema, unsupported: Mapping[str, str], backend: str, path: str = "#") -> None:
    """Refuse invalid structure (ConfigError) and keywords in ``unsupported`` (:class:`Unsupported`).

    unsupported: {keyword: why}; backend: its name, for the message.
    """
    if not isinstance(schema, Mapping):
        raise ConfigError(f"invalid JSON schema at {path}: expected an object, got {json.dumps(schema)[:60]}")
    for key in schema:
        if key in unsupported:
            raise Unsupported(f"JSON schema keyword {key!r} at {path} is not supported by grammar.backend="
                              f"{backend} ({unsupported[key]}); remove it, or validate it after generation")
    ref = schema.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
        raise ConfigError(f"$ref {ref!r} at {path} is not a local reference (#/...): remote schemas are not "
                          "fetched; inline it under $defs")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ConfigError(f"invalid JSON schema at {path}/required: expected a list of property names")
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise ConfigError(f"invalid JSON schema at {path}/enum: expected a non-empty list")
    for sub, where in subschemas(schema, path):
        check_schema(sub, unsupported, backend, where)


def _types(schema) -> set[str] | None:
    """The JSON types ``schema`` admits, when it says so explicitly (integer counts as number)."""
    if not isinstance(schema, Mapping):
        return None
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return {_type_of(v) for v in values}
    kind = schema.get("type")
    if kind is None:
        return None
    kinds = {kind} if isinstance(kind, str) else set(kind)
    return {"number" if k == "integer" else k for k in kinds}


def _type_of(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}.get(type(value), "object")


def _tag(schema) -> dict[str, tuple]:
    """{property: its allowed constant values} for required properties with const/enum."""
    if not isinstance(schema, Mapping):
        return {}
    tags = {}
    for name in schema.get("required", []):
        sub = (schema.get("properties") or {}).get(name)
        if isinstance(sub, Mapping) and ("const" in sub or "enum" in sub):
            values = [sub["const"]] if "const" in sub else sub["enum"]
            tags[name] = tuple(json.dumps(v, sort_keys=True) for v in values)
    return tags


def one_of_is_exclusive(branches: list) -> bool:
    """True when no JSON value can match two of ``branches``, so ``anyOf`` enforces ``oneOf``.

    Proven only from explicit, pairwise disjoint types, or from a required
    discriminator property whose constant values differ between branches.
    """
    kinds = [_types(b) for b in branches]
    if all(k is not None for k in kinds) and all(not (a & b) for i, a in enumerate(kinds) for b in kinds[i + 1 :]):
        return True
    tags = [_tag(b) for b in branches]
    shared = set.intersection(*(set(t) for t in tags)) if tags else set()
    for name in shared:
        seen: set[str] = set()
        if all(not (set(t[name]) & seen) and not seen.update(t[name]) for t in tags):
            return True
    return False


def resolve(schema, root: Mapping, depth: int = 0):
    """``schema`` with a local ``$ref`` followed (a few levels), else unchanged."""
    ref = schema.get("$ref") if isinstance(schema, Mapping) else None
    if not isinstance(ref, str) or not ref.startswith("#/") or depth > 8:
        return schema
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or part not in node:
            return schema
        node = node[part]
    return resolve(node, root, depth + 1)


def check_one_of(schema, backend: str, path: str = "#", root: Mapping | None = None) -> None:
    """Refuse (Unsupported) a ``oneOf`` whose branches may overlap: backends enforce it as ``anyOf``."""
    if not isinstance(schema, Mapping):
        return
    root = schema if root is None else root
    branches = schema.get("oneOf")
    if isinstance(branches, list) and not one_of_is_exclusive([resolve(b, root) for b in branches]):
        raise Unsupported(f"JSON schema keyword 'oneOf' at {path}: its branches may overlap and grammar.backend="
                          f"{backend} enforces oneOf as anyOf; use anyOf, or give the branches disjoint types "
                          "or a const discriminator property")
    for sub, where in subschemas(schema, path):
        check_one_of(sub, backend, where, root)


def _has_all_of(schema) -> bool:
    if isinstance(schema, list):
        return any(_has_all_of(item) for item in schema)
    if not isinstance(schema, Mapping):
        return False
    return len(schema.get("allOf") or []) > 1 or any(_has_all_of(v) for v in schema.values())


def strict_objects(schema, inside_all_of: bool | None = None):
    """A copy of ``schema`` whose objects with listed ``properties`` allow no other keys.

    JSON Schema allows unlisted keys unless ``additionalProperties`` says otherwise;
    constrained decoders (outlines-core, xgrammar's strict mode) leave them out, and a
    small model otherwise fills objects with invented keys. Every output stays valid:
    an object is left open when it says how to treat other keys
    (``additionalProperties``, ``patternProperties``, ``unevaluatedProperties``), when
    it requires a key it does not list, or inside ``allOf`` (where another branch may
    list the key; with a multi-branch ``allOf`` anywhere, ``$defs`` stay open too,
    since a branch may refer to them).
    """
    if inside_all_of is None:
        return strict_objects(schema, False) if not _has_all_of(schema) else _strict_root_with_all_of(schema)
    if isinstance(schema, list):
        return [strict_objects(item, inside_all_of) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas") \
                and isinstance(value, Mapping):
            out[key] = {name: strict_objects(sub) for name, sub in value.items()}
        elif key in SUBSCHEMA or key in SUBSCHEMA_LISTS:
            out[key] = strict_objects(value, inside_all_of or key == "allOf")
        else:
            out[key] = value
    properties = schema.get("properties")
    open_keys = {"additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "$ref"}
    if isinstance(properties, Mapping) and properties and not inside_all_of and not (open_keys & set(schema)) \
            and all(name in properties for name in schema.get("required", [])):
        out["additionalProperties"] = False
    return out


def _strict_root_with_all_of(schema):
    """:func:`strict_objects` for a schema with a multi-branch allOf: definitions are left open."""
    if not isinstance(schema, Mapping):
        return schema
    defs = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
    rest = strict_objects({k: v for k, v in schema.items() if k not in defs}, False)
    return {**rest, **defs}
