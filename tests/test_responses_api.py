"""The Responses API (``/v1/responses``) end to end: a real engine on the tiny Llama fixture, a
real server, driven by the ``openai`` SDK's ``client.responses`` (and httpx for raw events and
errors).

The fixture model is random: requests run greedy with ``ignore_eos`` to a known length, or under
a grammar (``text.format``, a forced tool choice) that makes the output's shape and end known.
One server for the module; its store keeps at most ``MAX_STORED`` responses.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from tests.conftest import assert_bad_request, tiny_server, wait_idle

MODEL = "tiny-responses"
MAX_STORED = 4
GREEDY: dict[str, Any] = dict(temperature=0.0, max_output_tokens=6, extra_body={"ignore_eos": True})
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
ANSWER_FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server():
    # Steps of at least 5 ms: a background response of 200 tokens is still running when it is
    # cancelled, however fast the device.
    with tiny_server(
        MODEL,
        {"max_stored_responses": MAX_STORED},
        min_step_s=0.005,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=96,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def num_tokens(http: httpx.Client, messages: list[dict[str, Any]]) -> int:
    return http.post("/tokenize", json={"messages": messages}).json()["count"]


def chat_text(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int) -> str:
    result = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        temperature=0.0,
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
    )
    return result.choices[0].message.content or ""


def without_ids(response: Any) -> dict[str, Any]:
    """A response's JSON without what differs between two runs of one request (ids, times,
    and the prompt tokens the prefix cache held)."""
    data = response.model_dump(exclude_none=True)
    for key in ("id", "created_at", "completed_at"):
        data.pop(key, None)
    data.get("usage", {}).pop("input_tokens_details", None)
    for item in data["output"]:
        item.pop("id", None)
        item.pop("call_id", None)
    return data


def sse_events(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


# -- created ---------------------------------------------------------------------------------


def test_string_input_is_a_chat_turn_cut_at_max_output_tokens(client, http):
    response = client.responses.create(model=MODEL, input="Hello", **GREEDY)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "incomplete" and message.content[0].annotations == []
    messages = [{"role": "user", "content": "Hello"}]
    assert response.output_text == chat_text(client, messages, 6)
    usage = response.usage
    assert usage.input_tokens == num_tokens(http, messages)
    assert usage.output_tokens == 6 and usage.total_tokens == usage.input_tokens + 6
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.max_output_tokens == 6 and response.temperature == 0.0
    assert response.store is True and response.tools == [] and response.tool_choice == "none"


def test_message_items_and_instructions(client, http):
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Salut"}]},
        {"role": "user", "content": "Ça va?"},
    ]
    response = client.responses.create(model=MODEL, input=items, instructions="Be brief.", **GREEDY)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Salut"},
        {"role": "user", "content": "Ça va?"},
    ]
    assert response.usage.input_tokens == num_tokens(http, messages)
    assert response.output_text == chat_text(client, messages, 6)
    assert response.instructions == "Be brief."


def test_json_schema_format_completes_and_validates(client):
    response = client.responses.create(
        model=MODEL, input="yes?", temperature=0.0, max_output_tokens=64, text=ANSWER_FORMAT
    )
    assert response.status == "completed" and response.completed_at is not None
    jsonschema.validate(json.loads(response.output_text), ANSWER)
    assert response.text.format.type == "json_schema"


# -- streamed --------------------------------------------------------------------------------

TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def test_streamed_events_are_the_sdks_types_in_order(client, http):
    body = {"model": MODEL, "input": "Hello", "temperature": 0.0, "max_output_tokens": 6}
    body["ignore_eos"] = True
    raw = sse_events(http, body)
    events = [EVENTS.validate_python(event) for event in raw]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deduplicated = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert deduplicated == [*TEXT_EVENTS, "response.incomplete"]
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == events[-4].text
    whole = client.responses.create(model=MODEL, input="Hello", **GREEDY)
    assert without_ids(final) == without_ids(whole)
    # The SDK reads the same stream.
    streamed = list(client.responses.create(model=MODEL, input="Hello", stream=True, **GREEDY))
    assert [e.type for e in streamed] == kinds


def test_sdk_stream_reassembles_the_non_streamed_response(client):
    request = dict(model=MODEL, input="yes?", temperature=0.0, max_output_tokens=64)
    whole = client.responses.create(**request, text=ANSWER_FORMAT)
    with client.responses.stream(**request, text=ANSWER_FORMAT) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text
    assert without_ids(final) == without_ids(whole)


def test_streamed_function_call(client, http):
    request = dict(
        model=MODEL,
        input="Weather?",
        temperature=0.0,
        max_output_tokens=64,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    raw = sse_events(http, request)
    events = [EVENTS.validate_python(event) for event in raw]
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    with client.responses.stream(**request) as stream:
        final = stream.get_final_response()
    whole = client.responses.create(**request)
    assert without_ids(final) == without_ids(whole)
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Rome")


# -- stored and chained ----------------------------------------------------------------------


def test_retrieve_delete_and_store_false(client):
    response = client.responses.create(model=MODEL, input="Hello", **GREEDY)
    assert client.responses.retrieve(response.id) == response
    deleted = client.with_raw_response.responses.delete(response.id)
    assert deleted.http_response.json() == {
        "id": response.id,
        "object": "response",
        "deleted": True,
    }
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(model=MODEL, input="Hello", store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_previous_response_id_continues_the_conversation(client, http):
    first = client.responses.create(model=MODEL, input="Hello", instructions="Be kind.", **GREEDY)
    second = client.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, **GREEDY
    )
    # The earlier instructions do not carry over; the earlier input and output do.
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.usage.input_tokens == num_tokens(http, messages)
    assert second.output_text == chat_text(client, messages, 6)
    assert second.previous_response_id == first.id


def test_input_items_list_the_request_input_newest_first(client, http):
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "message", "role": "assistant", "content": "Hello.", "id": "msg_given"},
        {"role": "user", "content": "Weather?"},
    ]
    response = client.responses.create(model=MODEL, input=items, **GREEDY)
    listed = client.responses.input_items.list(response.id)  # the SDK's typed items
    assert [item.role for item in listed.data] == ["user", "assistant", "user", "developer"]
    assert listed.data[1].id == "msg_given"
    assert all(item.id.startswith("msg_") and item.status == "completed" for item in listed.data)
    assert listed.data[0].content[0].type == "input_text"
    assert listed.data[0].content[0].text == "Weather?"
    assert listed.data[1].content[0].type == "output_text"
    # asc order, pages of 3 then the rest (the SDK follows ``after``)
    pages = client.responses.input_items.list(response.id, order="asc", limit=3)
    assert [item.role for item in pages.data] == ["developer", "user", "assistant"]
    assert pages.has_more
    rest = pages.get_next_page()
    assert [item.role for item in rest.data] == ["user"] and not rest.has_more
    assert [item.id for item in pages] == [item.id for item in listed.data[::-1]]  # all pages
    text = client.responses.create(model=MODEL, input="Hello", **GREEDY)
    (only,) = client.responses.input_items.list(text.id).data
    assert only.role == "user" and only.content[0].text == "Hello"
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order")):
        assert_bad_request(http.get(f"/v1/responses/{text.id}/input_items?{query}"), param)
    assert_bad_request(http.get(f"/v1/responses/{text.id}/input_items?after=nope"), "after")
    assert http.get("/v1/responses/resp_nope/input_items").status_code == 404


def test_least_recently_used_response_is_dropped_past_the_bound(client):
    ids = [client.responses.create(model=MODEL, input="x", **GREEDY).id for _ in range(MAX_STORED)]
    client.responses.retrieve(ids[0])  # now the most recently used
    client.responses.create(model=MODEL, input="x", **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    for kept in (ids[0], *ids[2:]):
        client.responses.retrieve(kept)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="x", previous_response_id=ids[1], **GREEDY)
    assert caught.value.body["param"] == "previous_response_id"
    assert ids[1] in caught.value.body["message"]


def test_function_call_round_trip(client, http):
    first = client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        temperature=0.0,
        max_output_tokens=64,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = client.responses.create(
        model=MODEL,
        input=[result],
        previous_response_id=first.id,
        tools=[WEATHER],
        tool_choice="none",
        **GREEDY,
    )
    (message,) = second.output
    assert message.type == "message" and second.output_text
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    assert second.usage.input_tokens == num_tokens(http, messages)


# -- background ------------------------------------------------------------------------------


def wait_status(client: openai.OpenAI, response_id: str, *statuses: str) -> Any:
    deadline = time.monotonic() + 30
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in statuses:
            return response
        assert time.monotonic() < deadline, response.status
        time.sleep(0.02)


def test_background_response_runs_to_its_end(client, server):
    queued = client.responses.create(model=MODEL, input="Hello", background=True, **GREEDY)
    assert queued.status in ("queued", "in_progress") and queued.background is True
    assert queued.output == [] and queued.usage is None
    done = wait_status(client, queued.id, "incomplete")
    whole = client.responses.create(model=MODEL, input="Hello", **GREEDY)
    assert done.output_text == whole.output_text and done.usage == whole.usage
    with pytest.raises(openai.BadRequestError):  # finished
        client.responses.cancel(queued.id)
    with pytest.raises(openai.BadRequestError):  # not a background response
        client.responses.cancel(whole.id)
    wait_idle(server.engine)


def test_cancel_a_background_response(client, server):
    long = dict(GREEDY, max_output_tokens=200)
    queued = client.responses.create(model=MODEL, input="Hello", background=True, **long)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert client.responses.cancel(queued.id).status == "cancelled"  # again: the same
    wait_idle(server.engine)


# -- errors ----------------------------------------------------------------------------------

BAD = {
    "item-type": ({"input": [{"type": "bogus"}]}, "input[0].type"),
    "item-image": (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0].type",
    ),
    "call-output-without-id": (
        {"input": [{"type": "function_call_output", "output": "x"}]},
        "input[0].call_id",
    ),
    "no-input": ({}, "input"),
    "built-in-tool": ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    "tool-parameters": (
        {"tools": [{**WEATHER, "parameters": {"type": "array"}}], "tool_choice": "none"},
        "tools[0].parameters",
    ),
    "choice-unknown": (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
        "tool_choice.name",
    ),
    "choice-built-in": (
        {"tools": [WEATHER], "tool_choice": {"type": "file_search"}},
        "tool_choice",
    ),
    "background-without-store": ({"background": True, "store": False}, "background"),
    "format-type": ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    "format-without-schema": ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    "format-bad-schema": (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strng"}}}},
        "text.format",
    ),
    "truncation": ({"truncation": "auto"}, "truncation"),
    "reasoning": ({"reasoning": {"effort": "high"}}, "reasoning"),
    "unknown-field": ({"frobnicate": 1}, "frobnicate"),
    "max-output-tokens": ({"max_output_tokens": 0}, "max_output_tokens"),
}


@pytest.mark.parametrize("case", BAD.values(), ids=list(BAD))
def test_bad_requests_are_a_400_naming_the_field(http, case):
    fields, param = case
    body = {"model": MODEL, "input": "Hello", **fields}
    if "input" in fields or param == "input":
        body = {k: v for k, v in body.items() if k != "input" or "input" in fields}
    assert_bad_request(http.post("/v1/responses", json=body), param)


def test_unknown_ids_are_404(http):
    for method, path in (
        ("GET", "/v1/responses/resp_nope"),
        ("DELETE", "/v1/responses/resp_nope"),
        ("POST", "/v1/responses/resp_nope/cancel"),
    ):
        r = http.request(method, path)
        assert r.status_code == 404, r.text
        assert "resp_nope" in r.json()["error"]["message"]


# -- reasoning -------------------------------------------------------------------------------


def test_reasoning_item_with_the_reasoning_parser(server):
    # deepseek_r1: the output is reasoning until </think>, which the fixture never writes.
    settings = {"reasoning_parser": "deepseek_r1"}
    with tiny_server(MODEL, settings, engine=server.engine) as reasoning:
        with openai.OpenAI(base_url=f"{reasoning.url}/v1", api_key="none") as client:
            whole = client.responses.create(model=MODEL, input="Hello", **GREEDY)
            chat = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hello"}],
                temperature=0.0,
                max_tokens=6,
                extra_body={"ignore_eos": True},
            )
            body = {"model": MODEL, "input": "Hello", "temperature": 0.0, "ignore_eos": True}
            with httpx.Client(base_url=reasoning.url, timeout=30) as http:
                raw = sse_events(http, {**body, "max_output_tokens": 6})
            chained = client.responses.create(
                model=MODEL, input="More", previous_response_id=whole.id, **GREEDY
            )
    (item,) = whole.output
    assert item.type == "reasoning" and whole.output_text == ""
    assert item.content[0].text == chat.choices[0].message.model_extra["reasoning_content"]
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= 6
    events = [EVENTS.validate_python(event) for event in raw]
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert without_ids(events[-1].response) == without_ids(whole)
    assert chained.status == "incomplete"


def test_output_items_are_the_same_streamed_or_whole():
    from jaxserve.server.chat.tool_calls import MessageDelta, ToolCallDelta
    from jaxserve.server.responses.output import OutputItems

    pieces = [
        MessageDelta(reasoning="Let me "),
        MessageDelta(reasoning="think."),
        MessageDelta(content="Calling"),
        MessageDelta(content=" now."),
        MessageDelta(tool_calls=[ToolCallDelta(0, '{"city":', "call_1", "get_weather")]),
        MessageDelta(tool_calls=[ToolCallDelta(0, ' "Rome"}')]),
        MessageDelta(tool_calls=[ToolCallDelta(1, "{}", "call_2", "now")]),
    ]
    whole, streamed = OutputItems(), OutputItems()
    message = MessageDelta()
    for piece in pieces:
        message.extend(piece)
    whole.add(message)
    whole.close("completed")
    events = [e for piece in pieces for e in streamed.add(piece)] + streamed.close("completed")
    strip = [{k: v for k, v in item.items() if k != "id"} for item in whole.items]
    assert [{k: v for k, v in item.items() if k != "id"} for item in streamed.items] == strip
    assert [item["type"] for item in whole.items] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    for number, event in enumerate(events):
        EVENTS.validate_python({**event, "sequence_number": number})
    assert whole.items[2]["arguments"] == '{"city": "Rome"}'
    assert whole.reasoning_text == "Let me think."
