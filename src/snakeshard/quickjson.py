"""JSON through the ``json`` package's own C accelerator (``_json``), without importing the package.

Importing ``json`` imports ``re`` and ``enum`` (the Python-level scanner and the escape patterns): about
9 ms of CPU, as much as everything else a one-key shard job does after the interpreter's start. A shard job only reads its
``spec.json`` and writes its ``done``; this module does both with the same C functions ``json`` uses,
so the text is the same (tests/test_quickjson.py compares them). Where ``_json`` is missing or takes
other arguments, and for every error, it hands over to ``json`` itself, whose messages users know.
"""

from __future__ import annotations

WHITESPACE = " \t\n\r"

try:
    import _json
except ImportError:  # another Python implementation: the json package does it all
    _json = None


class _ScanContext:
    """What ``_json.make_scanner`` reads from ``json.JSONDecoder``, set as ``json.loads`` sets it."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__


def _make_scanner():
    try:
        return _json.make_scanner(_ScanContext())
    except (AttributeError, TypeError):
        return None


_scan = _make_scanner() if _json is not None else None


def loads(text: str):
    """``json.loads(text)`` for a str."""
    if _scan is not None:
        start = len(text) - len(text.lstrip(WHITESPACE))
        try:
            value, end = _scan(text, start)
        except (StopIteration, ValueError):
            pass  # json.loads below raises its own JSONDecodeError, with line and column
        else:
            if not text[end:].strip(WHITESPACE):
                return value
    import json

    return json.loads(text)


def encoder(*, ensure_ascii: bool = True, allow_nan: bool = True, default=None):
    """``encode(value) -> str``: the text ``json.JSONEncoder(ensure_ascii=..., allow_nan=..., default=...).encode``
    gives (circular references refused), built once, not at every call as ``JSONEncoder.encode`` builds it."""
    make = getattr(_json, "make_encoder", None)
    if make is not None:
        quote = _json.encode_basestring_ascii if ensure_ascii else _json.encode_basestring
        try:
            markers: dict = {}  # ids of the containers being encoded: empty again after each call
            iterencode = make(markers, default or _refuse, quote, None, ": ", ", ", False, False, allow_nan)
        except TypeError:
            iterencode = None
        if iterencode is not None:
            def encode(value) -> str:
                markers.clear()  # a call that raised may leave ids behind
                return "".join(iterencode(value, 0))

            return encode
    import json

    return json.JSONEncoder(ensure_ascii=ensure_ascii, allow_nan=allow_nan, default=default).encode


def _refuse(value):
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_leaf = encoder()  # scalars and empty containers: their text has no separators


def dumps_indented(value, indent: int = 1) -> str:
    """``json.dumps(value, indent=indent)``: nested dicts and lists one entry per line. A dict key that is not a
    str, or a value that contains itself, goes to json.dumps (which converts the key, or refuses the value)."""
    try:
        return _indented(value, "\n", " " * indent)
    except (_NotPlain, RecursionError):
        import json

        return json.dumps(value, indent=indent)


class _NotPlain(Exception):
    """A dict key that is not a str: json.dumps converts it, and does the whole value."""


def _indented(value, newline: str, step: str) -> str:
    if isinstance(value, dict) and value:
        inner = newline + step
        parts = []
        for key, item in value.items():
            if type(key) is not str:
                raise _NotPlain
            parts.append(f"{inner}{_leaf(key)}: {_indented(item, inner, step)}")
        return "{" + ",".join(parts) + newline + "}"
    if isinstance(value, (list, tuple)) and value:
        inner = newline + step
        return "[" + ",".join(inner + _indented(item, inner, step) for item in value) + newline + "]"
    return _leaf(value)
