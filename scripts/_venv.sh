# Sourced by scripts/serve and scripts/test, which then call `install_jaxserve` (what serving
# needs) or `install_jaxserve dev` (that and the test tools): make .venv (Python >= 3.12) and
# install jaxserve into it. Each part installs once, and again only when pyproject.toml changed
# since (one stamp file per part). Each slow step prints one line first; pip's own output is
# shown only when it fails.
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
is_stale() {  # $1: a stamp file; true when it is missing or older than pyproject.toml
  [ ! -f "$1" ] || [ pyproject.toml -nt "$1" ]
}
install_jaxserve() {  # $1: "" for what serving needs, "dev" for the test tools as well
  local runtime_stamp=.venv/.jaxserve-installed dev_stamp=.venv/.jaxserve-installed-dev py
  if [ ! -x .venv/bin/python ]; then
    py=$(pick_python) || return 1
    venv_step "Creating .venv with $($py --version)" "$py" -m venv .venv || return 1
    venv_step "Upgrading pip" .venv/bin/python -m pip install --upgrade pip || return 1
  fi
  if is_stale "$runtime_stamp"; then
    echo "Installing jaxserve into .venv (the first time takes a minute or two)"
    venv_step "Installing jaxserve and what it runs on: jax, transformers, uvicorn, ... (the largest download)" \
      .venv/bin/python -m pip install -e . || return 1
    touch "$runtime_stamp"
    echo "    jaxserve is in .venv: 'source .venv/bin/activate' puts the jaxserve command on PATH (or run .venv/bin/jaxserve)"
  fi
  if [ "${1:-}" = dev ] && is_stale "$dev_stamp"; then
    venv_step "Installing the test tools: pytest, ruff, mypy, openai, schemathesis, ..." \
      .venv/bin/python -m pip install -e ".[dev]" || return 1
    touch "$dev_stamp"
  fi
}
