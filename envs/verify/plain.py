"""An exact, typed JSON encoding of plain Python data crossing a sandbox boundary (format: docs/verify.md).

Decoding builds builtin objects only, so nothing the untrusted side wrote can run code or override a comparison.
This module also runs inside the sandbox, as source text: it imports nothing but `json`.
"""
import json

MAX_DEPTH = 64
_SEQUENCES = {list: "l", tuple: "t", set: "s", frozenset: "fs"}


def encode(value, depth=0):
    """The JSON-able form of `value`; raises TypeError on a value that is not plain data, ValueError past MAX_DEPTH."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    t = type(value)
    if value is None or t is str:
        return value
    if t is bool:
        return {"b": value}
    if t is int:
        return {"i": str(value)}
    if t is float:
        return {"f": value.hex()}
    if t is complex:
        return {"c": [value.real.hex(), value.imag.hex()]}
    if t is bytes:
        return {"y": value.hex()}
    if t in _SEQUENCES:
        return {_SEQUENCES[t]: [encode(x, depth + 1) for x in value]}
    if t is dict:
        return {"d": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in value.items()]}
    if t.__module__ == "numpy" and hasattr(value, "item") and t.__name__ in (
            "float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool_", "bool"):
        return encode(value.item(), depth)
    raise TypeError(f"a {t.__name__} is not plain data")


def decode(obj, depth=0):
    """The value `encode` gave `obj` (builtin types only). Raises ValueError for anything `encode` cannot give."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    if obj is None or type(obj) is str:
        return obj
    if type(obj) is not dict or len(obj) != 1:
        raise ValueError(f"not an encoded value: {str(obj)[:80]}")
    (tag, v), = obj.items()
    if tag == "b" and type(v) is bool:
        return v
    if tag == "i" and type(v) is str:
        return int(v)
    if tag == "f" and type(v) is str:
        return float.fromhex(v)
    if tag == "c" and type(v) is list and len(v) == 2:
        return complex(float.fromhex(v[0]), float.fromhex(v[1]))
    if tag == "y" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "d" and type(v) is list:
        return {decode(k, depth + 1): decode(x, depth + 1) for k, x in v}
    kinds = {name: kind for kind, name in _SEQUENCES.items()}
    if tag in kinds and type(v) is list:
        return kinds[tag](decode(x, depth + 1) for x in v)
    raise ValueError(f"not an encoded value: {str(obj)[:80]}")


def dumps(value) -> str:
    """`encode(value)` as one line of JSON."""
    return json.dumps(encode(value), separators=(",", ":"))


def loads(text: str):
    """`decode` of one line of JSON. Raises ValueError for text that is not an encoded value."""
    try:
        return decode(json.loads(text))
    except (TypeError, RecursionError) as e:  # an unhashable key; JSON nested past the stack
        raise ValueError(f"not an encoded value: {e}") from None
