"""The checks a request must pass against the model before it may run, in one place.

Used by the engine (``EngineCore.add_request``, so ``LLM`` users get them too) and by the
server before it submits (``ServingContext.check_request``, which turns a ``RequestError`` into
a 400 in OpenAI's words). Field-level limits that need no model live in ``SamplingParams``.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.sampling_params import SamplingParams, SamplingParamsError

# What an engine answers a request of the other kind (``--runner``): the server's 400s too.
GENERATION_REFUSED = (
    "this model is served for pooling (--runner pooling): it answers /v1/embeddings; "
    "completions and chat need the server started with --runner generate"
)
POOLING_REFUSED = (
    "this model is served for generation: /v1/embeddings needs the server started with "
    "--runner pooling (an embedding model)"
)


class RequestError(ValueError):
    """A request the engine cannot take; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise RequestError(f"token id {t} is out of vocabulary (size {vocab_size})", param)


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    default_max_tokens: int | None = None,
    noun: str = "prompt",
    max_tokens_param: str = "max_tokens",
) -> SamplingParams:
    """Check a tokenized request against the model; returns its params with ``max_tokens``
    filled in and ``top_k`` clamped to the vocabulary.

    Without ``params.max_tokens`` the budget is ``default_max_tokens`` clamped to the room the
    context leaves, or all of that room (and ``min_tokens`` at most the room). ``noun`` names
    the prompt in messages ("prompt" or "messages"), ``max_tokens_param`` the budget's field.
    """
    if not prompt_token_ids:
        raise RequestError(f"the {noun} is empty", param=noun)
    check_token_ids(prompt_token_ids, vocab_size, noun)
    spec = params.structured_outputs
    if spec is not None:  # ids that reach the token masks
        check_token_ids(spec.reasoning_start, vocab_size, "structured_outputs.reasoning_start")
        check_token_ids(spec.reasoning_end, vocab_size, "structured_outputs.reasoning_end")
    num_prompt = len(prompt_token_ids)
    if num_prompt >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{noun} resulted in {num_prompt} tokens. Please reduce the length of the {noun}.",
            param=noun,
            code="context_length_exceeded",
        )
    room = max_model_len - num_prompt
    max_tokens, min_tokens = params.max_tokens, params.min_tokens
    if max_tokens is None:
        if default_max_tokens is None:
            max_tokens, min_tokens = room, min(min_tokens, room)
        else:
            max_tokens = min(default_max_tokens, room)
    elif max_tokens > room:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the {noun}, "
            f"{max_tokens} in the completion). Please reduce the length of the {noun} or "
            "completion.",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    try:
        params = params.replace(max_tokens=max_tokens, min_tokens=min_tokens)
        return params.for_vocab(vocab_size)
    except SamplingParamsError as exc:  # e.g. min_tokens above the budget left
        raise RequestError(str(exc), param=exc.param) from None


def check_pooling_request(
    prompt_token_ids: Sequence[int], *, vocab_size: int, max_model_len: int, noun: str = "input"
) -> None:
    """Check a pooling request's tokenized prompt against the model: not empty, in the
    vocabulary, and at most ``max_model_len`` tokens (it generates nothing, so the whole
    context is its own)."""
    if not prompt_token_ids:
        raise RequestError(f"the {noun} is empty", param=noun)
    check_token_ids(prompt_token_ids, vocab_size, noun)
    if len(prompt_token_ids) > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{noun} resulted in {len(prompt_token_ids)} tokens. Please reduce the length of "
            f"the {noun}.",
            param=noun,
            code="context_length_exceeded",
        )
