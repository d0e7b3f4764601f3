"""Shared test set-up: fixture model paths and a persistent compilation cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "models"
FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral")

# Compiled programs are reused across test runs and processes (CI keeps a warm cache dir).
os.environ.setdefault("JAXSERVE_COMPILATION_CACHE", str(Path.home() / ".cache/jaxserve/xla-tests"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


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
