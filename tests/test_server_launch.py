"""``jaxserve launch``: flag parsing, and real processes stopped by signals.

The subprocess tests run ``jaxserve launch`` on the tiny Llama fixture. SIGTERM checks
RELIABILITY.md's shutdown scenario: readiness and new requests answer 503 with Retry-After, a
request that can finish within ``--shutdown-timeout`` finishes, the rest end with
``finish_reason="abort"``, and the process exits 0. Ctrl-C (SIGINT) while starting ends the
start (its weight load too) with status 130; a second Ctrl-C while draining aborts the requests
in flight (no 500, no traceback) and exits 130.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from jaxserve.cli import build_parser, main
from jaxserve.server.launch.flags import engine_config_from_args, settings_from_args
from jaxserve.units import human_int
from tests.conftest import (
    free_port,
    metric,
    paced_launch_command,
    start_server,
    wait_for,
)

FIXTURE = Path(__file__).parent / "fixtures" / "models" / "llama"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8192", 8192),
        ("8k", 8000),
        ("8K", 8192),
        ("1.5k", 1500),
        ("2M", 2 * 1024**2),
        ("1m", 10**6),
    ],
)
def test_human_int(text, value):
    assert human_int(text) == value


@pytest.mark.parametrize("text", ["", "k", "1.5K", "1.0001k", "-1", "8 k", "1e3"])
def test_human_int_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_int(text)


def parse_launch(*flags: str) -> argparse.Namespace:
    argv = ["launch", *flags]
    return build_parser(argv).parse_args(argv)


def test_launch_flags_map_to_configs(monkeypatch):
    monkeypatch.setenv("JAXSERVE_API_KEY", "from-env")
    args = parse_launch(
        str(FIXTURE), "--max-model-len", "1k", "--memory-utilization", "0.5", "-tp", "2",
        "--no-enable-prefix-caching", "--served-model-name", "a", "b", "--log-prompts",
        "--max-request-body-bytes", "1M", "--dtype", "float32", "--load-format", "dummy",
    )  # fmt: skip
    config = engine_config_from_args(args)
    assert config.max_model_len == 1000 and config.gpu_memory_utilization == 0.5
    assert config.tensor_parallel_size == 2 and not config.enable_prefix_caching
    assert config.served_model_name == "a" and config.load_format == "dummy"
    assert not config.enable_expert_parallel
    assert config.serve_while_compiling  # launch's default; LLM() compiles everything first
    all_first = engine_config_from_args(parse_launch("--no-serve-while-compiling"))
    assert not all_first.serve_while_compiling
    expert = engine_config_from_args(parse_launch("-tp", "4", "--enable-expert-parallel"))
    assert expert.enable_expert_parallel and expert.tensor_parallel_size == 4
    settings = settings_from_args(args, config.model_name)
    assert settings.served_model_names == ("a", "b") and settings.api_key == "from-env"
    assert settings.log_prompts and settings.enable_log_requests  # --log-prompts implies it
    assert settings.max_request_body_bytes == 1024**2
    flag_key = settings_from_args(parse_launch("--api-key", "flag"), "m")
    assert flag_key.api_key == "flag" and flag_key.model_name == "m"
    demo = engine_config_from_args(parse_launch())
    assert demo.model == "" and demo.model_name == "jaxserve-demo"


def test_the_compilation_cache_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXSERVE_COMPILATION_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = engine_config_from_args(parse_launch())
    assert config.cache_dir == str(tmp_path / "jaxserve" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert config.cache_dir == str(Path.home() / ".cache" / "jaxserve" / "xla")
    monkeypatch.setenv("JAXSERVE_COMPILATION_CACHE", str(tmp_path / "own"))
    assert config.cache_dir == str(tmp_path / "own")
    flagged = engine_config_from_args(parse_launch("--compilation-cache-dir", "x"))
    assert flagged.cache_dir == "x"


def test_launch_help_documents_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (
        ("--port", "8000"),
        ("--gpu-memory-utilization", "0.9"),
        ("--max-num-seqs", "256"),
        ("--max-num-batched-tokens", "2048"),
        ("--block-size", "16"),
        ("--shutdown-timeout", "30.0"),
        ("--max-request-body-bytes", "2097152"),
        ("--enable-prefix-caching", "True"),
        ("--load-format", "auto"),
    ):
        assert flag in text and f"(default: {default})" in text, flag
    for flag in ("--api-key", "--ssl-keyfile", "--ssl-certfile", "--compilation-cache-dir",
                 "--metrics-require-key", "--enable-log-requests", "--log-prompts",
                 "--max-queued-requests", "--served-model-name", "--seed", "--dtype"):  # fmt: skip
        assert flag in text, flag


TINY_FLAGS = ("--host", "127.0.0.1", "--served-model-name", "tiny", "--dtype", "float32",
              "--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
              "--num-gpu-blocks-override", "64")  # fmt: skip


def test_a_flag_that_takes_no_value_states_no_default(capsys):
    """``--disable-tqdm`` and ``--no-server-metrics`` said "(default: True)", the default of
    what they turn off."""
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--disable-tqdm no progress bars --no-server-metrics" in text
    assert "queue length --" in text or text.rstrip().endswith("queue length")
    assert "(default: False)" not in text and "(default: True)" not in text


def stream_completion(url: str, body: dict, first_chunk: threading.Event, out: dict) -> None:
    """Read one SSE completion stream; record finish reasons, usage and [DONE] (or the error)."""
    out["finish"], out["done"] = {}, False
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            out["status"] = response.status_code
            if response.status_code != 200:
                out["error"] = response.read()
                first_chunk.set()
                return
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                first_chunk.set()
                if line == "data: [DONE]":
                    out["done"] = True
                    continue
                event = json.loads(line[len("data: ") :])
                for choice in event.get("choices", []):
                    if choice["finish_reason"]:
                        out["finish"][choice["index"]] = choice["finish_reason"]
                if event.get("usage"):
                    out["usage"] = event["usage"]
    except Exception as exc:  # reported by the test, not lost in the thread
        out["error"] = exc
        first_chunk.set()


def test_sigterm_drains_then_exits_zero(tmp_path):
    """A request that fits in the drain finishes; one that does not ends with "abort".

    NOTE: every step takes at least 50 ms (paced), so who finishes within the 3 s drain is a
    matter of step counts, not of the machine's speed: the short request needs 4 steps (it
    fits unless a step takes 0.75 s), the long one 240 (12 s at least). Before, with 5 ms steps,
    a 0.5 s drain and 8 tokens, a busy machine's slower steps aborted the short request too,
    and /health was read 50 ms after the signal, before the server had handled it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    launch, env = paced_launch_command(0.05)
    command = [
        *launch, str(FIXTURE), *TINY_FLAGS, "--port", str(port),
        "--shutdown-timeout", "3", "--compilation-cache-dir", str(tmp_path / "xla"),
    ]  # fmt: skip
    process = start_server(command, env, log_path, url, timeout_s=300)
    try:
        startup_log = log_path.read_text()
        assert "Devices: 1 x cpu" in startup_log and "Attention: " in startup_log
        assert re.search(r"Started the cpu backend \(1 x cpu\) in \d+\.\d s\n", startup_log)
        assert "Unable to initialize backend" not in startup_log  # JAX's probe: debug only
        assert "KV cache size: 1,024 tokens" in startup_log
        assert "Maximum concurrency for 256 tokens per request: 4.00x" in startup_log
        # The SIGTERM below may land while these compile: the exit still waits for them, clean.
        assert "Serving steps of up to 16 tokens; the buckets of 32, 64 tokens" in startup_log

        base = {"model": "tiny", "prompt": "quokka secret", "stream": True, "ignore_eos": True,
                "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
        long_started, short_started = threading.Event(), threading.Event()
        long_out: dict = {}
        short_out: dict = {}
        long = threading.Thread(
            target=stream_completion,
            args=(url, {**base, "max_tokens": 240, "n": 4}, long_started, long_out),
        )
        short = threading.Thread(
            target=stream_completion,
            args=(url, {**base, "max_tokens": 4}, short_started, short_out),
        )
        long.start()
        assert long_started.wait(30) and "error" not in long_out, long_out
        short.start()
        assert short_started.wait(30) and "error" not in short_out, short_out
        process.send_signal(signal.SIGTERM)
        wait_for(lambda: "Received SIGTERM: draining" in log_path.read_text(), 30, "the drain")

        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.headers["retry-after"]
        refused = httpx.post(f"{url}/v1/completions", json={**base, "stream": False}, timeout=5)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["code"] == "service_unavailable"

        short.join(60)
        long.join(60)
        assert short_out["status"] == 200 and short_out["done"]
        assert short_out["finish"] == {0: "length"}
        assert short_out["usage"]["completion_tokens"] == 4
        assert long_out["status"] == 200 and long_out["done"]
        assert long_out["finish"] == {i: "abort" for i in range(4)}
        assert long_out["usage"]["completion_tokens"] < 4 * 240
        assert process.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    shutdown_log = log_path.read_text()
    assert "Shutdown timeout reached: aborting 1 requests" in shutdown_log
    assert "quokka" not in shutdown_log  # no prompt text in the logs by default
    assert "Traceback" not in shutdown_log


@pytest.mark.parametrize("command", ["launch", "capacity"])
def test_every_flag_has_help_that_states_its_default_once(command):
    parser = build_parser([command])
    (subcommands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub = subcommands.choices[command]
    assert all(action.help for action in sub._actions), [
        action.option_strings for action in sub._actions if not action.help
    ]
    entries = re.split(r"\n  (?=-)", sub.format_help())
    for entry in entries[1:]:
        assert entry.count("default:") <= 1, entry


# ``jaxserve launch`` whose weights "load" until the start-up tells the load to stop: a Ctrl-C
# lands while the process starts, whatever the machine's speed, and the load's end is logged.
# Python's Ctrl-C handler is put back first: a suite run as a background job (``cmd &``)
# starts its processes with SIGINT ignored, and a Ctrl-C would then never arrive.
HELD_LOAD_LAUNCH = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from jaxserve.cli import main
from jaxserve.models.loading.load_progress import LoadCancelled
from jaxserve.runner import model_weights
def held_load(*args):
    stop = args[-1]
    print("weights: loading until told to stop", flush=True)
    stop.wait()
    print("weights: told to stop", flush=True)
    raise LoadCancelled
model_weights.model_weights = held_load
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_starting_stops_the_load_and_exits_130(tmp_path):
    """Guards the start that went on after Ctrl-C (a traceback, then the interpreter's exit
    waiting for the weights' thread): the load is told to stop, one line, status 130."""
    log_path = tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "JAXSERVE_API_KEY"}
    command = [sys.executable, "-c", HELD_LOAD_LAUNCH, "launch", str(FIXTURE), *TINY_FLAGS,
               "--port", str(free_port())]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: "loading until told" in log_path.read_text(), 120, "the load to start")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    log = log_path.read_text()
    # (the load's thread prints beside the main thread: cancel does not wait for it)
    assert "weights: told to stop" in log and "Interrupted" in log, log
    assert "Traceback" not in log and "Uvicorn running" not in log, log


def test_second_ctrl_c_aborts_requests_in_flight_and_exits_130(tmp_path):
    """Guards the second Ctrl-C that waited 5 s, then cancelled the responses' tasks: a
    traceback per request, a 500 for the non-streaming one, and exit status 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    # Steps of at least 50 ms: 200 tokens outlast the two signals on any device.
    launch, env = paced_launch_command(0.05)
    command = [*launch, str(FIXTURE), *TINY_FLAGS, "--port", str(port), "--shutdown-timeout", "600"]
    process = start_server(command, env, log_path, url, timeout_s=120)
    try:
        body = {"model": "tiny", "prompt": "quokka secret", "max_tokens": 200, "ignore_eos": True}
        started, streamed = threading.Event(), {}
        stream = threading.Thread(
            target=stream_completion, args=(url, {**body, "stream": True}, started, streamed)
        )
        whole: dict = {}

        def complete() -> None:
            whole["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

        plain = threading.Thread(target=complete)
        stream.start()
        plain.start()
        assert started.wait(30) and "error" not in streamed, streamed
        running = "jaxserve:num_requests_running"
        wait_for(lambda: metric(url, running) == 2, 30, "both requests to run")

        process.send_signal(signal.SIGINT)
        wait_for(lambda: "Received SIGINT: draining" in log_path.read_text(), 30, "the drain")
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        process.send_signal(signal.SIGINT)
        stream.join(60)
        plain.join(60)
        assert process.wait(timeout=60) == 130, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert streamed["status"] == 200 and streamed["done"] and streamed["finish"] == {0: "abort"}
    response = whole["response"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "abort"
    log = log_path.read_text()
    assert "Second SIGINT: aborting 2 requests in flight" in log
    assert "Traceback" not in log and "Shut down cleanly" not in log, log
