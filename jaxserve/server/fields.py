"""Typed reads of a JSON request body; every failure is a 400 that names the field.

Used by ``protocol.py`` and ``messages.py``. ``parse_json_object`` turns body bytes into a dict
(invalid UTF-8, malformed or too deeply nested JSON, lone surrogates and non-objects are 400s,
and no parser message carries a traceback).
"""

from __future__ import annotations

import json
from typing import Any

from jaxserve.server.errors import bad_request


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Body bytes -> a JSON object; invalid UTF-8, lone surrogates and non-objects are 400s."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"The request body is not valid UTF-8 (byte {exc.start}).") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(
            f"We could not parse the JSON body of your request: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno}."
        ) from None
    except RecursionError:
        raise bad_request("The JSON body of your request is nested too deeply.") from None
    if not isinstance(body, dict):
        raise bad_request(
            f"The request body must be a JSON object, not {json_type(body)}.", param="body"
        )
    _reject_lone_surrogates(body)
    return body


def _reject_lone_surrogates(body: Any) -> None:
    """JSON may escape a lone surrogate (``"\\ud800"``); no tokenizer can take it."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request(
                    f"{path or 'body'} contains a lone UTF-16 surrogate, which is not valid text.",
                    param=path or None,
                ) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((f"{path}.{key}" if path else str(key), key))
                stack.append((f"{path}.{key}" if path else str(key), item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for name in body:
        if name not in allowed:
            raise bad_request(f"Unrecognized request argument supplied: {name}", param=name)


def optional(body: dict[str, Any], name: str, kind: type | tuple[type, ...], kind_name: str) -> Any:
    """An optional field of a JSON type (``null`` reads as absent)."""
    value = body.get(name)
    if value is None:
        return None
    is_bool = isinstance(value, bool)
    wants_bool = kind is bool or (isinstance(kind, tuple) and bool in kind)
    if not isinstance(value, kind) or (is_bool and not wants_bool):
        raise bad_request(f"{name} must be {kind_name}, got {json_type(value)}", param=name)
    return value


def boolean(body: dict[str, Any], name: str, default: bool) -> bool:
    value = optional(body, name, bool, "a boolean")
    return default if value is None else value


def integer(body: dict[str, Any], name: str) -> int | None:
    return optional(body, name, int, "an integer")
