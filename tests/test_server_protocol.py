"""Request parsing without a server: what a body becomes, and which field a 400 names."""

from __future__ import annotations

import pytest

from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.server.api.errors import APIError
from jaxserve.server.api.fields import parse_json_object
from jaxserve.server.api.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    parse_chat_request,
    parse_completion_request,
    parse_tokenize_request,
)
from jaxserve.server.chat.messages import parse_messages
from jaxserve.server.metrics import token_buckets


def error_of(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value


def test_completion_prompt_forms():
    assert parse_completion_request({"prompt": "a"}).prompts == ("a",)
    assert parse_completion_request({"prompt": [1, 2]}).prompts == ((1, 2),)
    assert parse_completion_request({"prompt": ["a", "b"]}).prompts == ("a", "b")
    assert parse_completion_request({"prompt": [[1], [2, 3]]}).prompts == ((1,), (2, 3))
    for bad in (["a", [1]], [True], [[1, "x"]], {"text": "a"}, 5):
        assert error_of(parse_completion_request, {"prompt": bad}).param == "prompt"


def test_max_tokens_defaults():
    absent = parse_completion_request({"prompt": "a"})
    assert absent.max_tokens is None and absent.default_max_tokens == DEFAULT_COMPLETION_MAX_TOKENS
    null = parse_completion_request({"prompt": "a", "max_tokens": None})
    assert null.max_tokens is None and null.default_max_tokens is None  # all the room left
    chat = parse_chat_request({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9})
    assert chat.max_tokens == 9 and chat.max_tokens_param == "max_tokens"
    both = parse_chat_request(
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 9,
            "max_completion_tokens": 3,
        }
    )
    assert both.max_tokens == 3 and both.max_tokens_param == "max_completion_tokens"


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    req = parse_completion_request({"prompt": "a", "echo": True, "logprobs": 2})
    assert req.params.prompt_logprobs == 2 and not req.return_prompt_logprobs
    plain = parse_completion_request({"prompt": "a", "logprobs": 2})
    assert plain.params.prompt_logprobs is None


def test_chat_logprobs_and_renamed_params():
    base = {"messages": [{"role": "user", "content": "x"}]}
    assert parse_chat_request({**base, "logprobs": True}).top_logprobs == 0
    assert parse_chat_request({**base, "logprobs": True, "top_logprobs": 5}).top_logprobs == 5
    assert parse_chat_request(base).top_logprobs is None
    over = {**base, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}
    assert error_of(parse_chat_request, over).param == "top_logprobs"
    assert error_of(parse_chat_request, {**base, "max_completion_tokens": 0}).param == (
        "max_completion_tokens"
    )


def test_a_renamed_field_is_named_as_sent_in_the_message():
    base = {"messages": [{"role": "user", "content": "x"}]}
    negative = error_of(parse_chat_request, {**base, "max_completion_tokens": -1})
    assert negative.param == "max_completion_tokens"
    assert "max_completion_tokens=-1 must be a positive integer" in negative.message
    assert "max_tokens" not in negative.message.replace("max_completion_tokens", "")
    below_min = error_of(parse_chat_request, {**base, "max_completion_tokens": 2, "min_tokens": 3})
    assert below_min.param == "min_tokens"
    assert "must not exceed max_completion_tokens=2" in below_min.message
    over = {**base, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}
    assert f"top_logprobs={MAX_LOGPROBS + 1}" in error_of(parse_chat_request, over).message
    plain = error_of(parse_chat_request, {**base, "max_tokens": -1})
    assert plain.param == "max_tokens" and "max_tokens=-1" in plain.message


def test_messages_are_flattened_for_the_template():
    messages = parse_messages(
        [
            {"role": "developer", "content": "rules"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ]
    )
    assert messages[0] == {"role": "system", "content": "rules"}
    assert messages[1] == {"role": "user", "content": "a\nb"}
    assert messages[2]["content"] == "" and messages[2]["tool_calls"][0]["type"] == "function"
    assert messages[3]["tool_call_id"] == "c1"


def test_tool_choice_defaults_follow_openai():
    base = {"messages": [{"role": "user", "content": "x"}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    req = parse_chat_request({**base, "tools": tools, "tool_choice": "none"})
    assert req.tools == tuple(tools) and req.tool_choice.mode == "none"
    default = parse_chat_request({**base, "tools": tools}).tool_choice
    assert default.mode == "auto" and not default.is_sent and default.parallel
    assert parse_chat_request(base).tool_choice.mode == "none"
    named = {"type": "function", "function": {"name": "f"}}
    forced = parse_chat_request(
        {**base, "tools": tools, "tool_choice": named, "parallel_tool_calls": False}
    ).tool_choice
    assert forced.mode == "function" and forced.name == "f" and not forced.parallel
    assert error_of(parse_chat_request, {**base, "tool_choice": "required"}).param == "tool_choice"
    bad_tool = {**base, "tools": [{"type": "function"}], "tool_choice": "none"}
    assert error_of(parse_chat_request, bad_tool).param == "tools[0].function"


def test_tokenize_defaults_follow_vllm():
    assert parse_tokenize_request({"prompt": "x"}).add_special_tokens
    chat = parse_tokenize_request({"messages": [{"role": "user", "content": "x"}]})
    assert not chat.add_special_tokens and chat.add_generation_prompt
    assert error_of(parse_tokenize_request, {}).param == "prompt"


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{", None),
        (b"[]", "body"),
        (b'"x"', "body"),
        (b"\xff", None),
        (b'{"stop": ["ok", "\\ud83d"]}', "stop[1]"),
        (b'{"\\udc00": 1}', "\udc00"),
    ],
)
def test_parse_json_object_rejects(raw, param):
    error = error_of(parse_json_object, raw)
    assert error.status == 400 and error.param == param


def test_parse_json_object_keeps_nul_and_unicode():
    assert parse_json_object('{"prompt": "a\\u0000b \u00e9\U0001f600"}'.encode()) == {
        "prompt": "a\x00b \u00e9\U0001f600"
    }


def test_token_buckets():
    assert token_buckets(256) == [1, 2, 5, 10, 20, 50, 100, 200]
    assert token_buckets(1) == [1]
