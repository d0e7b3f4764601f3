"""Request bodies: JSON -> validated request dataclasses carrying ``SamplingParams``.

Comes from the route handlers in ``app.py`` (raw body bytes) and goes to ``completions.py`` /
``chat/completions.py``. Only structure is checked here (types, shapes, which fields exist); numeric
limits live in ``SamplingParams`` and are reused, and checks that need the model (vocabulary,
context length) happen once the prompt is tokenized. Unknown fields and fields the server cannot
honour are a 400 naming the field, as OpenAI's API does.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxserve.engine import request_checks
from jaxserve.engine.tokenizer import ALLOWED_TEMPLATE_KWARGS
from jaxserve.sampling_params import SamplingParams, SamplingParamsError
from jaxserve.server.api.errors import APIError, bad_request, unsupported
from jaxserve.server.api.fields import (
    MAX_INTEGER_DIGITS,
    boolean,
    check_fields,
    integer,
    json_type,
    optional,
)
from jaxserve.server.api.structured_outputs import FIELDS as STRUCTURED_OUTPUT_FIELDS
from jaxserve.server.api.structured_outputs import parse_structured_outputs
from jaxserve.server.chat.messages import check_chat_extras, parse_messages
from jaxserve.server.chat.tools import ToolChoice

MAX_BATCH_PROMPTS = 256  # prompts in one /v1/completions request
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "skip_special_tokens",
    "min_tokens",
    "prompt_logprobs",
)
COMMON_FIELDS = (
    "model",
    "stream",
    "stream_options",
    "user",
    "priority",
    "cache_salt",
) + STRUCTURED_OUTPUT_FIELDS
COMPLETION_FIELDS = frozenset(
    SAMPLING_FIELDS
    + COMMON_FIELDS
    + ("prompt", "max_tokens", "echo", "logprobs", "best_of", "suffix", "add_special_tokens")
)
# Chat-only fields checked in ``check_chat_extras``: tools (``tools.py``), and fields accepted
# with their neutral value only.
CHAT_EXTRA_FIELDS = (
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "response_format",
    "store",
    "metadata",
    "service_tier",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
)
CHAT_FIELDS = frozenset(
    SAMPLING_FIELDS
    + COMMON_FIELDS
    + CHAT_EXTRA_FIELDS
    + (
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "add_generation_prompt",
        "add_special_tokens",
        "chat_template",
        "chat_template_kwargs",
    )
)
TOKENIZE_FIELDS = frozenset(
    (
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "add_generation_prompt",
        "return_token_strs",
        "chat_template_kwargs",
    )
)
DETOKENIZE_FIELDS = frozenset(("model", "tokens"))


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]  # each a text or a list of token ids
    params: SamplingParams  # max_tokens is None until the prompt length is known
    max_tokens: int | None  # as sent; None: the default below
    default_max_tokens: int | None  # 16 when the field is absent, None (the room left) if null
    stream: bool
    include_usage: bool
    echo: bool
    return_prompt_logprobs: bool  # the client sent prompt_logprobs (echo may imply them too)
    add_special_tokens: bool
    priority: int
    cache_salt: str | None
    structured_outputs_param: str = "structured_outputs"  # the field the constraint came in


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[dict[str, Any], ...]  # normalized for the chat template
    tools: tuple[dict[str, Any], ...] | None
    tool_choice: ToolChoice
    template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    add_special_tokens: bool
    params: SamplingParams
    max_tokens: int | None
    max_tokens_param: str  # "max_completion_tokens" or "max_tokens", for error messages
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # None: logprobs off
    priority: int
    cache_salt: str | None
    structured_outputs_param: str = "structured_outputs"  # the field the constraint came in


@dataclasses.dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None
    messages: tuple[dict[str, Any], ...] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool
    template_kwargs: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class DetokenizeRequest:
    model: str | None
    tokens: tuple[int, ...]


def _model(body: dict[str, Any]) -> str | None:
    return optional(body, "model", str, "a string")


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    """Returns ``include_usage``."""
    options = optional(body, "stream_options", dict, "an object")
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    for key in options:
        if key != "include_usage":
            raise bad_request(
                f"Unrecognized stream_options field: {key}", param=f"stream_options.{key}"
            )
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request("stream_options.include_usage must be a boolean", "stream_options")
    return include


def _sampling_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    optional(body, "user", str, "a string")  # accepted as OpenAI does; it changes nothing
    if body.get("stream") and body.get("prompt_logprobs") is not None:
        raise bad_request("prompt_logprobs is not available with stream", "prompt_logprobs")
    kwargs: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        value = body.get(name)
        if value is not None:
            kwargs[name] = value
    stop = kwargs.get("stop")
    if stop is not None and not isinstance(stop, str | list):
        raise bad_request("stop must be a string or an array of strings", param="stop")
    if "stop_token_ids" in kwargs and not isinstance(kwargs["stop_token_ids"], list):
        raise bad_request("stop_token_ids must be an array of integers", param="stop_token_ids")
    bias = kwargs.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad_request("logit_bias must be an object of token id -> bias", "logit_bias")
        converted = {}
        for key, value in bias.items():
            # NOTE: str.isdigit also accepts "²" and other digits int() refuses.
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_INTEGER_DIGITS):
                shown = repr(key) if len(key) <= 32 else f"{key[:32]!r}... ({len(key)} characters)"
                raise bad_request(f"logit_bias key {shown} is not a token id", param="logit_bias")
            converted[int(key)] = value
        kwargs["logit_bias"] = converted
    kwargs["structured_outputs"], _ = parse_structured_outputs(body)
    return kwargs


def make_params(kwargs: dict[str, Any], renames: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams(**kwargs) with its error turned into a 400 naming the request field, in
    the request's words (``renames``: SamplingParams field -> the request's name for it)."""
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        renames = renames or {}
        message = str(exc)
        if renames:
            names = "|".join(map(re.escape, renames))
            fields = re.compile(rf"\b({names})\b")
            message = fields.sub(lambda m: renames[m.group(1)], message)
        raise bad_request(message, param=renames.get(exc.param, exc.param)) from None


def _priority(body: dict[str, Any]) -> int:
    value = integer(body, "priority")
    if value is not None and not -(2**31) <= value < 2**31:
        raise bad_request(f"priority={value} must fit in 32 bits", param="priority")
    return value or 0


def _cache_salt(body: dict[str, Any]) -> str | None:
    salt = optional(body, "cache_salt", str, "a string")
    if salt is not None and not salt:
        raise bad_request("cache_salt must be a non-empty string", param="cache_salt")
    return salt


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("chat_template") is not None:
        raise bad_request(
            "chat_template cannot be set by a request; the server uses the model's template",
            param="chat_template",
        )
    kwargs = optional(body, "chat_template_kwargs", dict, "an object") or {}
    unknown = sorted(set(kwargs) - ALLOWED_TEMPLATE_KWARGS)
    if unknown:
        raise bad_request(
            f"chat_template_kwargs {unknown} are not allowed; allowed: "
            f"{sorted(ALLOWED_TEMPLATE_KWARGS)}",
            param="chat_template_kwargs",
        )
    for key, value in kwargs.items():
        if not isinstance(value, bool | str | int) or isinstance(value, float):
            raise bad_request(
                f"chat_template_kwargs.{key} must be a boolean, string or integer",
                param="chat_template_kwargs",
            )
    return dict(kwargs)


# -- /v1/completions -------------------------------------------------------------------------


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    check_fields(body, COMPLETION_FIELDS)
    if body.get("suffix") is not None:
        raise unsupported("suffix", "insertion (fill-in-the-middle) is not available")
    prompts = _prompts(body.get("prompt"))
    stream = boolean(body, "stream", False)
    kwargs = _sampling_kwargs(body)
    return_prompt_logprobs = "prompt_logprobs" in kwargs
    logprobs = body.get("logprobs")
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    echo = boolean(body, "echo", False)
    if echo and logprobs is not None and "prompt_logprobs" not in kwargs:
        kwargs["prompt_logprobs"] = logprobs  # echoed prompt tokens carry logprobs too
    best_of = body.get("best_of")
    if best_of is not None:
        kwargs["best_of"] = best_of
    max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    else:
        kwargs["max_tokens"] = None
    params = make_params(kwargs)
    if stream and params.best_of is not None and params.best_of > params.n:
        raise bad_request("best_of > n cannot be used with stream", param="best_of")
    return CompletionRequest(
        model=_model(body),
        prompts=prompts,
        params=params,
        max_tokens=params.max_tokens,
        default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS if "max_tokens" not in body else None,
        stream=stream,
        include_usage=_stream_options(body, stream),
        echo=echo,
        return_prompt_logprobs=return_prompt_logprobs,
        add_special_tokens=boolean(body, "add_special_tokens", True),
        priority=_priority(body),
        cache_salt=_cache_salt(body),
        structured_outputs_param=parse_structured_outputs(body)[1],
    )


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompts(prompt: Any) -> tuple[str | tuple[int, ...], ...]:
    """``prompt`` as OpenAI accepts it: a text, token ids, or a batch of either."""
    if prompt is None:
        raise bad_request("you must provide a prompt", param="prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and _is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    elif isinstance(prompt, list):
        raise bad_request("prompt must not be empty", param="prompt")
    else:
        raise bad_request(
            f"prompt must be a string, an array of token ids, or an array of either; "
            f"got {json_type(prompt)}",
            param="prompt",
        )
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise bad_request(
            f"prompt has {len(prompts)} entries; at most {MAX_BATCH_PROMPTS} are allowed",
            param="prompt",
        )
    result: list[str | tuple[int, ...]] = []
    for i, item in enumerate(prompts):
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt must not be an empty string", param="prompt")
            result.append(item)
        elif isinstance(item, list) and item and _is_token_list(item):
            result.append(tuple(item))
        elif isinstance(item, list) and not item:
            raise bad_request(f"prompt[{i}] is an empty array of token ids", param="prompt")
        else:
            raise bad_request(
                f"prompt[{i}] must be a string or an array of integer token ids",
                param="prompt",
            )
    if len({isinstance(item, str) for item in result}) > 1:
        raise bad_request("a batch of prompts must be all texts or all token ids", "prompt")
    return tuple(result)


# -- /v1/chat/completions --------------------------------------------------------------------


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    check_fields(body, CHAT_FIELDS)
    messages = parse_messages(body.get("messages"))
    template_kwargs = _template_kwargs(body)
    tools, tool_choice = check_chat_extras(body)
    stream = boolean(body, "stream", False)
    kwargs = _sampling_kwargs(body)
    renames = {}
    logprobs = boolean(body, "logprobs", False)
    top_logprobs = integer(body, "top_logprobs")
    if top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if logprobs:
        kwargs["logprobs"] = top_logprobs or 0
        renames["logprobs"] = "top_logprobs"
    max_tokens_param = "max_completion_tokens"
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens_param = "max_tokens"
        max_tokens = body.get("max_tokens")
    renames["max_tokens"] = max_tokens_param
    kwargs["max_tokens"] = max_tokens
    params = make_params(kwargs, renames)
    return ChatRequest(
        model=_model(body),
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        template_kwargs=template_kwargs,
        add_generation_prompt=boolean(body, "add_generation_prompt", True),
        add_special_tokens=boolean(body, "add_special_tokens", False),
        params=params,
        max_tokens=params.max_tokens,
        max_tokens_param=max_tokens_param,
        stream=stream,
        include_usage=_stream_options(body, stream),
        top_logprobs=params.logprobs,
        priority=_priority(body),
        cache_salt=_cache_salt(body),
        structured_outputs_param=parse_structured_outputs(body)[1],
    )


# -- /tokenize and /detokenize ---------------------------------------------------------------


def parse_tokenize_request(body: dict[str, Any]) -> TokenizeRequest:
    check_fields(body, TOKENIZE_FIELDS)
    prompt = optional(body, "prompt", str, "a string")
    has_messages = body.get("messages") is not None
    if (prompt is not None) == has_messages:
        raise bad_request("provide exactly one of prompt or messages", param="prompt")
    messages = parse_messages(body["messages"]) if has_messages else None
    return TokenizeRequest(
        model=_model(body),
        prompt=prompt,
        messages=messages,
        add_special_tokens=boolean(body, "add_special_tokens", not has_messages),
        add_generation_prompt=boolean(body, "add_generation_prompt", True),
        return_token_strs=boolean(body, "return_token_strs", False),
        template_kwargs=_template_kwargs(body),
    )


def parse_detokenize_request(body: dict[str, Any]) -> DetokenizeRequest:
    check_fields(body, DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not _is_token_list(tokens):
        raise bad_request("tokens must be an array of integer token ids", param="tokens")
    return DetokenizeRequest(model=_model(body), tokens=tuple(tokens))


def check_token_ids(token_ids: tuple[int, ...] | list[int], vocab_size: int, param: str) -> None:
    """The engine's token-range check as a 400."""
    try:
        request_checks.check_token_ids(token_ids, vocab_size, param)
    except request_checks.RequestError as exc:
        raise APIError(400, str(exc), param=param) from None
