"""GBNF grammars (llama.cpp's syntax) -> Lark, in a process of their own.

llguidance reads Lark; its converter from GBNF is pure Python and quadratic in the number of
rules (measured on one core: a chain of 2,000 rules, 38 KB, 2.7 s; 4,000 rules, 78 KB, 11.8 s).
In the server's process that CPU time holds the interpreter lock in 5 ms slices against every
other request, and a thread cannot be stopped when its compile times out. So the conversion
runs in a fresh interpreter (``python -I -S``: no site-packages, only the converter's file and
the standard library; about 0.1 s to start) with a memory limit, and is killed when its compile
job is cancelled at its deadline. Lark grammars, which need no conversion, never start one.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

CONVERTER_MEMORY_BYTES = 1 << 30  # the child's address-space limit (RLIMIT_AS)

# The child: read the GBNF text on stdin, write "O" + the Lark grammar or "E" + why not.
_CHILD = """
import importlib.util, resource, sys
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
spec = importlib.util.spec_from_file_location("gbnf_to_lark", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
text = sys.stdin.buffer.read().decode()
try:
    out = "O" + module.gbnf_to_lark(text)
except RecursionError:
    out = "Ethe grammar is nested too deeply"
except MemoryError:
    out = "Ethe grammar needs more than %d MiB to convert" % (limit >> 20)
except Exception as exc:
    out = "E" + str(exc)
sys.stdout.buffer.write(out.encode())
"""


class ConversionError(ValueError):
    """The GBNF text is not a grammar (or too large to convert); the message says why."""


def is_gbnf(text: str) -> bool:
    """Whether ``text`` needs converting (llguidance's own test: Lark starts with ``start:``
    or ``%llguidance``)."""
    from llguidance.gbnf_to_lark import is_lark_syntax

    return not is_lark_syntax(text)


def gbnf_to_lark(text: str, on_cancel: Callable[[Callable[[], None]], None]) -> str:
    """The Lark grammar of GBNF ``text``, converted in a child process; ``on_cancel`` is given
    the child's kill, to call if the compile is cancelled (then ``ConversionError``)."""
    import llguidance.gbnf_to_lark

    converter = llguidance.gbnf_to_lark.__file__
    assert converter is not None
    child = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _CHILD, converter, str(CONVERTER_MEMORY_BYTES)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    on_cancel(child.kill)
    out, err = child.communicate(text.encode())
    if child.returncode != 0:
        if child.returncode < 0:  # killed: the compile's deadline passed
            raise ConversionError("the GBNF conversion was stopped")
        raise ConversionError(f"the GBNF conversion failed: {err.decode()[-300:].strip()}")
    reply = out.decode()
    if reply.startswith("O"):
        return reply[1:]
    raise ConversionError(f"the GBNF grammar is not valid: {reply[1:][:300]}")
