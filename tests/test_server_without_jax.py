"""The HTTP server imports no JAX: a process that serves only HTTP (a multi-host follower's
peer, a test, a tool that builds the app around a fake engine) does not pay JAX's start-up or
its memory. Only ``launch/serve.py`` and ``launch/run_batch.py`` build an engine; they load JAX
inside ``run_launch`` (after the pre-flight checks) and ``run_batch``: importing them loads none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
SERVER = ROOT / "jaxserve" / "server"

# Every module under jaxserve/server, listed by hand so that a new one is a decision: add it
# here (it must not import JAX) or say why not.
# NOTE: the modules that reach jaxserve.engine.interfaces (app, context, generation, lifecycle,
# metrics, request_log, the routes, guard.cost, guard.ratelimit) are blocked only by that module
# importing jaxserve.runner.capacity (and so JAX) for a type name; once it does not, this test
# passes as it stands.
SERVER_MODULES = (
    "jaxserve.server",
    "jaxserve.server.api",
    "jaxserve.server.api.completions",
    "jaxserve.server.api.classify",
    "jaxserve.server.api.embeddings",
    "jaxserve.server.api.errors",
    "jaxserve.server.api.fields",
    "jaxserve.server.api.logprobs",
    "jaxserve.server.api.openapi",
    "jaxserve.server.api.protocol",
    "jaxserve.server.api.score_handler",
    "jaxserve.server.api.scoring",
    "jaxserve.server.api.structured_outputs",
    "jaxserve.server.api.tokenization",
    "jaxserve.server.app",
    "jaxserve.server.background",
    "jaxserve.server.chat",
    "jaxserve.server.chat.completions",
    "jaxserve.server.chat.messages",
    "jaxserve.server.chat.output",
    "jaxserve.server.chat.reasoning",
    "jaxserve.server.chat.tool_calls",
    "jaxserve.server.chat.tool_parsers",
    "jaxserve.server.chat.tools",
    "jaxserve.server.context",
    "jaxserve.server.generation",
    "jaxserve.server.guard",
    "jaxserve.server.guard.auth",
    "jaxserve.server.guard.cost",
    "jaxserve.server.guard.limits",
    "jaxserve.server.guard.ratelimit",
    "jaxserve.server.launch",
    "jaxserve.server.launch.convert",  # loads JAX only inside run_convert
    "jaxserve.server.launch.flags",
    "jaxserve.server.launch.preflight",
    "jaxserve.server.launch.run_batch",  # loads JAX only inside run_batch
    "jaxserve.server.launch.serve",  # loads JAX only inside run_launch
    "jaxserve.server.launch.vllm_flags",
    "jaxserve.server.lifecycle",
    "jaxserve.server.lora",
    "jaxserve.server.metrics",
    "jaxserve.server.request_log",
    "jaxserve.server.responses",
    "jaxserve.server.responses.items",
    "jaxserve.server.responses.output",
    "jaxserve.server.responses.protocol",
    "jaxserve.server.responses.serving",
    "jaxserve.server.responses.store",
    "jaxserve.server.settings",
    "jaxserve.server.training",
)

# Imports each module in turn; at the first that brings in JAX, prints the module and the chain
# of jaxserve modules that reached ``import jax``, and exits 1.
PROBE = """
import importlib, importlib.abc, sys, traceback
chain = []
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "jax" and not chain:
            chain.extend(
                f"{f.filename.split('jaxserve/', 1)[-1]}:{f.lineno}: {f.line}"
                for f in traceback.extract_stack()
                if "/jaxserve/" in f.filename
            )
        return None
sys.meta_path.insert(0, Watch())
for name in sys.argv[1:]:
    importlib.import_module(name)
    if "jax" in sys.modules:
        print(f"importing {name} loads jax:", *chain, sep="\\n  ")
        sys.exit(1)
"""


def test_every_server_module_is_listed() -> None:
    on_disk = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in SERVER.rglob("*.py")
    }
    assert on_disk == set(SERVER_MODULES)


def test_no_server_module_imports_jax() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *SERVER_MODULES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
