"""Typed reads of a JSON request body; every failure is a 400 that names the field.

Used by ``protocol.py`` and ``chat/messages.py``. ``parse_json_object`` turns body bytes into a dict
(invalid UTF-8, malformed or too deeply nested JSON, lone surrogates, integers too long to mean
anything and non-objects are 400s, and no parser message carries a traceback).
"""

from __future__ import annotations

import json
import re
from typing import Any

from jaxserve.server.api.errors import bad_request

# No field means anything past 2**64 (20 digits); Python refuses to convert past 4,300 digits.
MAX_INTEGER_DIGITS = 64
_LONG_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_INTEGER_DIGITS + 1))
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Body bytes -> a JSON object; invalid UTF-8, lone surrogates, integers of more than
    ``MAX_INTEGER_DIGITS`` digits and non-objects are 400s."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"The request body is not valid UTF-8 (byte {exc.start}).") from None
    # NOTE: both scans are a regex over the bytes (about 10 ms per MB); the walk that names the
    # field runs only when one of them matches. Lone surrogates can only come from \u escapes,
    # as the UTF-8 decoder refuses encoded ones.
    has_long_digits = _LONG_DIGITS.search(raw) is not None
    try:
        body = json.loads(text, parse_int=_bounded_int if has_long_digits else None)
    except json.JSONDecodeError as exc:
        raise bad_request(
            f"We could not parse the JSON body of your request: {exc.msg} at line {exc.lineno} "
            f"column {exc.colno}."
        ) from None
    except RecursionError:
        raise bad_request("The JSON body of your request is nested too deeply.") from None
    except ValueError:  # a number Python refuses to convert
        raise bad_request(
            "The JSON body of your request holds a number that cannot be read."
        ) from None
    if not isinstance(body, dict):
        raise bad_request(
            f"The request body must be a JSON object, not {json_type(body)}.", param="body"
        )
    if has_long_digits or _SURROGATE_ESCAPE.search(raw) is not None:
        _reject_unreadable_values(body)
    return body


class _LongInteger:
    """Stands in for an integer literal of more than ``MAX_INTEGER_DIGITS`` digits."""

    def __init__(self, num_digits: int) -> None:
        self.num_digits = num_digits


def _bounded_int(literal: str) -> int | _LongInteger:
    num_digits = len(literal.lstrip("-"))
    return int(literal) if num_digits <= MAX_INTEGER_DIGITS else _LongInteger(num_digits)


def _check_value(path: str, value: Any) -> None:
    if isinstance(value, _LongInteger):
        raise bad_request(
            f"{path or 'body'} is an integer of {value.num_digits} digits; integers in a request "
            f"have at most {MAX_INTEGER_DIGITS} digits.",
            param=path or None,
        )
    if isinstance(value, str) and _SURROGATE.search(value) is not None:
        # JSON may escape a lone surrogate ("\ud800"); no tokenizer can take it.
        raise bad_request(
            f"{path or 'body'} contains a lone UTF-16 surrogate, which is not valid text.",
            param=path or None,
        )


def _reject_unreadable_values(body: Any) -> None:
    """The first overlong integer or lone surrogate (in a value or a key) is a 400 naming it.

    Paths are built only for containers and for the value that fails, so a list of a million
    token ids costs one ``isinstance`` per item.
    """
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                item_path = f"{path}.{key}" if path else str(key)
                _check_value(item_path, key)
                if isinstance(item, dict | list):
                    stack.append((item_path, item))
                else:
                    _check_value(item_path, item)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict | list):
                    stack.append((f"{path}[{i}]", item))
                elif isinstance(item, str | _LongInteger):
                    _check_value(f"{path}[{i}]", item)
        else:
            _check_value(path, value)


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
