"""``jaxserve run-batch``: OpenAI batch files offline, one output line per input line, in order,
whatever each line's outcome, and a stopped run resumed where its output ends."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.server.launch.run_batch import (
    BATCH_URLS,
    ResumeError,
    lines_done,
    parse_line,
    run_batch_lines,
)
from tests.conftest import SMALL_ENGINE, fixture_dir, tiny_engine_config

MODEL = "batch-model"
GREEDY = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}


def line(custom_id: str, url: str = "/v1/completions", **body) -> str:
    body = {"model": MODEL, **GREEDY, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def chat_line(custom_id: str, **body) -> str:
    messages = [{"role": "user", "content": "Hi"}]
    return line(custom_id, "/v1/chat/completions", messages=messages, **body)


BATCH = [
    line("c-1", prompt="Hello there"),
    chat_line("chat-1"),
    "{not json",
    json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}),
    line("emb", url="/v1/embeddings", input="x"),
    line("streamed", prompt="Hi", stream=True),
    line("too-long", prompt="Hi", max_tokens=10_000),  # a request the server refuses: 400
    line("c-2", prompt=[1, 2, 3]),
]


# -- lines ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "custom_id", "code"),
    [
        ("{not json", None, "invalid_json"),
        ("[1, 2]", None, "invalid_request"),
        (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), None,
         "missing_custom_id"),
        (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}),
         "a", "invalid_method"),
        (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/models", "body": {}}), "a",
         "invalid_url"),
        (json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": []}),
         "a", "invalid_body"),
        (line("a", stream=True), "a", "invalid_body"),
    ],
)  # fmt: skip
def test_a_line_that_is_not_a_request_names_why(text, custom_id, code) -> None:
    request = parse_line(text)
    assert request.custom_id == custom_id
    assert request.error is not None and request.error["code"] == code
    assert request.error["message"]


def test_a_request_line_keeps_its_url_and_body() -> None:
    request = parse_line(chat_line("x"))
    assert request.error is None and request.url == "/v1/chat/completions"
    assert request.body["messages"] == [{"role": "user", "content": "Hi"}]
    assert set(BATCH_URLS) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/score",
        "/v1/classify",
        "/v1/rerank",
    }


# -- resuming ------------------------------------------------------------------------------


def answered(custom_id: str | None) -> str:
    return json.dumps({"id": "batch_req_x", "custom_id": custom_id, "response": None})


def test_resume_starts_after_the_lines_the_output_answers(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    assert lines_done(BATCH, out) == 0  # no output yet
    out.write_text(answered("c-1") + "\n" + answered("chat-1") + "\n" + answered(None) + "\n")
    assert lines_done(BATCH, out) == 3


def test_a_line_cut_short_by_a_stop_is_dropped_and_answered_again(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text(answered("c-1") + "\n" + answered("chat-1")[:20])
    assert lines_done(BATCH, out) == 1
    assert out.read_text() == answered("c-1") + "\n"


def test_an_output_of_another_input_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text(answered("c-1") + "\n" + answered("other") + "\n")
    with pytest.raises(ResumeError, match="line 2 .* does not answer line 2"):
        lines_done(BATCH, out)
    out.write_text((answered("c-1") + "\n") * 2)
    with pytest.raises(ResumeError, match="more than the input's 1"):
        lines_done(BATCH[:1], out)


# -- through the engine --------------------------------------------------------------------


@pytest.fixture(scope="module")
def app():
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.app import build_app
    from jaxserve.server.settings import ServerSettings

    engine = AsyncEngine.from_config(tiny_engine_config(MODEL, **SMALL_ENGINE))
    engine.start()
    yield build_app(engine, ServerSettings(served_model_names=(MODEL,)))
    engine.shutdown()


def run(app, lines: list[str], window: int = 4) -> tuple[list[dict], object]:
    out = io.StringIO()
    summary = asyncio.run(run_batch_lines(app, lines, out, window))
    return [json.loads(text) for text in out.getvalue().splitlines()], summary


def test_every_line_is_answered_in_order_whatever_its_outcome(app) -> None:
    results, summary = run(app, BATCH)
    assert [r["custom_id"] for r in results] == [
        "c-1", "chat-1", None, "get", "emb", "streamed", "too-long", "c-2"
    ]  # fmt: skip
    assert len({r["id"] for r in results}) == len(BATCH)
    assert all(r["id"].startswith("batch_req_") for r in results)
    by_id = {r["custom_id"]: r for r in results}
    completion = by_id["c-1"]["response"]
    assert completion["status_code"] == 200 and by_id["c-1"]["error"] is None
    assert completion["body"]["object"] == "text_completion"
    assert completion["request_id"] == completion["body"]["id"]
    assert completion["body"]["usage"]["completion_tokens"] == 4
    chat = by_id["chat-1"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"]
    assert by_id["c-2"]["response"]["body"]["usage"]["prompt_tokens"] == 3
    for custom_id, code in [("get", "invalid_method"), ("streamed", "invalid_body")]:
        assert by_id[custom_id]["response"] is None
        assert by_id[custom_id]["error"]["code"] == code
    assert results[2]["error"]["code"] == "invalid_json"
    # An embeddings line against a generation model: the server's 400 naming the flag.
    embedding = by_id["emb"]["response"]
    assert embedding["status_code"] == 400 and by_id["emb"]["error"] is None
    assert "--runner pooling" in embedding["body"]["error"]["message"]
    refused = by_id["too-long"]["response"]
    assert refused["status_code"] == 400 and by_id["too-long"]["error"] is None
    assert "max_tokens" in json.dumps(refused["body"]["error"])
    assert (summary.num_ok, summary.num_failed) == (3, 5)


def test_a_window_of_one_gives_the_same_answers(app) -> None:
    """Greedy answers do not depend on what else runs beside them."""
    good = [BATCH[0], BATCH[1], BATCH[7]]
    one, _ = run(app, good, window=1)
    many, _ = run(app, good, window=8)
    bodies = [[r["response"]["body"]["choices"] for r in results] for results in (one, many)]
    assert bodies[0] == bodies[1]


def test_the_command_runs_a_file_and_resumes_it(tmp_path: Path) -> None:
    """The whole command in a process of its own: a stopped run (two lines answered, the third
    cut short) is finished, and a finished one is left as it is without loading the model."""
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(BATCH[:2] + BATCH[3:4] + BATCH[7:]) + "\n\n")
    out = tmp_path / "results" / "out.jsonl"
    out.parent.mkdir()
    out.write_text(answered("c-1") + "\n" + answered("chat-1") + "\n" + '{"id": "batch_req_')
    command = [
        sys.executable, "-m", "jaxserve", "run-batch", "-i", str(batch), "-o", str(out),
        str(fixture_dir("llama")), "--served-model-name", MODEL, "--dtype", "float32",
        "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
        "--block-size", "4", "--num-gpu-blocks-override", "64",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(text) for text in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["c-1", "chat-1", "get", "c-2"]
    assert results[2]["error"]["code"] == "invalid_method"
    assert results[3]["response"]["status_code"] == 200
    assert "4 lines: 1 answered with status 200, 1 failed, 2 were already answered" in done.stderr
    again = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "already answers the 4 lines" in again.stderr
    assert "Loading" not in again.stderr
    wrong = subprocess.run(
        [*command[:5], str(tmp_path / "missing.jsonl"), *command[6:]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrong.returncode == 2 and "missing.jsonl" in wrong.stderr
