"""Shared test set-up: fixture model paths, a persistent compilation cache, and helpers for the
tests that start servers and processes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "models"
# Newer families and rope scalings, whose golden.npz also holds a long generation.
# Mixtures of experts (DeepSeek-V3 with multi-head latent attention).
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3")
NEW_FAMILIES = (
    "gemma2",
    "gemma3",
    "phi3",
    "llama_linear",
    "llama_dynamic",
    "qwen2_yarn",
    *MOE_FAMILIES,
)
FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral", *NEW_FAMILIES)

# Compiled programs are reused across test runs and processes (CI keeps a warm cache dir).
os.environ.setdefault("JAXSERVE_COMPILATION_CACHE", str(Path.home() / ".cache/jaxserve/xla-tests"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The test process makes and drops hundreds of engines, most never shut down: a frozen heap
# would keep their cyclic garbage (KV caches included) for good. test_engine.py tests the freeze.
os.environ.setdefault("JAXSERVE_GC_FREEZE", "0")


# ``jaxserve launch`` whose engine steps take at least $JAXSERVE_TEST_MIN_STEP_S seconds (a
# test that needs streams still running at some moment gets them on any device, however fast)
# and raise once the file named by $JAXSERVE_TEST_CRASH_FILE exists (an injected failure).
PACED_LAUNCH = """
import os, sys, time
from pathlib import Path
from jaxserve.cli import main
from jaxserve.engine import core
min_step_s = float(os.environ["JAXSERVE_TEST_MIN_STEP_S"])
crash_file = os.environ.get("JAXSERVE_TEST_CRASH_FILE")
step = core.EngineCore.step
def paced_step(self):
    if crash_file and Path(crash_file).exists():
        raise RuntimeError("injected device failure")
    start = time.perf_counter()
    outputs = step(self)
    time.sleep(max(0.0, min_step_s - (time.perf_counter() - start)))
    return outputs
core.EngineCore.step = paced_step
sys.exit(main(sys.argv[1:]))
"""


def paced_launch_command(
    min_step_s: float, crash_file: Path | None = None
) -> tuple[list[str], dict[str, str]]:
    """The argv prefix and environment of a launch with paced steps (see PACED_LAUNCH)."""
    env = {k: v for k, v in os.environ.items() if k != "JAXSERVE_API_KEY"}
    env["JAXSERVE_TEST_MIN_STEP_S"] = str(min_step_s)
    if crash_file is not None:
        env["JAXSERVE_TEST_CRASH_FILE"] = str(crash_file)
    return [sys.executable, "-c", PACED_LAUNCH, "launch"], env


def pace_steps(core, min_step_s: float) -> None:
    """Make an in-process engine's steps take at least `min_step_s` (PACED_LAUNCH's in-process
    twin): a test that needs a request still running at some moment gets it on any device."""
    step = core.step

    def paced_step():
        start = time.perf_counter()
        outputs = step()
        time.sleep(max(0.0, min_step_s - (time.perf_counter() - start)))
        return outputs

    core.step = paced_step


def fixture_dir(family: str) -> Path:
    return FIXTURES / family


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return fixture_dir("llama")


def log_softmax(logits):  # numpy, over the last axis
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def assert_long_completion_is_golden(url: str, family: str, model: str) -> None:
    """The greedy completion of the golden's long prompt over HTTP: Hugging Face's tokens (as
    text; the incomplete UTF-8 bytes the tokens may end with are held back) and logprobs."""
    from transformers import AutoTokenizer

    golden = np.load(fixture_dir(family) / "golden.npz")
    expected = golden["long_greedy_ids"].tolist()
    body = {
        "model": model,
        "prompt": golden["prompt2_ids"].tolist(),
        "max_tokens": len(expected),
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    tokenizer = AutoTokenizer.from_pretrained(fixture_dir(family))
    assert choice["text"] == tokenizer.decode(expected).rstrip("\ufffd")
    assert len(choice["logprobs"]["token_logprobs"]) == len(expected)
    ref = log_softmax(golden["long_decode_logits"])[np.arange(len(expected)), expected]
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], ref, atol=1e-4)


def tiny_engine_config(served_model_name: str, family: str = "llama", **overrides):
    """EngineConfig for a fixture model (the llama one unless ``family`` says) in float32: what
    the server tests run on. ``overrides`` may replace any field, ``model`` and ``dtype`` too."""
    from jaxserve.engine_config import EngineConfig

    fields = {"model": str(fixture_dir(family)), "dtype": "float32", **overrides}
    return EngineConfig(served_model_name=served_model_name, **fields)


# A fixture family's engine at its smallest, with no warm-up: enough to serve its golden prompts.
SMALL_ENGINE = dict(
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    block_size=4,
    num_gpu_blocks_override=64,
    warmup=False,
)


# -- servers and processes the tests start ------------------------------------------------


@contextlib.contextmanager
def tiny_server(
    served_model_name: str,
    settings: dict | None = None,
    *,
    engine=None,
    min_step_s: float = 0.0,
    max_queued_requests: int | None = None,
    on_engine_dead: Callable[[], None] | None = None,
    **config,
) -> Iterator[SimpleNamespace]:
    """A loopback server in this process, the one way the tests start one: ``build_app`` with
    ``ServerSettings(served_model_names=(served_model_name,), **settings)`` (``settings`` may
    name other models) around ``engine``, which the caller started and shuts down, or else
    around an engine of ``tiny_engine_config(served_model_name, **config)`` made, started and
    shut down here, its steps paced to at least ``min_step_s`` (``pace_steps``). Yields
    ``SimpleNamespace(url, port, socket, engine, ctx)`` (``socket``: the listening one)."""
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.app import build_app
    from jaxserve.server.background import BackgroundServer
    from jaxserve.server.settings import ServerSettings

    is_owned = engine is None
    if engine is None:
        config = tiny_engine_config(served_model_name, **config)
        engine = AsyncEngine.from_config(config, max_queued_requests=max_queued_requests)
        if min_step_s:
            pace_steps(engine.core, min_step_s)
        engine.start()
    try:
        settings = {"served_model_names": (served_model_name,), **(settings or {})}
        app = build_app(engine, ServerSettings(**settings), on_engine_dead=on_engine_dead)
        with BackgroundServer(app) as background:
            yield SimpleNamespace(
                url=background.url,
                port=background.port,
                socket=background.socket,
                engine=engine,
                ctx=app.state.ctx,
            )
    finally:
        if is_owned:
            engine.shutdown()


def wait_idle(engine, timeout_s: float = 10.0) -> None:
    """The engine has no request left (none arriving, waiting or running) and every KV block
    is free again."""
    core = engine.core

    def is_idle() -> bool:
        stats = core.stats
        return (
            core.num_unfinished() == 0
            and stats.num_running == 0
            and stats.num_waiting == 0
            and stats.kv_cache_usage == 0
        )

    deadline = time.monotonic() + timeout_s
    while not is_idle():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"engine not idle: {core.num_unfinished()} unfinished, {core.stats}"
            )
        time.sleep(0.02)


def assert_bad_request(r: httpx.Response, param: str, *words: str) -> str:
    """A 400 ``invalid_request_error`` naming ``param``, whose message has every word."""
    assert r.status_code == 400, r.text[:1000]
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error["message"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def metric(url: str, name: str, label: str = "") -> float:
    """Sum of the samples of a Prometheus series in /metrics (those whose labels hold `label`)."""
    total, found = 0.0, False
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if (line.startswith(name + "{") and label in line) or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name}{label} not in /metrics"
    return total


def start_server(
    command: Sequence[str], env: dict[str, str], log_path: Path, url: str, timeout_s: float = 180
) -> subprocess.Popen:
    """Start a server process logging to `log_path`; return once its /health answers 200."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return process
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    except BaseException:
        process.kill()
        process.wait(10)
        raise


def wait_for_all(procs: Sequence[subprocess.Popen], timeout_s: float) -> None:
    """Wait for cooperating processes; one failing stops the wait (the others would block at a
    collective forever), and any still running at the end are killed."""
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


@pytest.fixture
def verify_triton_modules(monkeypatch):
    """Every Pallas Triton module lowered in the test is verified as XLA verifies it when it
    parses it on the GPU (the lowering alone let an ill-typed loop through)."""
    from jax._src.pallas.triton import lowering

    lower = lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        assert result.module.operation.verify()  # raises MLIRError naming the op otherwise
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lower_and_verify)


def reference_compiled_plainly(fn: Callable, *args):
    """``fn(*args)`` jitted and compiled by XLA's heuristics (``xla_gpu_autotune_level`` 0):
    the references the kernels are checked against are einsums over gathered pages, and on an
    H100 the autotuner timed their GEMMs' candidates at DeepSeek-V3's shapes for minutes a case
    (a native run of 300 s ended in the fifth case, 2026-12-07)."""
    import jax

    return jax.jit(fn).lower(*args).compile({"xla_gpu_autotune_level": 0})(*args)


def run_with_devices(script: str, num_devices: int, *args: str, timeout: int = 600) -> str:
    """``script`` (Python source) in a process of its own on ``num_devices`` virtual CPU
    devices (JAX fixes the count when it starts); its standard output, once it exited 0."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}",
        TRANSFORMERS_VERBOSITY="error",
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
