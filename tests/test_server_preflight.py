"""``jaxserve launch`` fails fast, with the fix in the message: a busy port or a busy device
ends the start in seconds, before anything loads; an allocation failure later is one message;
a server open to every interface without an API key is warned of.

The device is faked two ways: a ``memory_query`` passed to ``run_launch``, and a stand-in
``pynvml`` module (tests/fixtures/fake_pynvml) first on a subprocess's PYTHONPATH, which runs
the real NVML path of ``jaxserve.runner.device_memory``.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxserve.cli import build_parser
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.runner.device_memory import (
    DeviceMemory,
    DeviceMemoryError,
    check_free_memory,
    nvml_device_memory,
)
from jaxserve.server.launch.preflight import warn_if_open
from jaxserve.server.launch.serve import run_launch
from jaxserve.server.settings import ServerSettings
from tests.conftest import free_port

FAKE_PYNVML = Path(__file__).parent / "fixtures" / "fake_pynvml"
GB = 10**9


def parse_launch(*flags: str):
    argv = ["launch", *flags]
    return build_parser(argv).parse_args(argv)


def busy_device() -> list[DeviceMemory]:
    """A device of 141 GB with 100 GB held by another process."""
    return [DeviceMemory(0, "Fake GPU", 41 * GB, 141 * GB)]


def no_device() -> str:
    return "no NVIDIA driver"


def errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture
def no_engine(monkeypatch):
    """Building the engine (loading, compiling) fails the test: "ends in seconds" is checked as
    "ends before any of that", which no machine's speed changes (timing it failed on a busy
    machine: an 11.5 s start against a 10 s bound)."""

    def build(*args, **kwargs):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(AsyncEngine, "from_config", build)


def test_a_busy_device_ends_launch_in_seconds_with_the_fix(caplog, no_engine):
    caplog.set_level(logging.INFO)
    args = parse_launch("--host", "127.0.0.1", "--port", str(free_port()))
    assert run_launch(args, memory_query=busy_device) == 1
    (message,) = errors(caplog)
    assert "Device 0 (Fake GPU) has 38.18 GiB free of 131.32 GiB" in message
    assert "--gpu-memory-utilization 0.9 asks for 118.18 GiB" in message
    assert "lower --gpu-memory-utilization to at most 0.29" in message
    assert "stop the other process" in message
    assert "Loading" not in caplog.text  # nothing was loaded


def test_a_device_with_room_passes_and_a_full_one_only_names_stopping():
    check_free_memory(0.25, busy_device)  # 35.25 GB of the 41 GB free
    check_free_memory(0.9, no_device)  # nothing to read: skipped
    full = [DeviceMemory(0, "Fake GPU", 1 * GB, 141 * GB)]
    with pytest.raises(DeviceMemoryError) as info:
        check_free_memory(0.9, lambda: full)
    assert "lower" not in str(info.value) and "stop the other process." in str(info.value)


def test_every_visible_device_is_checked_and_the_busy_one_named():
    free = DeviceMemory(0, "Fake GPU", 140 * GB, 141 * GB)
    busy = DeviceMemory(1, "Fake GPU", 41 * GB, 141 * GB)
    with pytest.raises(DeviceMemoryError) as info:
        check_free_memory(0.9, lambda: [free, busy])
    assert str(info.value).startswith("Device 1 (Fake GPU) has 38.18 GiB free")
    assert "leave this device out with CUDA_VISIBLE_DEVICES" in str(info.value)


def fake_nvml(free: int, total: int, reserved: int) -> types.ModuleType:
    """A pynvml with two devices (UUIDs GPU-a, GPU-b) and NVML's version-2 memory struct."""
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    memory = types.SimpleNamespace(free=free, total=total, reserved=reserved)
    module.__dict__.update(
        NVMLError=NVMLError,
        nvmlMemory_v2=2,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: ["GPU-a", "GPU-b"][i],
        nvmlDeviceGetHandleByUUID=lambda uuid: uuid,
        nvmlDeviceGetName=lambda handle: f"GPU {handle}".encode(),
        nvmlDeviceGetMemoryInfo=lambda handle, version=None: memory,
    )
    return module


def test_nvml_reads_the_visible_devices_and_leaves_out_the_drivers_reservation(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(100 * GB, 150 * GB, 1 * GB))
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml_device_memory() == [
        DeviceMemory(0, "GPU GPU-a", 100 * GB, 149 * GB),
        DeviceMemory(1, "GPU GPU-b", 100 * GB, 149 * GB),
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-b")
    assert [d.name for d in nvml_device_memory()] == ["GPU GPU-b"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert [d.name for d in nvml_device_memory()] == ["GPU GPU-b", "GPU GPU-a"]  # CUDA's order
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert nvml_device_memory() == "CUDA_VISIBLE_DEVICES names no device"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert "leaves out CUDA" in nvml_device_memory()


def test_launch_on_a_busy_gpu_exits_non_zero_within_seconds(tmp_path):
    """The whole command, reading the (stand-in) NVML library as on a CUDA host."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAXSERVE_API_KEY")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE_PYNVML), env.get("PYTHONPATH", ".")])
    command = [sys.executable, "-m", "jaxserve.cli", "launch", "--host", "127.0.0.1",
               "--port", str(free_port())]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "Device 0 (Fake GPU) has 38.18 GiB free of 131.32 GiB" in last
    assert "lower --gpu-memory-utilization to at most 0.29" in last
    assert "CUDA_ERROR_OUT_OF_MEMORY" not in done.stderr and "Loading" not in done.stderr


def test_a_busy_port_ends_launch_before_loading(caplog, no_engine):
    caplog.set_level(logging.INFO)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        args = parse_launch("--host", "127.0.0.1", "--port", str(port))
        assert run_launch(args, memory_query=no_device) == 1
    (message,) = errors(caplog)
    assert f"Cannot listen on 127.0.0.1:{port}" in message and "choose another --port" in message
    assert "Loading" not in caplog.text


def test_a_bad_host_is_named(caplog):
    args = parse_launch("--host", "192.0.2.1", "--port", str(free_port()))  # not ours
    assert run_launch(args, memory_query=no_device) == 1
    (message,) = errors(caplog)
    assert "Cannot listen on 192.0.2.1:" in message and "check --host" in message


@pytest.mark.parametrize(
    ("host", "api_key", "warned"),
    [("0.0.0.0", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False)],
)
def test_all_interfaces_without_an_api_key_is_warned_of(caplog, host, api_key, warned):
    warn_if_open(host, 8000, ServerSettings(served_model_names=("m",), api_key=api_key))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    open_door = [w for w in warnings if "Listening on all interfaces" in w]
    assert bool(open_door) == warned, warnings
    if warned:
        assert "--api-key" in open_door[0] and "--host 127.0.0.1" in open_door[0]


def test_a_failed_launch_says_only_why(caplog, monkeypatch, no_engine):
    """The open-door warning came before every failed start's real error; it now comes when
    the server starts."""
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    with socket.socket() as server:  # busy, so launch stops right after its checks
        server.bind(("0.0.0.0", 0))
        server.listen()
        port = server.getsockname()[1]
        assert run_launch(parse_launch("--port", str(port)), no_device) == 1
    (message,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert message.startswith(f"Cannot listen on 0.0.0.0:{port}")


def test_running_out_of_device_memory_while_starting_is_one_message(caplog, monkeypatch):
    def allocate_too_much(config, **kwargs):  # a real allocation failure, as the KV cache's
        jnp.zeros((2**20, 2**20, 256), jnp.float32)  # 1 PiB

    monkeypatch.setattr(AsyncEngine, "from_config", allocate_too_much)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # restored afterwards
    args = parse_launch("--host", "127.0.0.1", "--port", str(free_port()))
    assert run_launch(args, memory_query=no_device) == 1
    (message,) = errors(caplog)
    assert message.startswith("Out of device memory while starting (RESOURCE_EXHAUSTED")
    assert "lower --gpu-memory-utilization, --max-model-len" in message


LLAMA_3_8B = Path(__file__).parents[1] / "jaxserve" / "assets" / "configs" / "llama-3-8b"


# The README's `bench latency` example (dummy Llama-3-8B weights by default).
README_LATENCY = "bench latency --input-len 1000 --output-len 256 --max-model-len 4096".split()


@pytest.mark.parametrize(
    "command",
    [["launch", str(LLAMA_3_8B), "--load-format", "dummy", "--host", "127.0.0.1"], README_LATENCY],
    ids=["launch", "bench-latency"],
)
def test_a_model_that_does_not_fit_ends_the_process_with_one_line(command):
    """Guards the process that printed this error and then went on making the weights (29.9
    GiB here, on a thread the interpreter's exit waited for; Ctrl-C was ignored): now the
    capacity plan comes before the load starts. The timeout is far from the few seconds it
    takes, and far from the minutes the old process ran."""
    env = {k: v for k, v in os.environ.items() if k != "JAXSERVE_API_KEY"}
    if command[0] == "launch":
        command = [*command, "--port", str(free_port())]
    done = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "llama-3-8b" in last and "do not fit in 90% of 2.00 GiB" in last, last
    assert "Traceback" not in done.stderr and "random weights in" not in done.stderr
