"""Responses ``input`` items -> chat messages, in the shape ``chat/messages.parse_messages`` takes.

``protocol.py`` calls ``input_messages`` on a request's ``input``; ``store.py`` calls it on a
stored response's ``output`` too (output items are valid input items), so a chained request's
conversation is the previous input, the previous output and the new input, as chat messages.
Message items become messages (``developer`` is ``system`` to the template), ``function_call``
items the assistant's ``tool_calls`` (consecutive calls in one message), ``function_call_output``
items ``tool`` messages, and a ``reasoning`` item's text the next assistant message's
``reasoning_content``. Every problem is a 400 naming the item (``input[2].call_id``).
"""

from __future__ import annotations

import uuid
from typing import Any

from jaxserve.server.api.errors import bad_request, unsupported
from jaxserve.server.api.fields import json_type

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")
ITEM_FIELDS = {
    "message": frozenset(("type", "role", "content", "id", "status", "phase")),
    "function_call": frozenset(
        ("type", "call_id", "name", "arguments", "id", "status", "namespace")
    ),
    "function_call_output": frozenset(("type", "call_id", "output", "id", "status")),
    "reasoning": frozenset(("type", "id", "summary", "content", "encrypted_content", "status")),
}


def input_messages(value: Any, path: str = "input") -> list[dict[str, Any]]:
    """``input`` (a text, or a list of items) as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request(
            f"{path} must be a string or an array of items, got {json_type(value)}", path
        )
    builder = _Conversation()
    for i, item in enumerate(value):
        builder.add(item, f"{path}[{i}]")
    return builder.messages


class _Conversation:
    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.reasoning = ""  # a reasoning item's text, for the next assistant message

    def add(self, item: Any, path: str) -> None:
        if not isinstance(item, dict):
            raise bad_request(f"{path} must be an object, got {json_type(item)}", param=path)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "item_reference":
            raise unsupported(
                f"{path}.type", "item references; chain stored responses with previous_response_id"
            )
        if kind not in ITEM_FIELDS:
            raise bad_request(
                f"{path}.type must be one of {', '.join(ITEM_FIELDS)}; got {kind!r}",
                param=f"{path}.type",
            )
        for key in item:
            if key not in ITEM_FIELDS[kind]:
                raise bad_request(f"Unrecognized field {path}.{key}", param=f"{path}.{key}")
        if kind == "message":
            self._message(item, path)
        elif kind == "function_call":
            self._function_call(item, path)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", path)
            output = _text(item.get("output"), f"{path}.output")
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            self._reasoning(item, path)

    def _assistant(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
            self.reasoning = ""
        return message

    def _message(self, item: dict[str, Any], path: str) -> None:
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise bad_request(
                f"{path}.role must be one of {', '.join(MESSAGE_ROLES)}; got {role!r}",
                param=f"{path}.role",
            )
        message = {"role": role, "content": _text(item.get("content"), f"{path}.content")}
        self.messages.append(self._assistant(message) if role == "assistant" else message)

    def _function_call(self, item: dict[str, Any], path: str) -> None:
        call = {
            "id": _string(item, "call_id", path),
            "type": "function",
            "function": {
                "name": _string(item, "name", path),
                "arguments": _string(item, "arguments", path, allow_empty=True),
            },
        }
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and not self.reasoning:
            last.setdefault("tool_calls", []).append(call)
        else:
            self.messages.append(self._assistant({"role": "assistant", "tool_calls": [call]}))

    def _reasoning(self, item: dict[str, Any], path: str) -> None:
        if item.get("encrypted_content") is not None:
            raise unsupported(f"{path}.encrypted_content", "reasoning is not encrypted here")
        content = item.get("content") or []
        if not isinstance(content, list):
            raise bad_request(f"{path}.content must be an array", param=f"{path}.content")
        for j, part in enumerate(content):
            where = f"{path}.content[{j}]"
            if not isinstance(part, dict) or part.get("type") != "reasoning_text":
                raise bad_request(f'{where} must be {{"type": "reasoning_text", ...}}', where)
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.text must be a string", param=f"{where}.text")
            self.reasoning += part["text"]


def _string(item: dict[str, Any], name: str, path: str, allow_empty: bool = False) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not (value or allow_empty):
        raise bad_request(f"{path}.{name} must be a non-empty string", param=f"{path}.{name}")
    return value


def _text(content: Any, path: str) -> str:
    """A string, or an array of text parts joined by newlines (as chat content parts are)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f"{path} must be a string or an array of content parts, got {json_type(content)}",
            param=path,
        )
    texts = []
    for j, part in enumerate(content):
        where = f"{path}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise unsupported(f"{where}.type", f"{kind} content needs a multimodal model")
        if kind not in TEXT_PARTS:
            raise bad_request(
                f'{where} must be {{"type": "input_text", "text": "..."}}; got type {kind!r}',
                param=f"{where}.type",
            )
        assert isinstance(part, dict)
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.text must be a string", param=f"{where}.text")
        texts.append(text)
    return "\n".join(texts)


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's ``input`` (already checked by ``input_messages``) as the items
    ``GET /v1/responses/{id}/input_items`` lists: a text is one user message, a message's text
    content becomes its parts, and each item has an ``id`` (its own, or a new one)."""
    items = (
        [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    )
    return [_listed(item) for item in items]


_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    listed = {
        **item,
        "type": kind,
        "id": item.get("id") or f"{_ID_PREFIXES[kind]}_{uuid.uuid4().hex}",
    }
    if kind == "reasoning":
        listed.setdefault("summary", [])
    else:
        listed.setdefault("status", "completed")
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        extra: dict[str, Any] = {"annotations": []} if part == "output_text" else {}
        listed["content"] = [{"type": part, "text": item["content"], **extra}]
    return listed
