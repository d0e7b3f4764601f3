"""The kernels' environment switches (``JAXSERVE_ATTENTION``, ``JAXSERVE_MLA``, ...): one
reading and one error for all of them."""

from __future__ import annotations

import os


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The environment variable ``name``, lower-cased (``default`` when unset or empty); a
    value outside ``choices`` is a ValueError naming the variable and the choices."""
    value = os.environ.get(name, default).strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {', '.join(choices)}")
    return value
