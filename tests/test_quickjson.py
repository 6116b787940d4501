"""quickjson reads and writes JSON with the json package's C functions, without importing the package:
the text and values must be the json package's, and every error its error."""

import json
import math

import pytest

from snakeshard import quickjson

VALUES = [
    {}, [], 0, -1, 12345678901234567890, 1.0, -0.0, 1e300, 2.5e-8, float("nan"), float("inf"), float("-inf"),
    None, True, False, "", "plain", "héllo\n\"\\\t\u2028 \U0001f600",
    {"a": 1}, [1, [2, [3, {}]]], (1, "two"), {"ü": "ö", "x": [{"y": []}, {}]},
    # a shard's done record, as shard.run_shard writes it
    {"shard": 5, "items": 1, "keys_digest": "9ae477d9082e7e3248b5", "fingerprint": "ef5c0554abfd7c5d0b99",
     "inputs": {"stage": "6da6", "keys": "9ae4"}, "fragments": ["text"],
     "fields": {"text": {"format": "text", "index": "text", "bytes": 16, "crc32": 808100281}},
     "state_files": {}, "seconds": None, "start": 1795395878.407, "end": 1795395878.408, "host": "vm"},
]


def same(a, b) -> bool:
    """Equal, NaN equal to NaN (repr compares floats by their text)."""
    return repr(a) == repr(b)


@pytest.mark.parametrize("value", VALUES, ids=lambda v: repr(v)[:30])
def test_text_and_values_are_the_json_packages(value):
    assert quickjson.dumps_indented(value) == json.dumps(value, indent=1)
    assert quickjson.dumps_indented(value, indent=3) == json.dumps(value, indent=3)
    assert quickjson.encoder()(value) == json.dumps(value)
    assert quickjson.encoder(ensure_ascii=False)(value) == json.dumps(value, ensure_ascii=False)
    for text in (json.dumps(value), json.dumps(value, indent=1), " \n\t" + json.dumps(value) + "\r\n "):
        assert same(quickjson.loads(text), json.loads(text))


@pytest.mark.parametrize("text", ["", "  ", "[1,", "[1] x", "{'a': 1}", "nul", '{"a": 1,}', '"\x01"', "01", "[1]]"])
def test_bad_json_raises_the_json_packages_error(text):
    """Anything json.loads refuses is refused with its exact message (line and column)."""
    with pytest.raises(json.JSONDecodeError) as ours:
        quickjson.loads(text)
    with pytest.raises(json.JSONDecodeError) as theirs:
        json.loads(text)
    assert str(ours.value) == str(theirs.value)


def test_what_json_cannot_write_fails_as_json_fails():
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        quickjson.encoder()({"a": {1, 2}})
    with pytest.raises(ValueError, match="Out of range float"):
        quickjson.encoder(allow_nan=False)([math.inf])
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular reference"):
        quickjson.encoder()(loop)
    with pytest.raises(ValueError, match="Circular reference"):
        quickjson.dumps_indented({"a": loop})
    assert quickjson.encoder()([1]) == "[1]"  # a call that raised leaves nothing behind
    # a key json.dumps converts (int, None): the whole value goes to json.dumps
    assert quickjson.dumps_indented({1: {None: 2}}) == json.dumps({1: {None: 2}}, indent=1)


def test_without_the_c_accelerator_the_json_package_does_it(monkeypatch):
    """Where _json is missing (another Python) or has other functions, the json package does the work."""
    monkeypatch.setattr(quickjson, "_scan", None)
    monkeypatch.setattr(quickjson, "_json", None)
    assert quickjson.loads('{"a": [1, 2.5]}') == {"a": [1, 2.5]}
    assert quickjson.encoder(ensure_ascii=False)({"é": 1}) == '{"é": 1}'
