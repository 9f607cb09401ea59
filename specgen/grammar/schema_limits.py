"""The numbers and sizes a JSON schema may hold, checked before any backend compiles it.

:func:`check_limits` walks the whole schema tree (``properties``, ``items``,
``anyOf``/``oneOf``/``allOf``, ``$defs`` and every other subschema keyword) and
refuses, in one line naming the keyword and its JSON pointer:

- a numeric bound (``minimum``, ``maximum``, ``exclusiveMinimum``,
  ``exclusiveMaximum``, ``multipleOf``) or a number inside ``const``/``enum``
  that is not a finite number within ±:data:`MAX_MAGNITUDE` with at most
  :data:`MAX_DECIMALS` decimal places;
- a ``multipleOf`` that is not positive;
- a size (``minLength`` ... ``maxProperties``) that is not a whole number in
  0..:data:`MAX_COUNT`;
- a lower bound above its upper bound (no value could match).

Why these limits: llguidance reads a schema's numbers as doubles. Past 2^53 an
integer rounds (``minimum`` 2^53+1 let 2^53 through), past 2^63 it saturates
(``minimum`` 10^30 produced 9223372036854775807), and a bound or ``const`` at
-2^63 sent its integer-range builder into endless recursion: a segfault that
took the whole process down. A bound with hundreds of decimal places (5e-324)
builds a regex nested past its parser's limit; a size past 2^32-1 is past what
its regex repetition reads. Within these limits every corpus case in
tests/test_schema_limits.py compiles and constrains, or is refused by name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from decimal import Decimal

from specgen.errors import ConfigError, shorten
from specgen.grammar.schema_check import subschemas

#: The largest magnitude of a number in a schema: 2^53, up to which every integer is a double (RFC 7493).
MAX_MAGNITUDE = 2**53
#: The most decimal places a number in a schema may have (1e-64 is the smallest nonzero magnitude).
MAX_DECIMALS = 64
#: The largest size (``minLength``, ``maxLength``, ``minItems``, ``maxItems``, ``minProperties``, ``maxProperties``).
MAX_COUNT = 2**32 - 1

BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_RANGE = f"numbers in a schema must be finite, within ±2^53 (±{MAX_MAGNITUDE:,}), with at most {MAX_DECIMALS} " \
         "decimal places"


def check_limits(schema, path: str = "#") -> None:
    """Refuse (ConfigError, one line) a number or size in ``schema`` outside the limits above.

    ``schema`` nests at most :data:`~specgen.grammar.spec.MAX_SCHEMA_DEPTH` levels (the walk recurses)."""
    if not isinstance(schema, Mapping):
        return
    for key in BOUNDS:
        value = schema.get(key)
        if key in schema and not (key.startswith("exclusive") and isinstance(value, bool)):  # draft-04 flags
            check_number(value, f"JSON schema keyword {key!r} at {path}")
    if "multipleOf" in schema and not schema["multipleOf"] > 0:
        raise ConfigError(f"JSON schema keyword 'multipleOf' at {path} is {_text(schema['multipleOf'])}; "
                          "it must be greater than 0")
    for key in COUNTS:
        if key in schema:
            _check_count(schema[key], key, path)
    for key in ("const", "enum"):
        if key in schema:
            _check_values(schema[key], f"{path}/{key}")
    _check_order(schema, path)
    for sub, where in subschemas(schema, path):
        check_limits(sub, where)


def check_number(value, what: str) -> None:
    """Refuse ``value`` (named as ``what``) unless it is a number within the limits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what} must be a number, got {_text(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{what} is {_text(value)}; {_RANGE}")
    if abs(value) > MAX_MAGNITUDE:
        raise ConfigError(f"{what} is {_text(value)}, beyond ±2^53; {_RANGE}")
    exponent = Decimal(repr(value)).as_tuple().exponent
    if isinstance(value, float) and -exponent > MAX_DECIMALS:
        raise ConfigError(f"{what} is {_text(value)}, with {-exponent} decimal places; {_RANGE}")


def _check_count(value, key: str, path: str) -> None:
    whole = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) \
        and value == int(value)
    if not whole or not 0 <= value <= MAX_COUNT:
        raise ConfigError(f"JSON schema keyword {key!r} at {path} is {_text(value)}; it must be a whole number "
                          f"from 0 to {MAX_COUNT:,}")


def _check_values(value, path: str) -> None:
    """Every number inside the ``const``/``enum`` value at ``path``, at any depth."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, Mapping):
            stack.extend((sub, f"{where}/{name}") for name, sub in item.items())
        elif isinstance(item, list):
            stack.extend((sub, f"{where}/{i}") for i, sub in enumerate(item))
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            check_number(item, f"the number at {where}")


def _check_order(schema: Mapping, path: str) -> None:
    """Refuse a lower bound above its upper bound (equal ones when either is exclusive)."""
    pairs = [(low, high) for low in ("minimum", "exclusiveMinimum") for high in ("maximum", "exclusiveMaximum")]
    pairs += [(f"min{name}", f"max{name}") for name in ("Length", "Items", "Properties")]
    for low, high in pairs:
        lo, hi = schema.get(low), schema.get(high)
        if isinstance(lo, bool) or isinstance(hi, bool) or lo is None or hi is None:
            continue
        if lo > hi or (lo == hi and "exclusive" in low + high):
            relation = "above" if lo > hi else "equal to"
            raise ConfigError(f"JSON schema at {path}: {low} ({_text(lo)}) is {relation} {high} ({_text(hi)}), "
                              "so no value can match")


def _text(value) -> str:
    return shorten(json.dumps(value), 40)
