"""Hostile input, round three: schemas, tool parameters and tool-call arguments.

Findings of an attacker's run against ``jaxserve launch`` with the demo model:
- 6: boolean schemas, schemas, tool parameters and tool-call arguments nested deep, and
  ``$defs`` that are not objects answered 500 (and each 500 was logged twice);
- 8: integer bounds past 64 bits: ``minimum: 1e30`` was accepted and the output broke it, and
  two bounds below -2**63 took the whole process down inside the grammar engine.

One real engine on the tiny Llama fixture and one real server on a loopback port; after every
case the server must still be healthy and serve a normal request. The limits are in
docs/security.md.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from jaxserve.json_limits import (
    MAX_EXACT_INTEGER,
    MAX_JSON_DEPTH,
    JsonLimitError,
    grammar_schema,
    load_json,
    nesting_depth,
)
from jaxserve.server import app as app_module
from jaxserve.server.api.protocol import CHAT_FIELDS, COMPLETION_FIELDS
from jaxserve.server.chat.tools import ToolChoice, tool_calls_schema
from tests.conftest import assert_bad_request, tiny_server

MODEL = "tiny"
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server():
    settings = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    with tiny_server(
        MODEL,
        settings,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=64,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "the river", "max_tokens": 2, "temperature": 0, **extra}


def chat(**extra) -> dict:
    messages = [{"role": "user", "content": "hello"}]
    return {"model": MODEL, "messages": messages, "max_tokens": 2, **extra}


def post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    # json.dumps here, not httpx's: the bodies nest past what its encoder allows.
    return http.post(path, content=json.dumps(body), headers=JSON)


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=completion(max_tokens=3))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def nested_schema(num_objects: int) -> dict:
    """An object schema with ``num_objects`` objects nested (2 levels of JSON each)."""
    schema: dict = {"type": "string"}
    for _ in range(num_objects):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def nested_arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def tool(parameters: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# -- finding 6: 500 instead of 400 -------------------------------------------------------------

DEEP = nested_schema(100)  # 201 levels
DEEP_61 = nested_schema(30)  # 61 levels
PARAMETERS_300 = {"type": "object", "properties": {"x": nested_schema(300)}}
DRAFT_04 = "http://json-schema.org/draft-04/schema#"
# name -> (route, body, param named by the 400, a word of the message)
BAD = {
    "structured-outputs-json-false": (
        "/v1/completions",
        completion(structured_outputs={"json": False}),
        "structured_outputs.json",
        "false",
    ),
    "guided-json-text-false": (
        "/v1/completions",
        completion(guided_json="false"),
        "guided_json",
        "false",
    ),
    "response-format-200-deep": (
        "/v1/chat/completions",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}),
        "response_format",
        f"more than {MAX_JSON_DEPTH} levels",
    ),
    "structured-outputs-json-200-deep": (
        "/v1/completions",
        completion(structured_outputs={"json": DEEP}),
        "structured_outputs.json",
        f"more than {MAX_JSON_DEPTH} levels",
    ),
    "guided-json-text-5000-deep": (
        "/v1/completions",
        completion(guided_json=nested_arrays(5000)),
        "guided_json",
        f"more than {MAX_JSON_DEPTH} levels",
    ),
    "guided-json-text-900-deep": (  # read by Python's parser, then refused
        "/v1/completions",
        completion(guided_json=nested_arrays(900)),
        "guided_json",
        f"more than {MAX_JSON_DEPTH} levels",
    ),
    "tool-defs-not-object-draft-04": (
        "/v1/chat/completions",
        chat(
            tools=[tool({"$schema": DRAFT_04, "type": "object", "$defs": "x"})],
            tool_choice="required",
        ),
        "tools[0].function.parameters",
        "$defs",
    ),
    "tool-definitions-not-object-draft-03": (
        "/v1/chat/completions",
        chat(
            tools=[
                tool(
                    {
                        "$schema": "http://json-schema.org/draft-03/schema#",
                        "type": "object",
                        "definitions": [1],
                    }
                )
            ],
            tool_choice="required",
        ),
        "tools[0].function.parameters",
        "definitions",
    ),
    "tool-parameters-300-deep": (
        "/v1/chat/completions",
        chat(tools=[tool(PARAMETERS_300)], tool_choice="required"),
        "tools[0].function.parameters",
        f"more than {MAX_JSON_DEPTH} levels",
    ),
    "tool-call-arguments-100000-deep": (
        "/v1/chat/completions",
        chat(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": nested_arrays(100_000)},
                        }
                    ],
                },
            ]
        ),
        "messages[3].tool_calls[0].function.arguments",
        f"more than {MAX_JSON_DEPTH} levels",
    ),
    "tool-call-arguments-object-100-deep": (
        "/v1/chat/completions",
        chat(
            messages=[
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": json.dumps(nested_schema(50))},
                        }
                    ],
                },
                {"role": "user", "content": "hi"},
            ]
        ),
        "messages[0].tool_calls[0].function.arguments",
        f"more than {MAX_JSON_DEPTH} levels",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_schemas_and_arguments_are_a_400_naming_the_field(http, case) -> None:
    route, body, param, word = BAD[case]
    assert_bad_request(post(http, route, body), param, word)
    assert_still_serving(http)


@pytest.mark.parametrize(
    "field",
    [{"structured_outputs": {"json": True}}, {"guided_json": "true"}, {"guided_json": True}],
)
def test_the_schema_true_admits_any_json_value(http, field) -> None:
    r = post(http, "/v1/completions", completion(max_tokens=12, **field))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


def test_schemas_at_the_depth_limit_compile_and_generate(http) -> None:
    """64 levels pass: in a response format, and as tool parameters under a "required"
    choice (whose array schema puts them 5 levels further down)."""
    schema = nested_schema(31)  # 63 levels
    assert nesting_depth(schema) == 63
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = post(http, "/v1/chat/completions", chat(response_format=rf, max_tokens=4))
    assert r.status_code == 200, r.text
    parameters = {"type": "object", "properties": {"x": {"type": "array", "items": DEEP_61}}}
    assert nesting_depth(parameters) == MAX_JSON_DEPTH
    r = post(http, "/v1/chat/completions", chat(tools=[tool(parameters)], tool_choice="required"))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("shape", ["array", "object"])
def test_any_field_nested_800_deep_is_never_a_500(http, route, shape) -> None:
    """Every field of the route (and the places inside them that hold JSON) with a value nested
    800 levels deep, which Python's parser still reads: a 400 or a 200, never a 500."""
    value: object = "x"
    for _ in range(800):
        value = [value] if shape == "array" else {"a": value}
    base = completion() if route == "/v1/completions" else chat()
    fields = COMPLETION_FIELDS if route == "/v1/completions" else CHAT_FIELDS
    bodies = [{**base, name: value} for name in sorted(fields)]
    bodies += [
        {**base, "stop": [value]},
        {**base, "logit_bias": {"1": value}},
        {**base, "structured_outputs": {"json": {"type": "array", "items": value}}},
        {**base, "structured_outputs": {"choice": [value]}},
    ]
    if route == "/v1/chat/completions":
        bodies += [
            {**base, "messages": [{"role": "user", "content": value}]},
            {**base, "tools": [tool({"type": "object", "properties": {"x": value}})]},
        ]
    for body in bodies:
        r = post(http, route, body)
        assert r.status_code < 500, (list(body)[-1], r.text[:300])
    assert_still_serving(http)


def test_an_unhandled_error_is_logged_once_and_keeps_the_connection(
    http, monkeypatch, caplog
) -> None:
    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(app_module, "tokenize", fail)
    caplog.set_level(logging.ERROR)
    for _ in range(2):  # the same keep-alive connection answers both
        r = http.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        assert "boom" not in r.text and "Traceback" not in r.text
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(errors) == 2, [record.getMessage() for record in errors]
    assert all("unhandled error on POST /tokenize" in e.getMessage() for e in errors)
    monkeypatch.undo()
    assert_still_serving(http)


# -- finding 8: integer bounds past 64 bits ----------------------------------------------------


@pytest.mark.parametrize(
    ("bounds", "where"),
    [
        ({"minimum": 1e30}, "minimum"),
        ({"minimum": 1e30, "maximum": 1e31}, "minimum"),  # its output was 2**63 - 1
        ({"exclusiveMinimum": 2**63}, "exclusiveMinimum"),
        ({"maximum": -1e30}, "maximum"),
        ({"minimum": -1e30, "maximum": -1e29}, "maximum"),  # took the process down
        ({"minimum": 2**53}, "minimum"),  # past what a double holds exactly
    ],
)
def test_integer_bounds_that_admit_only_integers_past_2_53_are_a_400(http, bounds, where) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", **bounds}}}
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    message = assert_bad_request(
        post(http, "/v1/completions", completion(response_format=rf)), "response_format", where
    )
    assert "/properties/n" in message and str(MAX_EXACT_INTEGER) in message
    assert_bad_request(
        post(http, "/v1/completions", completion(guided_json={"type": "integer", **bounds})),
        "guided_json",
        where,
    )
    assert_still_serving(http)


@pytest.mark.parametrize(
    "bounds",
    [
        {"maximum": 1e30},
        {"minimum": -1e30},  # was a 400: llguidance could not build the range
        {"minimum": -(2**63), "maximum": 2**63},
        {"exclusiveMaximum": 2**64, "minimum": 5},
        {"maximum": 2**63 - 2},  # llguidance read it as 2**63 - 1 and let that through
    ],
)
def test_integer_bounds_that_only_exclude_integers_past_2_53_generate_in_range(
    http, bounds
) -> None:
    body = completion(guided_json={"type": "integer", **bounds}, max_tokens=24, temperature=1.0)
    for seed in range(4):
        r = post(http, "/v1/completions", {**body, "seed": seed})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":  # a whole integer, inside the bounds asked for
            value = int(choice["text"])
            assert value >= bounds.get("minimum", value), choice["text"]
            assert value <= bounds.get("maximum", value), choice["text"]
            assert value < bounds.get("exclusiveMaximum", value + 1), choice["text"]


# -- the rules, without a server --------------------------------------------------------------


def test_nesting_depth_counts_objects_and_arrays_without_recursion() -> None:
    assert [nesting_depth(v) for v in ("x", 1, None, [], {}, [[]], {"a": [1, {"b": 2}]})] == [
        0,
        0,
        0,
        1,
        1,
        2,
        3,
    ]
    deep: list = []
    for _ in range(100_000):  # far past Python's recursion limit
        deep = [deep]
    assert nesting_depth(deep, limit=10) == 11  # stops one level past the limit
    with pytest.raises(JsonLimitError) as error:
        load_json(nested_arrays(100_000), "x")
    assert error.value.param == "x"
    with pytest.raises(ValueError):
        load_json("{", "x")


def test_grammar_schema_tightens_bounds_in_schema_positions_only() -> None:
    schema = {
        "type": "object",
        "properties": {
            # a property named like a keyword is a schema, not a bound
            "minimum": {"type": ["integer", "null"], "maximum": 1e30},
            "enum": {"const": {"minimum": 1e30}, "default": {"maximum": -1e30}},
            "f": {"type": "number", "minimum": 1e30},  # numbers: llguidance's float range
        },
        "$defs": {"big": {"exclusiveMinimum": -(2**70)}},
        "items": [{"maximum": 2**60}],
        "anyOf": [{"type": "integer", "minimum": -(2**60)}],
    }
    text = grammar_schema(schema, "p")
    out = json.loads(text)
    assert out["properties"]["minimum"]["maximum"] == MAX_EXACT_INTEGER
    assert out["properties"]["enum"] == schema["properties"]["enum"]  # data, left alone
    assert out["properties"]["f"] == schema["properties"]["f"]
    assert out["$defs"]["big"]["exclusiveMinimum"] == -MAX_EXACT_INTEGER
    assert out["items"][0]["maximum"] == MAX_EXACT_INTEGER
    assert out["anyOf"][0]["minimum"] == -MAX_EXACT_INTEGER
    assert schema["properties"]["minimum"]["maximum"] == 1e30  # the request's own is unchanged
    assert grammar_schema(True, "p") == "{}"
    for bad in (False, {"minimum": float("inf")}, {"allOf": [{"minimum": 2**64}]}, [1]):
        with pytest.raises(JsonLimitError):
            grammar_schema(bad, "p")


def test_tool_choice_grammars_tighten_bounds_and_allow_the_required_wrapper() -> None:
    parameters = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 1e30}}}
    tools = (tool(parameters, "f"),)
    named = json.loads(tool_calls_schema(tools, ToolChoice("function", name="f")))
    assert named["properties"]["n"]["maximum"] == MAX_EXACT_INTEGER
    deep = {"type": "object", "properties": {"x": {"type": "array", "items": DEEP_61}}}
    assert nesting_depth(deep) == MAX_JSON_DEPTH
    required = json.loads(tool_calls_schema((tool(deep),), ToolChoice("required")))
    assert nesting_depth(required, limit=100) == MAX_JSON_DEPTH + 5
    assert parameters["properties"]["n"]["maximum"] == 1e30
