"""``jaxserve run-batch``: an OpenAI batch file through the engine, offline, as ``vllm
run-batch`` runs one.

Input: JSON lines of OpenAI's batch format, ``{"custom_id": ..., "method": "POST", "url":
"/v1/chat/completions", "body": {...}}``. Each request goes through the same app as ``jaxserve
serve`` (``build_app``, called in this process over ASGI, no socket), so a batch line is
checked and answered exactly as the HTTP request would be; up to ``window`` requests are in
flight at once, so the engine batches them.

Output: one line per input line, whatever its outcome, in the input's order: ``{"id":
"batch_req_...", "custom_id": ..., "response": {"status_code": ..., "request_id": ..., "body":
...}, "error": null}``; a line that is not a request (bad JSON, a missing field, a URL the
batch does not serve, ``stream``) gets ``"response": null`` and an ``error`` with a code and a
message naming the field. Lines are written as they finish (each flushed), so the output is
always a prefix of the results: a run that stops (Ctrl-C, a crash) resumes where the output
file ends when it is run again with the same files.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import IO, Any

import httpx
from starlette.applications import Starlette

_LOG = logging.getLogger("jaxserve.run_batch")

# The endpoints a batch line may name (OpenAI's batch format, with vLLM's score, rerank and
# classify). Embeddings, scores, reranking and classification need a pooling model (--runner
# pooling; scores a cross-encoder or a reranker, classification a sequence classifier):
# against another model their lines get the server's 400.
BATCH_URLS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/v1/classify",
)


class ResumeError(ValueError):
    """The output file does not continue this input file."""


@dataclasses.dataclass
class BatchRequest:
    """One input line: the request it holds, or why it holds none (``error``)."""

    custom_id: str | None
    url: str = ""
    body: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: dict[str, str] | None = None  # {"code": ..., "message": ...}


def parse_line(text: str) -> BatchRequest:
    """A batch line, checked as OpenAI checks a batch file's lines."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError as exc:
        return BatchRequest(None, error=_error("invalid_json", f"not JSON: {exc}"))
    if not isinstance(line, dict):
        return BatchRequest(None, error=_error("invalid_request", "a line must be a JSON object"))
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchRequest(None, error=_error("missing_custom_id", "custom_id must be a string"))
    if line.get("method") != "POST":
        return BatchRequest(custom_id, error=_error("invalid_method", "method must be POST"))
    url, body = line.get("url"), line.get("body")
    if url not in BATCH_URLS:
        message = f"url={url!r} is not served in a batch; use one of {', '.join(BATCH_URLS)}"
        return BatchRequest(custom_id, error=_error("invalid_url", message))
    if not isinstance(body, dict):
        return BatchRequest(custom_id, error=_error("invalid_body", "body must be a JSON object"))
    if body.get("stream"):
        message = "body.stream: a batch request is answered whole; leave stream unset"
        return BatchRequest(custom_id, error=_error("invalid_body", message))
    return BatchRequest(custom_id, url, body)


def _error(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


def output_line(
    request: BatchRequest, status: int | None = None, body: Any = None, request_id: str = ""
) -> dict[str, Any]:
    """The output line of ``request``: its response, or its error when it was not sent."""
    response = None
    if request.error is None:
        response = {"status_code": status, "request_id": request_id, "body": body}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": request.custom_id,
        "response": response,
        "error": request.error,
    }


def lines_done(input_lines: list[str], output_path: Path) -> int:
    """How many input lines the output file already answers (a trailing line cut short by a
    stop is dropped from the file); ``ResumeError`` if its lines are not this input's."""
    if not output_path.exists():
        return 0
    text = output_path.read_text()
    complete = text[: text.rfind("\n") + 1]
    if len(complete) != len(text):
        output_path.write_text(complete)
    done = complete.splitlines()
    if len(done) > len(input_lines):
        raise ResumeError(
            f"{output_path} has {len(done):,} lines, more than the input's {len(input_lines):,}"
        )
    for number, (answer, line) in enumerate(zip(done, input_lines, strict=False), 1):
        expected = parse_line(line).custom_id
        try:
            custom_id = json.loads(answer).get("custom_id")
        except (json.JSONDecodeError, AttributeError):
            custom_id = object()
        if custom_id != expected:
            raise ResumeError(
                f"line {number} of {output_path} does not answer line {number} of the input "
                f"(custom_id {expected!r}): give another --output-file"
            )
    return len(done)


@dataclasses.dataclass
class BatchSummary:
    num_ok: int = 0  # status 200
    num_failed: int = 0  # an error status, or a line that is not a request


async def run_batch_lines(
    app: Starlette,
    lines: list[str],
    out: IO[str],
    window: int,
    on_line: Any = None,
) -> BatchSummary:
    """Send ``lines`` through ``app``, ``window`` at a time, and write an output line for
    each to ``out`` in order; ``on_line()`` after each line written (a progress bar)."""
    summary = BatchSummary()
    async with _client(app) as client:
        slots = asyncio.Semaphore(window)

        async def answer(text: str) -> dict[str, Any]:
            request = parse_line(text)
            if request.error is not None:
                return output_line(request)
            async with slots:
                response = await client.post(request.url, json=request.body)
            body = response.json()
            request_id = body.get("id", "") if isinstance(body, dict) else ""
            return output_line(request, response.status_code, body, request_id)

        tasks = [asyncio.ensure_future(answer(text)) for text in lines]
        try:
            for task in tasks:  # in the input's order, each as soon as it and those before are
                line = await task
                ok = line["response"] is not None and line["response"]["status_code"] == 200
                summary.num_ok += ok
                summary.num_failed += not ok
                out.write(json.dumps(line) + "\n")
                out.flush()
                if on_line is not None:
                    on_line()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return summary


@contextlib.asynccontextmanager
async def _client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``app`` in this process, the app's lifespan (its engine watchdog) around it."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://batch", timeout=None
        ) as client:
            yield client


def read_lines(path: Path) -> list[str]:
    """The input's request lines (blank lines are not requests)."""
    with path.open() as f:
        return [line for line in f.read().splitlines() if line.strip()]


@contextlib.contextmanager
def opened_for_append(path: Path) -> Iterator[IO[str]]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        yield f


def add_run_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """``-i`` and ``-o``, then every engine flag of ``jaxserve serve`` (the HTTP ones unused)."""
    from jaxserve.server.launch.flags import add_launch_arguments

    parser.add_argument(
        "-i",
        "--input-file",
        required=True,
        type=Path,
        help="the batch: JSON lines, OpenAI's format",
    )
    parser.add_argument(
        "-o",
        "--output-file",
        required=True,
        type=Path,
        help="the results, a line per input line; an existing file is resumed where it ends",
    )
    add_launch_arguments(parser)


def run_batch(args: argparse.Namespace) -> int:
    """Run the batch file; 0 once every line has an output line (failed requests included),
    2 for flags or files that cannot run, 1 when the model cannot be served."""
    import logging

    from tqdm import tqdm

    from jaxserve.runner.capacity import reserve_device_memory
    from jaxserve.runner.devices import quiet_backend_probe
    from jaxserve.server.app import build_app
    from jaxserve.server.launch import serve
    from jaxserve.server.launch.flags import engine_config_from_args, flag_terms, settings_from_args

    logging.basicConfig(
        level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    quiet_backend_probe()  # before JAX's backend starts
    try:
        lines = read_lines(args.input_file)
        done = lines_done(lines, args.output_file)
        config = engine_config_from_args(args)
        settings = settings_from_args(args, config.model_name)
    except OSError as exc:
        _LOG.error("Cannot run the batch: %s", exc)
        return 2
    except ValueError as exc:  # ResumeError, or a flag
        _LOG.error("%s", flag_terms(exc))
        return 2
    if done == len(lines):
        _LOG.info("%s already answers the %d lines of %s", args.output_file, done, args.input_file)
        return 0
    reserve_device_memory(config.gpu_memory_utilization)
    try:
        engine = serve.build_engine(args, config, config.model_dir)
    except serve.StartFailed as exc:
        return exc.status
    app = build_app(engine, settings)
    engine.start()
    try:
        with (
            opened_for_append(args.output_file) as out,
            tqdm(total=len(lines), initial=done, unit="req", desc="run-batch") as bar,
        ):
            # requests in flight: enough to fill every step
            window = 2 * engine.config.resolved_max_num_seqs
            summary = asyncio.run(run_batch_lines(app, lines[done:], out, window, bar.update))
    finally:
        engine.shutdown()
    _LOG.info(
        "%d lines: %d answered with status 200, %d failed, %d were already answered; see %s",
        len(lines),
        summary.num_ok,
        summary.num_failed,
        done,
        args.output_file,
    )
    return 0
