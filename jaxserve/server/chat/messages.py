"""Chat messages and the chat-only fields around them (tools, response_format, ...).

Validates OpenAI's message shapes (roles, string or text-part content, assistant ``tool_calls``,
tool results) and flattens them to what chat templates expect (tool-call arguments as objects,
as templates such as Llama 3.1's read them). ``tools`` and ``tool_choice`` are checked in
``tools.py``; ``response_format`` is read with the other structured-output fields
(``api/structured_outputs.py``). Fields the server cannot honour (multimodal content, stored
completions) are a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from jaxserve.json_limits import load_json
from jaxserve.server.api.errors import bad_request, unsupported
from jaxserve.server.api.fields import json_type, optional
from jaxserve.server.chat.tools import ToolChoice, parse_tools

ROLES = ("system", "developer", "user", "assistant", "tool")


def check_chat_extras(
    body: dict[str, Any],
) -> tuple[tuple[dict[str, Any], ...] | None, ToolChoice]:
    """The chat-only fields; returns the tools to render and the tool choice."""
    tools, tool_choice = parse_tools(body)
    if body.get("functions"):
        raise unsupported("functions", "the legacy functions field is not available; use tools")
    if body.get("function_call") not in (None, "none"):
        raise unsupported("function_call", "the legacy function_call is not available; use tools")
    if body.get("store"):
        raise unsupported("store", "stored completions are not available")
    optional(body, "metadata", dict, "an object")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise unsupported("service_tier")
    if body.get("modalities") not in (None, ["text"]):
        raise unsupported("modalities", "only text output is available")
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        if body.get(name) is not None:
            raise unsupported(name)
    return tools, tool_choice


MESSAGE_FIELDS = frozenset(
    ("role", "content", "name", "tool_calls", "tool_call_id", "refusal", "reasoning_content")
)


def parse_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    """Validate OpenAI chat messages and flatten them to what chat templates expect."""
    if messages is None:
        raise bad_request("you must provide messages", param="messages")
    if not isinstance(messages, list):
        raise bad_request(f"messages must be an array, got {json_type(messages)}", "messages")
    if not messages:
        raise bad_request("messages must contain at least one message", param="messages")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages))


def _message(message: Any, path: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise bad_request(f"{path} must be an object, got {json_type(message)}", param=path)
    for key in message:
        if key not in MESSAGE_FIELDS:
            raise bad_request(f"Unrecognized field {path}.{key}", param=f"{path}.{key}")
    role = message.get("role")
    if role not in ROLES:
        raise bad_request(
            f"{path}.role must be one of {', '.join(ROLES)}; got {role!r}", param=f"{path}.role"
        )
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if content is None and not (role == "assistant" and tool_calls):
        raise bad_request(f"{path}.content is required", param=f"{path}.content")
    out["content"] = _content(content, f"{path}.content") if content is not None else ""
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad_request(f"{path}.name must be a string", param=f"{path}.name")
        out["name"] = name
    if tool_calls is not None:
        if role != "assistant":
            raise bad_request(f"{path}.tool_calls is only valid on assistant messages", path)
        out["tool_calls"] = _tool_calls(tool_calls, f"{path}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{path}.tool_call_id is required on tool messages", param=path)
        out["tool_call_id"] = call_id
    elif message.get("tool_call_id") is not None:
        raise bad_request(f"{path}.tool_call_id is only valid on tool messages", param=path)
    refusal = message.get("refusal")
    if refusal is not None and not isinstance(refusal, str):
        raise bad_request(f"{path}.refusal must be a string", param=f"{path}.refusal")
    # A response's message sent back as it came (with --reasoning-parser); templates that show
    # past reasoning (Qwen3's) read it.
    reasoning = message.get("reasoning_content")
    if reasoning is not None:
        if role != "assistant" or not isinstance(reasoning, str):
            raise bad_request(
                f"{path}.reasoning_content must be a string, on an assistant message",
                param=f"{path}.reasoning_content",
            )
        if reasoning:
            out["reasoning_content"] = reasoning
    return out


def _content(content: Any, path: str) -> str:
    """A string, or an array of text parts joined by newlines (vLLM's "string" format)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f"{path} must be a string or an array of content parts, got {json_type(content)}",
            param=path,
        )
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image_url", "input_audio", "file", "input_image", "video_url"):
            raise unsupported(f"{path}[{i}].type", f"{kind} content needs a multimodal model")
        if kind not in ("text", "refusal") or set(part) != {"type", kind}:
            raise bad_request(
                f'{path}[{i}] must be {{"type": "text", "text": "..."}}', param=f"{path}[{i}]"
            )
        if not isinstance(part[kind], str):
            raise bad_request(f"{path}[{i}].{kind} must be a string", param=f"{path}[{i}]")
        texts.append(part[kind])
    return "\n".join(texts)


def _tool_calls(tool_calls: Any, path: str) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise bad_request(f"{path} must be an array", param=path)
    calls = []
    for i, call in enumerate(tool_calls):
        where = f"{path}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not set(call) <= {"id", "type", "function"}
            or not set(function) <= {"name", "arguments"}
            or not isinstance(call.get("id"), str)
            or call.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise bad_request(
                f'{where} must be {{"id": str, "type": "function", "function": '
                '{"name": str, "arguments": str}}',
                param=where,
            )
        calls.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {
                    "name": function["name"],
                    "arguments": _arguments_for_template(
                        function["arguments"], f"{where}.function.arguments"
                    ),
                },
            }
        )
    return calls


def _arguments_for_template(arguments: str, path: str) -> dict[str, Any] | str:
    """The arguments as an object when they are one (templates serialize them with ``tojson``);
    otherwise the string as sent (a call the model cut short is still shown as it was). JSON
    nested more than ``MAX_JSON_DEPTH`` levels is a 400: reading it, or the template writing
    it, would recurse past Python's limit."""
    try:
        value = load_json(arguments, path)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
