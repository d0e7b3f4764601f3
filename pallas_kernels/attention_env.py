"""``JAXSERVE_ATTENTION``: the attention path an operator asks for, read from the environment.

Its own module so that both dispatches read it (``ragged_paged_attention.dispatch``, which
routes latent attention on to ``mla.dispatch``, and ``mla.dispatch``, which honours
``reference``) without importing each other.
"""

from __future__ import annotations

import os

ATTENTION_ENV = "JAXSERVE_ATTENTION"
ATTENTION_CHOICES = ("auto", "mosaic", "triton", "reference")


def requested_attention() -> str:
    """``JAXSERVE_ATTENTION`` (default ``auto``), validated."""
    value = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if value not in ATTENTION_CHOICES:
        raise ValueError(f"{ATTENTION_ENV}={value!r} must be one of {', '.join(ATTENTION_CHOICES)}")
    return value
