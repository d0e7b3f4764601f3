"""Shared test set-up: fixture model paths and a persistent compilation cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "models"
FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral")

# Compiled programs are reused across test runs and processes (CI keeps a warm cache dir).
os.environ.setdefault("JAXSERVE_COMPILATION_CACHE", str(Path.home() / ".cache/jaxserve/xla-tests"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


# ``jaxserve launch`` whose engine steps take at least $JAXSERVE_TEST_MIN_STEP_S seconds: a
# drain test needs streams that outlast ``--shutdown-timeout`` on any device, however fast.
PACED_LAUNCH = """
import os, sys, time
from jaxserve.cli import main
from jaxserve.engine import core
min_step_s = float(os.environ["JAXSERVE_TEST_MIN_STEP_S"])
step = core.EngineCore.step
def paced_step(self):
    start = time.perf_counter()
    outputs = step(self)
    time.sleep(max(0.0, min_step_s - (time.perf_counter() - start)))
    return outputs
core.EngineCore.step = paced_step
sys.exit(main(sys.argv[1:]))
"""


def paced_launch_command(min_step_s: float) -> tuple[list[str], dict[str, str]]:
    """The argv prefix and environment of a launch with paced steps (see PACED_LAUNCH)."""
    env = {k: v for k, v in os.environ.items() if k != "JAXSERVE_API_KEY"}
    env["JAXSERVE_TEST_MIN_STEP_S"] = str(min_step_s)
    return [sys.executable, "-c", PACED_LAUNCH, "launch"], env


def fixture_dir(family: str) -> Path:
    return FIXTURES / family


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return fixture_dir("llama")


def tiny_engine_config(served_model_name: str, **overrides):
    """EngineConfig for the llama fixture in float32: what the server tests run on."""
    from jaxserve.engine.engine_config import EngineConfig

    return EngineConfig(
        model=str(fixture_dir("llama")),
        served_model_name=served_model_name,
        dtype="float32",
        **overrides,
    )
