"""scripts/_venv.sh, the install step of ./scripts/serve and ./scripts/test: one line before each
slow step, pip's own output only when it fails. A stand-in .venv/bin/python plays pip."""

from __future__ import annotations

import os
import re
import shutil
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


def install(project: Path, extra: str = "", **env: str) -> subprocess.CompletedProcess:
    command = f"set -euo pipefail; source {ROOT / 'scripts' / '_venv.sh'}; install_jaxserve {extra}"
    return subprocess.run(
        ["bash", "-c", command],
        cwd=project,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
    )


def make_project(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PIP)
    python.chmod(0o755)
    return tmp_path


def steps(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.startswith("==> ")]


RUNTIME_STEP = (
    "==> Installing jaxserve and what it runs on: jax, transformers, uvicorn, ... "
    "(the largest download)"
)
TEST_TOOLS_STEP = "==> Installing the test tools: pytest, ruff, mypy, openai, schemathesis, ..."


def test_serve_installs_only_what_serving_needs_and_says_how_to_call_jaxserve(tmp_path):
    project = make_project(tmp_path)
    done = install(project)
    assert done.returncode == 0, done.stderr
    assert steps(done) == [RUNTIME_STEP]
    assert "a minute or two" in done.stdout
    assert "'source .venv/bin/activate' puts the jaxserve command on PATH" in done.stdout
    assert "Collecting" not in done.stdout + done.stderr
    assert (project / ".venv" / ".jaxserve-installed").exists()
    again = install(project)  # installed: nothing to do, nothing said
    assert again.returncode == 0 and again.stdout == ""


def test_the_test_tools_install_once_on_top(tmp_path):
    project = make_project(tmp_path)
    install(project)
    done = install(project, "dev")
    assert done.returncode == 0, done.stderr
    assert steps(done) == [TEST_TOOLS_STEP]  # what serving needs is there already
    assert install(project, "dev").stdout == "" and install(project).stdout == ""
    fresh = install(make_project(tmp_path / "fresh"), "dev")  # scripts/test on a new checkout
    assert steps(fresh) == [RUNTIME_STEP, TEST_TOOLS_STEP]
    # pyproject.toml changed: both parts install again
    future = os.path.getmtime(project / ".venv" / ".jaxserve-installed") + 10
    os.utime(project / "pyproject.toml", (future, future))
    assert steps(install(project, "dev")) == [RUNTIME_STEP, TEST_TOOLS_STEP]


def test_a_failed_install_shows_pips_output_and_stops(tmp_path):
    project = make_project(tmp_path)
    done = install(project, "dev", FAIL_ON=".[dev]")
    assert done.returncode != 0
    assert "ERROR: No matching distribution found for schemathesis" in done.stderr
    assert "Failed: Installing the test tools" in done.stderr
    assert (project / ".venv" / ".jaxserve-installed").exists()  # that part did install
    assert not (project / ".venv" / ".jaxserve-installed-dev").exists()  # retried next time


def test_scripts_serve_runs_jaxserve_serve_with_its_arguments(tmp_path):
    project = make_project(tmp_path)
    shutil.copytree(ROOT / "scripts", project / "scripts")
    jaxserve = project / ".venv" / "bin" / "jaxserve"
    jaxserve.write_text('#!/usr/bin/env bash\necho "jaxserve $*"\n')
    jaxserve.chmod(0o755)
    done = subprocess.run(
        [str(project / "scripts" / "serve"), "org/name", "--max-model-len", "8k"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "jaxserve serve org/name --max-model-len 8k"
    assert TEST_TOOLS_STEP not in done.stdout


def test_readme_says_how_to_call_jaxserve_before_it_does():
    """The README's first `jaxserve` command comes after it says how `jaxserve` gets on PATH."""
    readme = (ROOT / "README.md").read_text()
    first_command = re.search(r"^jaxserve ", readme, re.MULTILINE)
    assert first_command is not None
    assert "source .venv/bin/activate" in readme[: first_command.start()]
