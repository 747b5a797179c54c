"""The gateway's body reader (``gateway/body.py``), as pure functions: every malformed shape is
an ``InvalidArgument`` naming the problem, never another exception."""

from __future__ import annotations

import json

import pytest

from contracts.errors import InvalidArgument
from gateway.body import MAX_JSON_DEPTH, json_depth, parse_json_object


def refused(raw: bytes) -> str:
    with pytest.raises(InvalidArgument) as exc:
        parse_json_object(raw)
    return exc.value.message


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 1_000, 100_000])
def test_deep_nesting_is_refused_by_depth(levels):
    too_deep = f"request body nests arrays/objects more than {MAX_JSON_DEPTH} levels deep"
    assert refused(b"[" * levels + b"]" * levels) == too_deep  # closed: as deep as valid JSON gets
    assert refused(b'{"prompt": ' + b"[" * levels + b"]" * levels + b"}") == too_deep
    # Unclosed: past the parser's recursion limit it is too deep, before that not JSON at all.
    assert refused(b"[" * levels) == (
        too_deep if levels >= 1_000 else f"request body is not JSON: Expecting value at offset {levels}"
    )


def test_nesting_up_to_the_cap_is_accepted():
    inner = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
    body = parse_json_object(f'{{"x": {inner}}}'.encode())
    assert json_depth(body) == MAX_JSON_DEPTH
    assert json_depth({"a": [{"b": 1}], "c": 2}) == 3 and json_depth(5) == 0


def test_not_utf8_names_the_byte():
    assert refused(b'{"prompt": "a\xffb"}') == "request body is not UTF-8: byte 0xff at offset 13 (invalid start byte)"
    assert refused('{"prompt": "x"}'.encode("utf-16")).startswith("request body is not UTF-8: byte 0xff at offset 0")


def test_not_json_names_the_reason_and_offset():
    assert refused(b'{"prompt": [1, 2') == "request body is not JSON: Expecting ',' delimiter at offset 16"
    assert refused(b"\xef\xbb\xbf{}").startswith("request body is not JSON: Unexpected UTF-8 BOM")
    assert refused(b'{"n": NaN}') == "request body is not JSON: NaN is not a JSON number"
    assert refused(b'{"t": -Infinity}') == "request body is not JSON: -Infinity is not a JSON number"
    assert "Exceeds the limit" in refused(b'{"n": ' + b"9" * 5000 + b"}")


@pytest.mark.parametrize(
    ("raw", "what"),
    [
        (b"[1, 2]", "an array"),
        (b'"text"', "a string"),
        (b"3", "a number"),
        (b"null", "null"),
        (b"true", "a boolean"),
    ],
)
def test_not_an_object_names_what_it_is(raw, what):
    assert refused(raw) == f"request body must be a JSON object, got {what}"


def test_empty_body():
    assert refused(b"") == refused(b"  \n") == "request body is empty; expected a JSON object"


def test_a_good_body_parses():
    body = {"model": "m", "prompt": list(range(50_000)), "messages": [{"role": "user", "content": "é ✓"}]}
    assert parse_json_object(json.dumps(body, ensure_ascii=False).encode()) == body
