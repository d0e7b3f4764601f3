"""The shape of the code that the design promises (docs/architecture.md): layers that only
import down (server -> engine -> runner -> models -> pallas_kernels, with the shared types of
``jaxserve/*.py`` below them all), no import circle between any two modules, and functions
short enough to read at once.

Rules follow concepts, not line counts: a module is as long as its one concept needs, but two
modules that import each other are one concept split in two (or two tangled), and a function
over the budget is doing several things that deserve names."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("jaxserve", "pallas_kernels", "benchmarks")
# The packages held to the function budget and the formatter: the benchmark scripts, each a
# ``main`` that prints one table, are held to the layers and the cycles only.
LIBRARIES = ("jaxserve", "pallas_kernels")

# The modules of ``jaxserve/*.py`` that every layer shares: configs, parameters, units.
BASE = (
    "jaxserve.config",
    "jaxserve.config_fields",
    "jaxserve.engine_config",
    "jaxserve.flag_names",
    "jaxserve.hf_cache",
    "jaxserve.json_limits",
    "jaxserve.sampling_params",
    "jaxserve.units",
)
# The command line, the benchmark clients and the integrations (Ray Serve) sit beside the
# server, above the engine.
TOP = ("jaxserve.cli", "jaxserve.__main__", "jaxserve.bench", "jaxserve.integrations")
LAYERS = ("jaxserve.server", "jaxserve.engine", "jaxserve.runner", "jaxserve.models")
# module prefix -> the prefixes it must not import (the layers above it)
ABOVE: dict[str, tuple[str, ...]] = {
    "pallas_kernels": ("jaxserve", "benchmarks"),
    **{base: (*TOP, *LAYERS) for base in BASE},
    "jaxserve.models": (*TOP, *LAYERS[:3]),
    "jaxserve.runner": (*TOP, *LAYERS[:2]),
    "jaxserve.engine": (*TOP, *LAYERS[:1]),
    "jaxserve.server": TOP,
    "jaxserve.bench": ("jaxserve.server", "jaxserve.cli", "jaxserve.__main__"),
}

# Every function is at most this many lines, from its ``def`` to its last line (decorators
# aside), docstring and comments included.
FUNCTION_LINES = 60
KERNEL_BODY = "a kernel body"
# path::qualified name -> why it may be longer: tables read row by row, and kernel bodies,
# which are one program for the compiler and read best as one.
LONG_FUNCTIONS = {
    "jaxserve/server/launch/flags.py::add_launch_arguments": "the launch flags, a table",
    "jaxserve/server/api/openapi.py::_schemas": "the OpenAPI schemas, a table",
    "jaxserve/bench/capacity.py::add_capacity_arguments": "the capacity flags, a table",
    "jaxserve/bench/serve.py::add_serve_arguments": "the benchmark flags, a table",
    "jaxserve/cli.py::build_parser": "the subcommands, a table",
    "pallas_kernels/ragged_paged_attention/mosaic_gpu.py::_attention_kernel": KERNEL_BODY,
    "pallas_kernels/ragged_paged_attention/mosaic_gpu.py::_attention_kernel._": KERNEL_BODY,
    "pallas_kernels/ragged_paged_attention/mosaic_gpu.py::_attention_kernel._.step": KERNEL_BODY,
    "pallas_kernels/ragged_paged_attention/tpu.py::_attention_kernel": KERNEL_BODY,
    "pallas_kernels/ragged_paged_attention/triton.py::_attention_kernel": KERNEL_BODY,
    "pallas_kernels/grouped_matmul/triton.py::_grouped_matmul_kernel": KERNEL_BODY,
    "pallas_kernels/mla/triton.py::_mla_kernel": KERNEL_BODY,
}
# Modules whose lines the formatter may leave alone, and why (a line-count bypass is none).
UNFORMATTED = {"jaxserve/server/metrics.py": "the histogram bucket edges, a table of numbers"}


def module_paths(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of ``packages``."""
    modules = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ``PACKAGES`` it imports anywhere in its file (in a function,
    under ``TYPE_CHECKING``: an import is an import). ``from package import name`` counts as
    an import of ``package.name`` where that is a module, else of ``package``."""
    modules = module_paths()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else base)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("layer", sorted(ABOVE))
def test_no_module_imports_from_a_layer_above_it(layer) -> None:
    graph = import_graph()
    offenders = [
        f"{module} imports {target}"
        for module, targets in sorted(graph.items())
        if is_under(module, layer)
        for target in sorted(targets)
        if any(is_under(target, above) for above in ABOVE[layer])
    ]
    assert not offenders, offenders


def test_every_module_has_a_layer() -> None:
    """A new top-level module or package must be placed in ``ABOVE`` (or ``TOP``)."""
    placed = (*ABOVE, *TOP, "jaxserve", "benchmarks")
    unplaced = [m for m in import_graph() if not any(is_under(m, p) for p in placed)]
    assert not unplaced, unplaced


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle() -> None:
    assert import_cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """(qualified name, node) of every function, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from functions(node, name + ".")
        else:
            yield from functions(node, prefix)


def function_lengths() -> dict[str, int]:
    lengths = {}
    for path in module_paths(LIBRARIES).values():
        relative = path.relative_to(ROOT).as_posix()
        for name, node in functions(ast.parse(path.read_text())):
            lengths[f"{relative}::{name}"] = node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]
    return lengths


def test_functions_stay_within_the_budget() -> None:
    long = {
        name: n
        for name, n in function_lengths().items()
        if n > FUNCTION_LINES and name not in LONG_FUNCTIONS
    }
    assert not long, f"over {FUNCTION_LINES} lines: {long}"


def test_the_allow_list_names_only_long_functions() -> None:
    """An entry whose function was shortened, renamed or moved leaves the list."""
    lengths = function_lengths()
    stale = [name for name in LONG_FUNCTIONS if lengths.get(name, 0) <= FUNCTION_LINES]
    assert not stale, stale


def test_no_module_bypasses_the_formatter() -> None:
    offenders = [
        path.relative_to(ROOT).as_posix()
        for path in module_paths(LIBRARIES).values()
        if ("# fmt: skip" in (text := path.read_text()) or "# fmt: off" in text)
        and path.relative_to(ROOT).as_posix() not in UNFORMATTED
    ]
    assert not offenders, offenders
