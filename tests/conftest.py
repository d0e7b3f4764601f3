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
