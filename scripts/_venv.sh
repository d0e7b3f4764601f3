# Sourced by scripts/test and scripts/serve: make .venv (Python >= 3.12) and install jaxserve.
# Re-installs only when pyproject.toml changed since the last install.
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
if [ ! -x .venv/bin/python ]; then
  py=$(pick_python)
  echo "Creating .venv with $($py --version)"
  "$py" -m venv .venv
fi
stamp=.venv/.jaxserve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "Installing jaxserve and its dependencies into .venv (first run takes a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
