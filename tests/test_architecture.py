"""The shape of the code that the design promises (docs/architecture.md): the one-way flow
server -> engine -> runner -> models -> pallas_kernels."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# package -> the packages it must not import (the layers above it)
ABOVE = {
    "jaxserve/runner": ("jaxserve.engine", "jaxserve.server"),
    "jaxserve/models": ("jaxserve.engine", "jaxserve.server", "jaxserve.runner"),
    "jaxserve/engine": ("jaxserve.server",),
    "pallas_kernels": ("jaxserve",),
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_no_module_imports_from_a_layer_above_it(package) -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in imported_modules(path)
        if any(name == above or name.startswith(above + ".") for above in ABOVE[package])
    ]
    assert not offenders, offenders
