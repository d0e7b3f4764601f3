"""Structured-output request fields -> ``StructuredOutputsParams``, and their grammar compile.

The spellings clients send, on /v1/completions and /v1/chat/completions alike: OpenAI's
``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}``, or the neutral ``{"type": "text"}``), vLLM's
``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``, ...) and its older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields. At most one
of the three may be sent. ``protocol.py`` calls ``parse_structured_outputs``; the routes call
``ServingContext.compile_grammars`` (``context.py``) before the generation starts.
"""

from __future__ import annotations

from typing import Any

from jaxserve.json_limits import grammar_schema, load_json
from jaxserve.sampling_params import (
    GUIDED_ALIASES,
    SamplingParamsError,
    StructuredOutputsParams,
)
from jaxserve.server.api.errors import bad_request

FIELDS = ("response_format", "structured_outputs", *GUIDED_ALIASES)
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_FIELDS = frozenset(("name", "schema", "strict", "description"))


def parse_structured_outputs(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str]:
    """The request's constraint (None without one) and the field it came in, which names the
    constraint in errors."""
    sent = [name for name in FIELDS if body.get(name) is not None]
    if "response_format" in sent and _response_format_is_text(body["response_format"]):
        sent.remove("response_format")
    if len(sent) > 1:
        raise bad_request(
            f"send one of {', '.join(sent)}: each constrains the output", param=sent[1]
        )
    if not sent:
        return None, "structured_outputs"
    param = sent[0]
    try:
        if param == "response_format":
            spec = _response_format(body["response_format"])
        elif param == "structured_outputs":
            value = body["structured_outputs"]
            if isinstance(value, dict) and value.get("json") is not None:
                value = {**value, "json": _schema_text(value["json"], "structured_outputs.json")}
            spec = StructuredOutputsParams.of(value)
        else:
            value = body[param]
            if param == "guided_json":
                value = _schema_text(value, param)
            spec = StructuredOutputsParams.of({GUIDED_ALIASES[param]: value})
    except SamplingParamsError as exc:
        shown = exc.param if param == "structured_outputs" else param
        raise bad_request(str(exc), param=shown) from None
    except TypeError:  # a field of the wrong shape, e.g. choice as an object
        raise bad_request(f"{param} is not a valid constraint", param=param) from None
    return spec, param


def _response_format_is_text(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text"


def _response_format(value: Any) -> StructuredOutputsParams:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}",
            param="response_format",
        )
    if kind == "json_object":
        if set(value) != {"type"}:
            raise bad_request(
                'response_format {"type": "json_object"} takes no other field', "response_format"
            )
        return StructuredOutputsParams(json_object=True)
    if set(value) != {"type", "json_schema"} or not isinstance(value["json_schema"], dict):
        raise bad_request(
            'response_format must be {"type": "json_schema", "json_schema": {"name": ..., '
            '"schema": {...}}}',
            param="response_format",
        )
    spec = value["json_schema"]
    unknown = sorted(set(spec) - JSON_SCHEMA_FIELDS)
    if unknown:
        raise bad_request(
            f"response_format.json_schema has unknown field {unknown[0]!r}; known: "
            f"{sorted(JSON_SCHEMA_FIELDS)}",
            param="response_format",
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be an object", "response_format")
    return StructuredOutputsParams(json=_schema_text(schema, "response_format"))


def _schema_text(value: Any, param: str) -> Any:
    """A JSON schema sent as an object, a boolean or a JSON text -> the text the grammar engine
    compiles (json_limits.grammar_schema); anything else is left to StructuredOutputsParams
    to refuse."""
    if isinstance(value, str):
        try:
            value = load_json(value, param)
        except ValueError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param=param) from None
    elif not isinstance(value, dict | bool):
        return value
    return grammar_schema(value, param)
