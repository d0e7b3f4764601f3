"""A ``/v1/responses`` body -> ``ResponsesRequest``: the Responses fields checked here, the rest
translated to a chat body that ``api/protocol.parse_chat_request`` validates.

``serving.py`` calls ``parse_responses_request`` on the body, then ``chat_request`` with the
conversation's messages (``items.py``; a chained request's history comes from ``store.py``).
The translation: ``max_output_tokens`` is ``max_completion_tokens``, ``text.format`` is
``response_format``, flat function ``tools`` and a ``{"type": "function", "name"}`` tool choice
are nested as chat nests them, ``instructions`` is a system message first. A chat error names
the field in the Responses' words (``tools[0].parameters``, ``text.format``). Fields that would
change the meaning and that the server cannot honour (built-in tools, ``truncation: "auto"``,
``reasoning``, ``include``, ...) are a 400 naming the field, never ignored.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxserve.server.api.errors import APIError, bad_request, unsupported
from jaxserve.server.api.fields import boolean, check_fields, json_type, optional
from jaxserve.server.api.protocol import SAMPLING_FIELDS, ChatRequest, parse_chat_request
from jaxserve.server.responses.items import input_messages

# vLLM's extension fields, passed to the chat request as they are: chat's sampling fields but
# those the Responses API names its own way (or has no place for), and a few of chat's own.
EXTENSION_FIELDS = (
    *(f for f in SAMPLING_FIELDS if f not in ("n", "temperature", "top_p", "prompt_logprobs")),
    "priority",
    "cache_salt",
    "chat_template_kwargs",
)
# Accepted only with a neutral value (None, or the one named).
NEUTRAL_FIELDS = {
    "truncation": "disabled",
    "service_tier": "auto",
    "reasoning": None,
    "max_tool_calls": None,
    "prompt": None,
    "conversation": None,
    "prompt_cache_retention": None,
}
RESPONSES_FIELDS = frozenset(
    (
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "text",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "store",
        "previous_response_id",
        "background",
        "stream",
        "stream_options",
        "metadata",
        "user",
        "include",
        "top_logprobs",
        "prompt_cache_key",
        "safety_identifier",
        *NEUTRAL_FIELDS,
        *EXTENSION_FIELDS,
    )
)
TEXT_FORMATS = ("text", "json_object", "json_schema")
TOOL_FIELDS = frozenset(("type", "name", "description", "parameters", "strict"))
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys of 64 and values of 512 characters
# Chat's field names -> the Responses' (regex over an error's param and message).
RENAMES = (
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format(\.json_schema)?(\.schema)?\b"), "text.format"),
    (re.compile(r"\btools\[(\d+)\]\.function\b"), r"tools[\1]"),
    (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
    (re.compile(r"\bmessages(\[\d+\])?(\.[a-z_]+)*"), "input"),
)


@dataclasses.dataclass(frozen=True)
class ResponsesRequest:
    body: dict[str, Any]  # as sent
    chat_body: dict[str, Any]  # the chat request's fields but messages
    input_messages: list[dict[str, Any]]  # the new input as chat messages
    instructions: str | None
    store: bool
    background: bool
    stream: bool
    previous_response_id: str | None
    metadata: dict[str, str]
    text: dict[str, Any]  # echoed: {"format": {...}}
    tools: list[dict[str, Any]]  # echoed, flat
    tool_choice: str | dict[str, Any]  # echoed


def parse_responses_request(body: dict[str, Any]) -> ResponsesRequest:
    check_fields(body, RESPONSES_FIELDS)
    _check_neutral(body)
    if body.get("input") is None:
        raise bad_request("you must provide input", param="input")
    store = boolean(body, "store", True)
    background = boolean(body, "background", False)
    stream = boolean(body, "stream", False)
    if background and not store:
        raise bad_request("background responses must be stored: send store true", "background")
    if background and stream:
        raise unsupported("stream", "a background response is not streamed; poll GET")
    options = optional(body, "stream_options", dict, "an object")
    if options is not None and (not stream or set(options) - {"include_obfuscation"}):
        raise bad_request(
            'stream_options takes only "include_obfuscation", with stream', "stream_options"
        )
    previous = optional(body, "previous_response_id", str, "a string")
    text, response_format = _text(body)
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"))
    chat_body: dict[str, Any] = {
        "model": body.get("model"),
        "max_completion_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "user": body.get("user"),
        "parallel_tool_calls": body.get("parallel_tool_calls"),
        "response_format": response_format,
        "tools": [_nested_tool(t) for t in tools] or None,
        "tool_choice": _nested_choice(tool_choice),
        **{name: body[name] for name in EXTENSION_FIELDS if name in body},
    }
    return ResponsesRequest(
        body=body,
        chat_body=chat_body,
        input_messages=input_messages(body["input"]),
        instructions=optional(body, "instructions", str, "a string"),
        store=store,
        background=background,
        stream=stream,
        previous_response_id=previous,
        metadata=_metadata(body),
        text=text,
        tools=tools,
        tool_choice=tool_choice if tool_choice is not None else ("auto" if tools else "none"),
    )


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatRequest:
    """The chat request of ``req`` over ``history`` (a chained request's earlier turns)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body = {**req.chat_body, "messages": [*system, *history, *req.input_messages]}
    try:
        return parse_chat_request({k: v for k, v in body.items() if v is not None})
    except APIError as exc:
        exc.message = renamed(exc.message)
        exc.param = renamed(exc.param) if exc.param is not None else None
        raise


def renamed(text: str) -> str:
    for pattern, name in RENAMES:
        text = pattern.sub(name, text)
    return text


def _check_neutral(body: dict[str, Any]) -> None:
    for name, neutral in NEUTRAL_FIELDS.items():
        value = body.get(name)
        if value not in (None, neutral) and not (name == "service_tier" and value == "default"):
            raise unsupported(name, f"only {neutral!r} is served" if neutral else "")
    if body.get("include"):
        raise unsupported("include", "no extra output data is served")
    if body.get("top_logprobs"):
        raise unsupported("top_logprobs", "logprobs are not served by /v1/responses")
    for name in ("prompt_cache_key", "safety_identifier", "user"):
        optional(body, name, str, "a string")


def _metadata(body: dict[str, Any]) -> dict[str, str]:
    metadata = optional(body, "metadata", dict, "an object") or {}
    if len(metadata) > MAX_METADATA:
        raise bad_request(f"metadata has at most {MAX_METADATA} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise bad_request(
                "metadata values must be strings of at most 512 characters, keys at most 64",
                param=f"metadata.{key[:64]}",
            )
    return dict(metadata)


def _text(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``text`` as echoed, and the chat ``response_format`` of its format (None: plain text)."""
    text = optional(body, "text", dict, "an object") or {}
    for key in text:
        if key == "verbosity" and text[key] in (None, "medium"):
            continue
        if key != "format":
            raise unsupported(f"text.{key}")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in TEXT_FORMATS:
        raise bad_request(
            f"text.format.type must be one of {', '.join(TEXT_FORMATS)}; got {kind!r}",
            param="text.format",
        )
    if kind == "text":
        return {"format": {"type": "text"}}, None
    if kind == "json_object":
        return {"format": fmt}, dict(fmt)
    spec = {k: v for k, v in fmt.items() if k != "type"}
    if not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema"), dict):
        raise bad_request(
            'text.format must be {"type": "json_schema", "name": ..., "schema": {...}}',
            param="text.format",
        )
    return {"format": fmt}, {"type": "json_schema", "json_schema": spec}


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request(f"tools must be an array, got {json_type(tools)}", param="tools")
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise unsupported(
                f"tools[{i}].type", f"only function tools are served, not {kind!r} (built-in)"
            )
        for key in tool:
            if key not in TOOL_FIELDS:
                raise bad_request(f"Unrecognized field tools[{i}].{key}", f"tools[{i}].{key}")
    return [{"parameters": None, "strict": None, **tool} for tool in tools]


def _nested_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: v for k, v in tool.items() if k != "type" and v is not None}
    return {"type": "function", "function": function}


def _tool_choice(value: Any) -> str | dict[str, Any] | None:
    if value is None or isinstance(value, str):
        return value
    if (
        not isinstance(value, dict)
        or value.get("type") != "function"
        or set(value) != {"type", "name"}
        or not isinstance(value["name"], str)
    ):
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "function"):
            raise unsupported("tool_choice", f"a tool choice of type {kind!r}")
        raise bad_request(
            'a named tool_choice must be {"type": "function", "name": "..."}', "tool_choice"
        )
    return value


def _nested_choice(value: str | dict[str, Any] | None) -> Any:
    if isinstance(value, dict):
        return {"type": "function", "function": {"name": value["name"]}}
    return value
