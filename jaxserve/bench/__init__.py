"""Benchmarks run against a live server: ``jaxserve bench serve`` and its capacity note.

- `serve`: the load generator (`benchmark`, `ServeBenchConfig`) and the CLI wiring
  (`add_serve_arguments`, `run_serve`); also ``python -m jaxserve.bench.serve``.
- `datasets`: the prompts it replays. `stats`: per-request timings -> metrics and results.
- `report`: capacity.md and the plots, also from saved JSON (``python -m jaxserve.bench.report``).

Names are imported lazily so that ``python -m jaxserve.bench.<module>`` runs a module that the
package has not imported yet.
"""

import importlib
from typing import Any

_EXPORTS = {
    "BenchmarkError": "serve",
    "ServeBenchConfig": "serve",
    "add_serve_arguments": "serve",
    "benchmark": "serve",
    "run_serve": "serve",
    "RateResult": "stats",
    "SweepResult": "stats",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxserve.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxserve.bench.{_EXPORTS[name]}"), name)
