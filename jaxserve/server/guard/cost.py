"""Per-request cost limits: how many sequences one request may start, how many tokens it may ask
for, and how large a response it may ask for. Each is a 400 that names the limit, the value and
the flag, with ``param`` set, before anything reaches the engine.

Called by ``api/completions.py`` and ``chat/completions.py``: the sequence count as soon as the body
is parsed (before any prompt is tokenized), the token count and the response size once every
prompt's ``max_tokens`` is resolved. The defaults (``settings.py``) are sized so a normal client
never meets them, while one request can no longer hold the engine or flood the network:

- ``--max-seqs-per-request`` (256): vLLM's default ``max_num_seqs``, one full batch. 256
  prompts with ``n=128`` (32,768 sequences from one 10 KB body) stop here.
- ``--max-tokens-per-request`` (1,048,576): 256 sequences of 4,096 tokens, or 8 whole 128K
  contexts. A client that needs more loses nothing by splitting the request, as the engine
  batches sequences of different requests together.
- ``--max-response-entries`` (1,048,576): about 25 MB of completions JSON (a top logprob is
  ~24 bytes) or 60 MB of chat JSON. Enough to score a 32K-token prompt with 20 logprobs per
  token, or 8 prompts of 32K with one; ``echo`` with ``logprobs=20`` and ``n=128`` on a
  1,000-token prompt (2.7 million entries, 65 MB from a 5 KB request) stops here.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.sampling_params import SamplingParams
from jaxserve.server.api.errors import bad_request
from jaxserve.server.generation import EngineRequest
from jaxserve.server.settings import ServerSettings


def check_num_seqs(num_prompts: int, params: SamplingParams, settings: ServerSettings) -> None:
    """Prompts x ``n`` (x ``best_of`` when larger) against ``--max-seqs-per-request``."""
    limit = settings.max_seqs_per_request
    num_seqs = num_prompts * params.num_samples
    if num_seqs <= limit:
        return
    if params.best_of is not None and params.best_of > params.n:
        param, detail = "best_of", f"best_of={params.best_of}"
    else:
        param, detail = ("n", f"n={params.n}") if params.n > 1 else ("prompt", "n=1")
    raise bad_request(
        f"This request asks for {num_seqs} sequences ({num_prompts} prompt(s) x {detail}); "
        f"at most {limit} are allowed per request (--max-seqs-per-request). Lower n or send "
        "fewer prompts per request.",
        param=param,
    )


def check_num_tokens(
    requests: Sequence[EngineRequest], settings: ServerSettings, max_tokens_param: str
) -> None:
    """``n`` (or ``best_of``) x ``max_tokens`` summed over the prompts, against
    ``--max-tokens-per-request``; ``max_tokens`` is each prompt's resolved budget."""
    limit = settings.max_tokens_per_request
    num_tokens = sum(r.params.num_samples * (r.params.max_tokens or 0) for r in requests)
    if num_tokens <= limit:
        return
    raise bad_request(
        f"This request asks for up to {num_tokens} tokens (n x {max_tokens_param}, summed over "
        f"{len(requests)} prompt(s)); at most {limit} are allowed per request "
        f"(--max-tokens-per-request). Lower {max_tokens_param} or n, or split the request.",
        param=max_tokens_param,
    )


def num_response_entries(
    request: EngineRequest, echo: bool, num_prompt_logprobs_copies: int
) -> int:
    """Tokens and logprobs the response for one prompt may hold, at most.

    Every token of text (generated, or the prompt when ``echo`` is set) counts 1, plus 1 for
    each top logprob sent with it; prompt logprobs count ``1 + prompt_logprobs`` per prompt
    token, once per copy the response carries (per choice in completions, once in chat).
    """
    params = request.params
    num_prompt = len(request.prompt_token_ids)
    num_tokens = (params.max_tokens or 0) + (num_prompt if echo else 0)
    entries = params.n * num_tokens * (1 + (params.logprobs or 0))
    if params.prompt_logprobs is not None:
        entries += num_prompt_logprobs_copies * num_prompt * (1 + params.prompt_logprobs)
    return entries


def check_response_size(
    num_entries: int, settings: ServerSettings, param: str, levers: str
) -> None:
    """The response's estimated entries against ``--max-response-entries``; ``param`` is the
    field that made it large and ``levers`` says what the client can lower."""
    limit = settings.max_response_entries
    if num_entries <= limit:
        return
    raise bad_request(
        f"The response to this request could hold {num_entries} tokens and logprobs (each "
        "token counts 1, plus 1 per top logprob); at most "
        f"{limit} are allowed per response (--max-response-entries). Lower {levers}.",
        param=param,
    )
