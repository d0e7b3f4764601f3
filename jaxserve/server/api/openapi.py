"""The OpenAPI 3.0 description of the server, served at ``/openapi.json``.

Written by hand (the routes parse JSON themselves) and built per app, so the limits it states
(context length, vocabulary, caps from ``SamplingParams``) are the ones the server enforces.
Request bodies forbid unknown fields, as the server does.
"""

from __future__ import annotations

from typing import Any

from jaxserve.sampling_params import (
    DEFAULT_MAX_GRAMMAR_BYTES,
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
)
from jaxserve.server.api.embeddings import ENCODING_FORMATS, MAX_EMBEDDING_INPUTS
from jaxserve.server.api.protocol import MAX_BATCH_PROMPTS
from jaxserve.server.api.scoring import SCORE_SIDES
from jaxserve.server.chat.messages import ROLES
from jaxserve.server.chat.tools import FUNCTION_NAME, MAX_TOOLS


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


def _errors(*statuses: int) -> dict[str, Any]:
    reasons = {
        400: "Invalid request (the message and param say what is wrong)",
        401: "Missing or wrong API key",
        404: "Unknown model or route",
        405: "Method not allowed",
        408: "Request body not received within the body timeout",
        413: "Request body over the limit",
        429: "Waiting queue full or rate limit reached; retry after Retry-After seconds",
        431: "Too many request headers",
        500: "Engine failure",
        503: "Shutting down or engine not running; retry after Retry-After seconds",
    }
    content = {"application/json": {"schema": _ref("ErrorResponse")}}
    return {str(s): {"description": reasons[s], "content": content} for s in statuses}


GENERATION_ERRORS = (400, 401, 404, 408, 413, 429, 431, 500, 503)

# One server-sent event as a client parses it (the data line carries a JSON chunk or [DONE]).
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}


def _sampling_properties(max_model_len: int, vocab_size: int) -> dict[str, Any]:
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    return {
        "model": {"type": "string"},
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE}),
        "top_p": _nullable(
            {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1}
        ),
        "top_k": _nullable(
            {"oneOf": [{"type": "integer", "enum": [-1]}, {"type": "integer", "minimum": 1}]}
        ),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "seed": _nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1}),
        "stop": _nullable(
            {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    {
                        "type": "array",
                        "items": {"type": "string", "minLength": 1},
                        "maxItems": MAX_STOP_STRINGS,
                    },
                ]
            }
        ),
        "stop_token_ids": _nullable({"type": "array", "items": token_id}),
        "ignore_eos": {"type": "boolean"},
        "include_stop_str_in_output": {"type": "boolean"},
        "skip_special_tokens": {"type": "boolean"},
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable(
            {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 10}
        ),
        "logit_bias": _nullable(
            {
                "type": "object",
                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                "description": f"token id (as a string, below {vocab_size}) -> bias",
            }
        ),
        "min_tokens": {"type": "integer", "minimum": 0},
        "prompt_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable(
            {
                "type": "object",
                "properties": {"include_usage": {"type": "boolean"}},
                "additionalProperties": False,
                "description": "Only with stream: true (otherwise a 400).",
            }
        ),
        "user": _nullable({"type": "string"}),
        "priority": {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1},
        "cache_salt": _nullable({"type": "string", "minLength": 1}),
        **_structured_output_properties(),
    }


def _structured_output_properties() -> dict[str, Any]:
    """response_format, structured_outputs and the guided_* aliases: at most one per request."""
    text = {"type": "string", "minLength": 1, "maxLength": DEFAULT_MAX_GRAMMAR_BYTES}
    choice = {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": text}
    schema = {"type": "object", "description": "A JSON schema."}
    json_schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "description": {"type": "string"},
            "schema": schema,
            "strict": _nullable({"type": "boolean"}),
        },
        "additionalProperties": False,
    }
    response_format = {
        "oneOf": [
            {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}},
                "additionalProperties": False,
            },
            {
                "type": "object",
                "required": ["type", "json_schema"],
                "properties": {
                    "type": {"type": "string", "enum": ["json_schema"]},
                    "json_schema": json_schema,
                },
                "additionalProperties": False,
            },
        ],
        "description": "OpenAI's structured output: any JSON object, or one that follows a schema.",
    }
    structured_outputs = {
        "type": "object",
        "properties": {
            "json": {"oneOf": [schema, text]},
            "json_object": {"type": "boolean"},
            "regex": text,
            "choice": choice,
            "grammar": {**text, "description": "Lark, or EBNF (GBNF)."},
            "reasoning_end": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "reasoning_start": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        },
        "additionalProperties": False,
        "description": "vLLM's constraint: exactly one of json, json_object, regex, choice or "
        "grammar. An invalid or unsupported one is a 400.",
    }
    return {
        "response_format": _nullable(response_format),
        "structured_outputs": _nullable(structured_outputs),
        "guided_json": _nullable(
            {"oneOf": [schema, text], "description": "= structured_outputs.json"}
        ),
        "guided_regex": _nullable({**text, "description": "= structured_outputs.regex"}),
        "guided_choice": _nullable({**choice, "description": "= structured_outputs.choice"}),
        "guided_grammar": _nullable({**text, "description": "= structured_outputs.grammar"}),
    }


def _max_tokens(max_model_len: int, what: str) -> dict[str, Any]:
    return _nullable(
        {
            "type": "integer",
            "minimum": 1,
            "maximum": max_model_len - 1,
            "description": (
                f"Prompt tokens + max_tokens must not exceed the context length "
                f"({max_model_len}); a request over it is a 400, never clamped. {what}"
            ),
        }
    )


def _optional_nullable(schema: dict[str, Any], keep: tuple[str, ...] = ()) -> None:
    """The server reads ``null`` as "not sent" for every optional field."""
    required = set(schema.get("required", ())) | set(keep)
    for name, prop in schema["properties"].items():
        if name not in required:
            prop["nullable"] = True


def _schemas(max_model_len: int, vocab_size: int) -> dict[str, Any]:
    token_ids = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
    }
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
        "additionalProperties": False,
    }
    content = {"oneOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
    tool_call = {
        "type": "object",
        "required": ["id", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name", "arguments"],
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    }
    plain_roles = [role for role in ROLES if role not in ("assistant", "tool")]
    message = {
        "oneOf": [
            {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": plain_roles},
                    "content": content,
                    "name": {"type": "string"},
                },
                "additionalProperties": False,
            },
            {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"type": "string", "enum": ["assistant"]},
                    "content": {
                        **content,
                        "nullable": True,
                        "description": "May be null (or absent) when tool_calls is set.",
                    },
                    "name": {"type": "string"},
                    "tool_calls": {"type": "array", "items": tool_call},
                    "refusal": _nullable({"type": "string"}),
                    "reasoning_content": _nullable({"type": "string"}),
                },
                "additionalProperties": False,
            },
            {
                "type": "object",
                "required": ["role", "content", "tool_call_id"],
                "properties": {
                    "role": {"type": "string", "enum": ["tool"]},
                    "content": content,
                    "tool_call_id": {"type": "string", "minLength": 1},
                },
                "additionalProperties": False,
            },
        ]
    }
    sampling = _sampling_properties(max_model_len, vocab_size)
    completion_request = {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            **sampling,
            "prompt": {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    token_ids,
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_BATCH_PROMPTS,
                        "items": {"type": "string", "minLength": 1},
                    },
                    {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_BATCH_PROMPTS,
                        "items": token_ids,
                    },
                ]
            },
            "max_tokens": _max_tokens(max_model_len, "Default 16 (clamped to the room left)."),
            "echo": {"type": "boolean"},
            "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
            "best_of": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N}),
            "add_special_tokens": {"type": "boolean"},
        },
        "additionalProperties": False,
    }
    chat_request = {
        "type": "object",
        "required": ["messages"],
        "properties": {
            **sampling,
            "messages": {"type": "array", "minItems": 1, "items": message},
            "max_tokens": _max_tokens(max_model_len, "Default: the room left."),
            "max_completion_tokens": _max_tokens(max_model_len, "Overrides max_tokens."),
            "logprobs": _nullable({"type": "boolean"}),
            "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
            "add_generation_prompt": {"type": "boolean"},
            "add_special_tokens": {"type": "boolean"},
            "tools": {
                "type": "array",
                "maxItems": MAX_TOOLS,
                "items": _ref("Tool"),
                "description": "Functions the model may call; rendered by the chat template.",
            },
            "tool_choice": {
                "oneOf": [
                    {"type": "string", "enum": ["none", "auto", "required"]},
                    _ref("NamedToolChoice"),
                ],
                "description": (
                    'Default "auto" when tools are sent, else "none". "auto" needs the server '
                    'flags --enable-auto-tool-choice and --tool-call-parser; "required" and a '
                    "named function are enforced by a grammar built from the tools' parameters, "
                    "so the calls always parse and match them."
                ),
            },
            "parallel_tool_calls": {
                "type": "boolean",
                "description": "false: at most one tool call per choice. Default true.",
            },
        },
        "additionalProperties": False,
    }
    tokenize_request = {
        "type": "object",
        "properties": {
            "model": {"type": "string"},
            "prompt": {"type": "string"},
            "messages": {"type": "array", "minItems": 1, "items": message},
            "add_special_tokens": {"type": "boolean"},
            "add_generation_prompt": {"type": "boolean"},
            "return_token_strs": {"type": "boolean"},
        },
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
        "additionalProperties": False,
    }
    detokenize_request = {
        "type": "object",
        "required": ["tokens"],
        "properties": {"model": {"type": "string"}, "tokens": {**token_ids, "minItems": 0}},
        "additionalProperties": False,
    }
    choice_list = {"type": "array", "items": {"type": "object"}}
    completion_like: dict[str, Any] = {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": choice_list,
            "usage": {"type": "object"},
        },
    }
    tool = {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": f"^{FUNCTION_NAME.pattern}$"},
                    "description": {"type": "string"},
                    "parameters": {
                        "type": "object",
                        "description": 'A JSON schema of type "object"; local $refs only.',
                    },
                    "strict": {"type": "boolean"},
                },
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    }
    named_tool_choice = {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}},
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    }
    response_tool_call = {
        "type": "object",
        "required": ["id", "type", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"type": "string", "enum": ["function"]},
            "function": {
                "type": "object",
                "required": ["name", "arguments"],
                "properties": {
                    "name": {"type": "string"},
                    "arguments": {"type": "string", "description": "A JSON object, as text."},
                },
            },
        },
    }
    chat_choice = {
        "type": "object",
        "required": ["index", "message", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"type": "string", "enum": ["assistant"]},
                    "content": _nullable({"type": "string", "description": "null with tool calls"}),
                    "reasoning_content": _nullable(
                        {
                            "type": "string",
                            "description": "The <think> section; present with --reasoning-parser.",
                        }
                    ),
                    "tool_calls": {"type": "array", "items": response_tool_call},
                },
            },
            "logprobs": _nullable({"type": "object"}),
            "finish_reason": _nullable(
                {"type": "string", "enum": ["stop", "length", "tool_calls", "abort", "error"]}
            ),
            "stop_reason": _nullable({"oneOf": [{"type": "integer"}, {"type": "string"}]}),
        },
    }
    chat_response = {
        **completion_like,
        "properties": {
            **completion_like["properties"],
            "choices": {"type": "array", "items": chat_choice},
        },
        "description": (
            "Streamed as chat.completion.chunk events whose choices carry a delta: role first, "
            "then content, reasoning_content and tool_calls fragments (a call's id, type and "
            "name in its first fragment, its arguments text in the following ones)."
        ),
    }
    error = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": _nullable({"type": "string"}),
                    "code": _nullable({"type": "string"}),
                },
            }
        },
    }
    for request in (completion_request, chat_request, detokenize_request):
        _optional_nullable(request)
    _optional_nullable(tokenize_request, keep=("prompt", "messages"))  # exactly one is sent
    return {
        "CompletionRequest": completion_request,
        "ChatCompletionRequest": chat_request,
        "TokenizeRequest": tokenize_request,
        "DetokenizeRequest": detokenize_request,
        "CompletionResponse": completion_like,
        "ChatCompletionResponse": chat_response,
        "Tool": tool,
        "NamedToolChoice": named_tool_choice,
        "ErrorResponse": error,
    }


def _post(summary: str, request: str, ok: dict[str, Any], errors: tuple[int, ...]) -> Any:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {"200": ok, **_errors(*errors)},
        }
    }


def _get(summary: str, schema: dict[str, Any], errors: tuple[int, ...] = (401,)) -> Any:
    ok = {"description": "OK", "content": {"application/json": {"schema": schema}}}
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(*errors)}}}


def openapi_spec(
    model_names: tuple[str, ...],
    max_model_len: int,
    vocab_size: int,
    version: str,
    public_paths: frozenset[str] | None = None,
) -> dict[str, Any]:
    """The spec; ``public_paths`` is None without an API key, else the paths it does not guard."""
    spec: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {
            "title": "jaxserve",
            "version": version,
            "description": f"OpenAI-compatible server for {', '.join(model_names)}.",
        },
        "paths": {
            **_paths(),
            **_responses_paths(),
            **_embeddings_paths(),
            **_scoring_paths(),
            **_classify_paths(),
        },
        "components": {
            "schemas": {
                **_schemas(max_model_len, vocab_size),
                **_responses_schemas(max_model_len, vocab_size),
                **_embeddings_schemas(vocab_size),
                **_scoring_schemas(),
                **_classify_schemas(vocab_size),
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
    if public_paths is not None:
        spec["security"] = [{"bearer": []}]
        for path in public_paths:
            for operation in spec["paths"][path].values():
                operation["security"] = []
    return spec


def _paths() -> dict[str, Any]:
    tokenize_errors = (400, 401, 404, 408, 413, 431, 503)
    return {
        "/v1/completions": _post(
            "Text completion",
            "CompletionRequest",
            _generated("CompletionResponse"),
            GENERATION_ERRORS,
        ),
        "/v1/chat/completions": _post(
            "Chat completion",
            "ChatCompletionRequest",
            _generated("ChatCompletionResponse"),
            GENERATION_ERRORS,
        ),
        "/tokenize": _post(
            "Tokenize a prompt or chat messages",
            "TokenizeRequest",
            _ok(
                {
                    "type": "object",
                    "required": ["count", "max_model_len", "tokens"],
                    "properties": {
                        "count": {"type": "integer"},
                        "max_model_len": {"type": "integer"},
                        "tokens": {"type": "array", "items": {"type": "integer"}},
                    },
                }
            ),
            tokenize_errors,
        ),
        "/detokenize": _post(
            "Token ids to text",
            "DetokenizeRequest",
            _ok({"type": "object", "required": ["prompt"]}),
            tokenize_errors,
        ),
        "/v1/models": _get("Served models", {"type": "object", "required": ["data"]}),
        "/version": _get("Server version", {"type": "object", "required": ["version"]}),
        "/health": _health(),
        "/metrics": _metrics(),
    }


RESPONSES_SAMPLING = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "stream",
    "user",
    "priority",
    "cache_salt",
)


def _responses_schemas(max_model_len: int, vocab_size: int) -> dict[str, Any]:
    """The Responses API's bodies (``server/responses/``): the request's main fields; items,
    ``text.format`` and tools are checked by the server, which names the field of a 400."""
    sampling = _sampling_properties(max_model_len, vocab_size)
    item = {"type": "object", "description": "a message, function_call or function_call_output"}
    properties = {
        **{name: sampling[name] for name in RESPONSES_SAMPLING},
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": item}]},
        "instructions": {"type": "string"},
        "max_output_tokens": _max_tokens(max_model_len, "Past it: status incomplete."),
        "text": {"type": "object", "description": "format: text, json_object or json_schema"},
        "tools": {"type": "array", "items": {"type": "object"}, "maxItems": MAX_TOOLS},
        "tool_choice": {
            "oneOf": [
                {"type": "string", "enum": ["none", "auto", "required"]},
                {"type": "object", "required": ["type", "name"]},
            ]
        },
        "parallel_tool_calls": {"type": "boolean"},
        "store": {"type": "boolean", "description": "default true"},
        "background": {"type": "boolean", "description": "needs store"},
        "previous_response_id": {"type": "string"},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        "truncation": {"type": "string", "enum": ["disabled"]},
    }
    request = {
        "type": "object",
        "required": ["input"],
        "properties": properties,
        "additionalProperties": False,
    }
    _optional_nullable(request)
    response = {
        "type": "object",
        "required": ["id", "object", "created_at", "status", "output"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["response"]},
            "created_at": {"type": "integer"},
            "status": {"type": "string"},
            "output": {"type": "array", "items": {"type": "object"}},
            "usage": _nullable({"type": "object"}),
        },
        "description": "Streamed as the typed response.* events of OpenAI's Responses API.",
    }
    return {"ResponsesRequest": request, "ResponseObject": response}


def _responses_paths() -> dict[str, Any]:
    ok = _ok(_ref("ResponseObject"))
    deleted = _ok({"type": "object", "required": ["id", "object", "deleted"]})
    items = _ok({"type": "object", "required": ["object", "data", "has_more"]})
    return {
        "/v1/responses": _post(
            "Create a response (OpenAI's Responses API)",
            "ResponsesRequest",
            _generated("ResponseObject"),
            GENERATION_ERRORS,
        ),
        "/v1/responses/{response_id}": {
            "get": _by_id("A stored response", ok, 401, 404),
            "delete": _by_id("Delete a stored response", deleted, 401, 404),
        },
        "/v1/responses/{response_id}/cancel": {
            "post": _by_id("Cancel a background response", ok, 400, 401, 404),
        },
        "/v1/responses/{response_id}/input_items": {
            "get": _by_id("A stored response's input items, a cursor page", items, 400, 401, 404),
        },
    }


EMBEDDING = {
    "type": "object",
    "required": ["object", "index", "embedding"],
    "properties": {
        "object": {"type": "string", "enum": ["embedding"]},
        "index": {"type": "integer"},
        "embedding": {
            "oneOf": [
                {"type": "array", "items": {"type": "number"}},
                {"type": "string", "description": "base64 of little-endian float32"},
            ]
        },
    },
}


def _embeddings_schemas(vocab_size: int) -> dict[str, Any]:
    """``/v1/embeddings`` (``server/api/embeddings.py``; a model served with --runner pooling,
    else a 400 naming the flag)."""
    token_ids = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
    }
    text = {"type": "string", "minLength": 1}
    item = {"oneOf": [text, token_ids]}
    many = {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS, "items": item}
    request = {
        "type": "object",
        "description": "exactly one of input or messages (a chat rendered by the chat template)",
        "properties": {
            "model": {"type": "string"},
            "input": {"oneOf": [text, token_ids, many]},
            "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
            "add_generation_prompt": {"type": "boolean", "default": False},
            "encoding_format": {"type": "string", "enum": list(ENCODING_FORMATS)},
            "dimensions": {"type": "integer", "minimum": 1},
            "user": {"type": "string"},
            "normalize": {"type": "boolean"},
            "add_special_tokens": {"type": "boolean"},
            "priority": {"type": "integer"},
        },
        "additionalProperties": False,
    }
    _optional_nullable(request)
    response = {
        "type": "object",
        "required": ["object", "data", "model", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["list"]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "data": {"type": "array", "items": EMBEDDING},
            "usage": {
                "type": "object",
                "required": ["prompt_tokens", "total_tokens"],
                "properties": {
                    "prompt_tokens": {"type": "integer"},
                    "total_tokens": {"type": "integer"},
                },
            },
        },
    }
    return {"EmbeddingRequest": request, "EmbeddingResponse": response}


def _embeddings_paths() -> dict[str, Any]:
    return {
        "/v1/embeddings": _post(
            "Embeddings (a model served with --runner pooling)",
            "EmbeddingRequest",
            _ok(_ref("EmbeddingResponse")),
            GENERATION_ERRORS,
        )
    }


def _scoring_schemas() -> dict[str, Any]:
    """``/v1/score`` and ``/v1/rerank`` (``server/api/scoring.py``, ``score_handler.py``; a
    cross-encoder or a decoder reranker served with --runner pooling, else a 400)."""
    text = {"type": "string"}
    texts: dict[str, Any] = {
        "oneOf": [
            text,
            {
                "type": "array",
                "minItems": 1,
                "items": {
                    "oneOf": [
                        text,
                        {"type": "object", "required": ["text"], "properties": {"text": text}},
                    ]
                },
            },
        ]
    }
    common = {
        "model": text,
        "user": text,
        "truncate_prompt_tokens": {"type": "integer", "minimum": -1},
        "priority": {"type": "integer"},
        "use_activation": {"type": "boolean"},
        "activation": {"type": "boolean"},
    }
    sides = {name: texts for pair in SCORE_SIDES for name in pair}
    score = {"type": "object", "properties": {**common, **sides}, "additionalProperties": False}
    rerank_properties = {
        **common,
        "query": text,
        "documents": texts,
        "top_n": {"type": "integer", "minimum": 0},
        "return_documents": {"type": "boolean"},
        "instruction": text,
    }
    rerank = {
        "type": "object",
        "required": ["query", "documents"],
        "properties": rerank_properties,
        "additionalProperties": False,
    }
    _optional_nullable(score)
    _optional_nullable(rerank)
    return {"ScoreRequest": score, "RerankRequest": rerank, **_scoring_responses()}


def _scoring_responses() -> dict[str, Any]:
    text = {"type": "string"}
    usage = {
        "type": "object",
        "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}},
    }
    score_item = {
        "type": "object",
        "properties": {"index": {"type": "integer"}, "object": text, "score": {"type": "number"}},
    }
    result = {
        "type": "object",
        "required": ["index", "relevance_score"],
        "properties": {
            "index": {"type": "integer"},
            "relevance_score": {"type": "number"},
            "document": {"type": "object", "properties": {"text": text}},
        },
    }
    return {
        "ScoreResponse": {
            "type": "object",
            "required": ["data", "usage"],
            "properties": {
                "id": text,
                "object": text,
                "created": {"type": "integer"},
                "model": text,
                "data": {"type": "array", "items": score_item},
                "usage": usage,
            },
        },
        "RerankResponse": {
            "type": "object",
            "required": ["results", "usage"],
            "properties": {
                "id": text,
                "model": text,
                "results": {"type": "array", "items": result},
                "usage": usage,
            },
        },
    }


def _scoring_paths() -> dict[str, Any]:
    score = _post(
        "Scores of (query, document) pairs (a cross-encoder or decoder reranker served with "
        "--runner pooling)",
        "ScoreRequest",
        _ok(_ref("ScoreResponse")),
        GENERATION_ERRORS,
    )
    rerank = _post(
        "Documents ranked by their score against the query, best first (Cohere's and Jina's shape)",
        "RerankRequest",
        _ok(_ref("RerankResponse")),
        GENERATION_ERRORS,
    )
    return {
        **{path: score for path in ("/v1/score", "/score")},
        **{path: rerank for path in ("/v1/rerank", "/rerank", "/v2/rerank")},
    }


def _classify_schemas(vocab_size: int) -> dict[str, Any]:
    """``/classify`` and ``/v1/classify`` (``server/api/classify.py``; a sequence classifier
    served for pooling, else a 400)."""
    embedding = _embeddings_schemas(vocab_size)["EmbeddingRequest"]["properties"]
    request = {
        "type": "object",
        "required": ["input"],
        "properties": {
            "model": {"type": "string"},
            "input": embedding["input"],
            "user": {"type": "string"},
            "priority": {"type": "integer"},
            "add_special_tokens": {"type": "boolean"},
            "use_activation": {"type": "boolean"},
            "activation": {"type": "boolean"},
        },
        "additionalProperties": False,
    }
    _optional_nullable(request)
    item = {
        "type": "object",
        "required": ["index", "label", "probs", "num_classes"],
        "properties": {
            "index": {"type": "integer"},
            "label": {"type": "string"},
            "probs": {"type": "array", "items": {"type": "number"}},
            "num_classes": {"type": "integer"},
        },
    }
    response = {
        "type": "object",
        "required": ["object", "data", "model", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["list"]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "data": {"type": "array", "items": item},
            "usage": {
                "type": "object",
                "properties": {
                    "prompt_tokens": {"type": "integer"},
                    "total_tokens": {"type": "integer"},
                    "completion_tokens": {"type": "integer"},
                },
            },
        },
    }
    return {"ClassificationRequest": request, "ClassificationResponse": response}


def _classify_paths() -> dict[str, Any]:
    classify = _post(
        "The probability of each label of each input (a sequence classifier served with "
        "--runner pooling)",
        "ClassificationRequest",
        _ok(_ref("ClassificationResponse")),
        GENERATION_ERRORS,
    )
    return {path: classify for path in ("/v1/classify", "/classify")}


def _by_id(summary: str, ok: dict[str, Any], *errors: int) -> dict[str, Any]:
    response_id = {"name": "response_id", "in": "path", "required": True}
    return {
        "summary": summary,
        "parameters": [{**response_id, "schema": {"type": "string"}}],
        "responses": {"200": ok, **_errors(*errors)},
    }


def _generated(response: str) -> dict[str, Any]:
    return {
        "description": "A JSON response, or server-sent events when stream is true",
        "content": {
            "application/json": {"schema": _ref(response)},
            "text/event-stream": {"schema": SSE_EVENT},
        },
    }


def _ok(schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": "OK", "content": {"application/json": {"schema": schema}}}


def _health() -> dict[str, Any]:
    return {
        "get": {
            "summary": "Liveness and readiness: 200 while the engine loop runs",
            "responses": {
                "200": {"description": "Ready"},
                "503": {"description": "Draining or engine not running"},
            },
        }
    }


def _metrics() -> dict[str, Any]:
    return {
        "get": {
            "summary": "Prometheus metrics (vllm:* and jaxserve:*)",
            "responses": {
                "200": {
                    "description": "OK",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                },
                **_errors(401),
            },
        }
    }
