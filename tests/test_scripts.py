"""scripts/_venv.sh, the install step of ./scripts/serve and ./scripts/test: one line before each
slow step, pip's own output only when it fails. A stand-in .venv/bin/python plays pip."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Prints pip-like noise; fails (as pip does) when its arguments contain $FAIL_ON.
FAKE_PIP = """#!/usr/bin/env bash
echo "Collecting jax==0.11.2"
echo "  Downloading jax-0.11.2-py3-none-any.whl"
if [ -n "${FAIL_ON:-}" ] && [[ "$*" == *"$FAIL_ON"* ]]; then
  echo "ERROR: No matching distribution found for schemathesis>=4.0" >&2
  exit 1
fi
"""


def install(project: Path, **env: str) -> subprocess.CompletedProcess:
    command = f"set -euo pipefail; source {ROOT / 'scripts' / '_venv.sh'}"
    return subprocess.run(
        ["bash", "-c", command],
        cwd=project,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )


def make_project(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PIP)
    python.chmod(0o755)
    return tmp_path


def test_install_says_what_it_does_and_keeps_pip_quiet(tmp_path):
    project = make_project(tmp_path)
    done = install(project)
    assert done.returncode == 0, done.stderr
    steps = [line for line in done.stdout.splitlines() if line.startswith("==> ")]
    assert steps == [
        "==> Upgrading pip",
        "==> Installing jaxserve and what it runs on: jax, transformers, uvicorn, ... "
        "(the largest download)",
        "==> Installing the test tools: pytest, ruff, mypy, openai, schemathesis, ...",
    ]
    assert "about two minutes" in done.stdout
    assert "Collecting" not in done.stdout + done.stderr
    assert (project / ".venv" / ".jaxserve-installed").exists()
    again = install(project)  # installed: nothing to do, nothing said
    assert again.returncode == 0 and again.stdout == ""


def test_a_failed_install_shows_pips_output_and_stops(tmp_path):
    project = make_project(tmp_path)
    done = install(project, FAIL_ON=".[dev]")
    assert done.returncode != 0
    assert "ERROR: No matching distribution found for schemathesis" in done.stderr
    assert "Failed: Installing the test tools" in done.stderr
    assert not (project / ".venv" / ".jaxserve-installed").exists()  # retried next time
