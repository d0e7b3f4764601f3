# Sourced by scripts/test and scripts/serve: make .venv (Python >= 3.12) and install jaxserve.
# Re-installs only when pyproject.toml changed since the last install. Each slow step prints
# one line first; pip's own output is shown only when it fails.
pick_python() {
  for candidate in python3.12 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "jaxserve needs Python >= 3.12 (pyenv: 'pyenv install 3.12'; .python-version selects it)" >&2
  return 1
}
venv_step() {  # $1: what the step does, said before it starts; the rest: its command
  local what=$1 started=$SECONDS log
  shift
  log=$(mktemp)
  echo "==> $what"
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "Failed: $what (the output above says why)" >&2
    return 1
  fi
  rm -f "$log"
  echo "    done in $((SECONDS - started)) s"
}
if [ ! -x .venv/bin/python ]; then
  py=$(pick_python) || return 1
  venv_step "Creating .venv with $($py --version)" "$py" -m venv .venv || return 1
fi
stamp=.venv/.jaxserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "Installing jaxserve into .venv (the first time takes about two minutes)"
  venv_step "Upgrading pip" .venv/bin/python -m pip install --upgrade pip || return 1
  venv_step "Installing jaxserve and what it runs on: jax, transformers, uvicorn, ... (the largest download)" \
    .venv/bin/python -m pip install -e . || return 1
  venv_step "Installing the test tools: pytest, ruff, mypy, openai, schemathesis, ..." \
    .venv/bin/python -m pip install -e ".[dev]" || return 1
  touch "$stamp"
fi
