"""Edge JSON schemas (issue 46): each compiles and constrains, or is refused with one line.

ACCEPTED: name -> (schema, documents it must accept, documents it must refuse).
REFUSED: name -> (schema, the start of the one-line refusal).
"""

from __future__ import annotations

I64, SAFE = 2**63, 2**53
RANGE = "numbers in a schema must be finite, within ±2^53 (±9,007,199,254,740,992), with at most 64 decimal places"
#: The characters of the char tokenizer the accepted schemas are spelled with (+ EOS).
CHARS = '{}[]":,-.+0123456789eEabv '


def nested(levels: int) -> dict:
    """``levels`` arrays of arrays of ... integers (built without recursion)."""
    schema = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


ACCEPTED = {
    "negative 2^53 edge": ({"type": "integer", "minimum": -SAFE, "maximum": -SAFE + 2},
                           [str(-SAFE), str(-SAFE + 2)], [str(-SAFE - 1), str(-SAFE + 3), "0"]),
    "positive 2^53 edge": ({"type": "integer", "minimum": SAFE - 2, "maximum": SAFE},
                           [str(SAFE - 2), str(SAFE)], [str(SAFE - 3), str(SAFE + 1)]),
    "exclusive 2^53 edges": ({"type": "integer", "exclusiveMinimum": -SAFE, "exclusiveMaximum": -SAFE + 3},
                             [str(-SAFE + 1), str(-SAFE + 2)], [str(-SAFE), str(-SAFE + 3)]),
    "number bounds at 2^53": ({"type": "number", "minimum": -SAFE, "maximum": SAFE},
                              [str(-SAFE), str(SAFE), "-0.5"], [str(-SAFE - 1), str(SAFE + 1)]),
    "1e-30 lower bound": ({"type": "number", "minimum": 1e-30, "maximum": 1}, ["0.5", "1", "0." + "0" * 29 + "1"],
                          ["0", "-1", "1.5", "0." + "0" * 30 + "9"]),
    "multipleOf 7": ({"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 100}, ["0", "14", "98"],
                     ["15", "105"]),
    "long enum (10k)": ({"enum": [f"v{i}" for i in range(10_000)]}, ['"v0"', '"v9999"'], ['"v10000"', '"a"']),
    "90 nested arrays": (nested(90),
                         ["[" * 90 + "1" + "]" * 90], ["[" * 89 + "1" + "]" * 89]),
    "maxLength 2^32-1": ({"type": "string", "maxLength": 2**32 - 1}, ['"ab"', '""'], ["ab"]),
    "minItems 100000": ({"type": "array", "minItems": 100_000}, [], ["[]", "[1]"]),
}

REFUSED = {
    "int64 minimum (issue 46)": ({"type": "integer", "minimum": -I64, "maximum": -I64 + 1},
                                 f"JSON schema keyword 'minimum' at # is {-I64}, beyond ±2^53; {RANGE}"),
    "int64 maximum": ({"type": "integer", "maximum": I64 - 1}, f"JSON schema keyword 'maximum' at # is {I64 - 1}"),
    "int64 exclusive bound": ({"type": "integer", "exclusiveMaximum": -I64 + 1},
                              f"JSON schema keyword 'exclusiveMaximum' at # is {-I64 + 1}"),
    "1e30 bounds (saturated to 2^63-1)": ({"type": "integer", "minimum": 10**30, "maximum": 10**30 + 1},
                                          "JSON schema keyword 'minimum' at # is 1000000000000000000000000000000,"),
    "2^53+1 (rounded by a double)": ({"type": "integer", "minimum": SAFE + 1},
                                     f"JSON schema keyword 'minimum' at # is {SAFE + 1}, beyond ±2^53"),
    "const -2^63": ({"const": -I64}, f"the number at #/const is {-I64}, beyond ±2^53"),
    "enum holding 2^70": ({"enum": [1, {"a": [2**70]}]}, f"the number at #/enum/1/a/0 is {2**70}"),
    "bound deep in properties/items/anyOf": (
        {"type": "object", "properties": {"a": {"type": "array", "items": {"anyOf": [
            {"type": "string"}, {"type": "integer", "maximum": 2**64}]}}}},
        "JSON schema keyword 'maximum' at #/properties/a/items/anyOf/1 is 18446744073709551616"),
    "bound in $defs": ({"$defs": {"n": {"type": "number", "minimum": -1e308}}, "$ref": "#/$defs/n"},
                       "JSON schema keyword 'minimum' at #/$defs/n is -1e+308, beyond ±2^53"),
    "1e308": ({"type": "number", "maximum": 1e308}, "JSON schema keyword 'maximum' at # is 1e+308, beyond ±2^53"),
    "5e-324": ({"type": "number", "minimum": 5e-324},
               "JSON schema keyword 'minimum' at # is 5e-324, with 324 decimal places"),
    "minimum above maximum": ({"type": "integer", "minimum": 5, "maximum": 1},
                              "JSON schema at #: minimum (5) is above maximum (1), so no value can match"),
    "multipleOf 1e308": ({"type": "integer", "multipleOf": 1e308}, "JSON schema keyword 'multipleOf' at # is 1e+308"),
    "multipleOf 0": ({"type": "integer", "multipleOf": 0},
                     "JSON schema keyword 'multipleOf' at # is 0; it must be greater than 0"),
    "multipleOf -3": ({"type": "integer", "multipleOf": -3},
                      "JSON schema keyword 'multipleOf' at # is -3; it must be greater than 0"),
    "minLength 2^40": ({"type": "string", "minLength": 2**40},
                       f"JSON schema keyword 'minLength' at # is {2**40}; it must be a whole number from 0 to"),
    "maxLength 2^64": ({"type": "string", "maxLength": 2**64}, "JSON schema keyword 'maxLength' at # is"),
    "minItems -1": ({"type": "array", "minItems": -1}, "JSON schema keyword 'minItems' at # is -1"),
    "1000 nested arrays": (nested(1000),
                           "grammar.schema nests objects and arrays more than 100 levels deep; flatten it"),
}

#: Bounds at and near the limits, paired (low <= high) into integer and number ranges by bound_sweep.
SWEEP_VALUES = (-SAFE, -SAFE + 1, -2**52, -10**15, -12345, -1, 0, 1, 10**15, 2**52, SAFE - 1, SAFE)


def bound_sweep() -> list[tuple[dict, list[str], list[str]]]:
    """(schema, texts it must accept, texts it must refuse) for every pair of SWEEP_VALUES, inclusive and
    exclusive, integer and number."""
    cases = []
    for i, low in enumerate(SWEEP_VALUES):
        for high in SWEEP_VALUES[i:]:
            for kind in ("integer", "number"):
                cases.append(({"type": kind, "minimum": low, "maximum": high}, [str(low), str(high)],
                              [str(low - 1), str(high + 1)]))
                if high - low >= 2:
                    cases.append(({"type": kind, "exclusiveMinimum": low, "exclusiveMaximum": high},
                                  [str(low + 1), str(high - 1)], [str(low), str(high)]))
    return cases
