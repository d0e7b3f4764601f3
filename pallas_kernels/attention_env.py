"""``JAXSERVE_ATTENTION``: the attention path an operator asks for, read from the environment.

Its own module so that both dispatches read it (``ragged_paged_attention.dispatch``, which
routes latent attention on to ``mla.dispatch``, and ``mla.dispatch``, which honours
``reference``) without importing each other.
"""

from __future__ import annotations

from pallas_kernels.env_choice import env_choice

ATTENTION_ENV = "JAXSERVE_ATTENTION"
ATTENTION_CHOICES = ("auto", "mosaic", "triton", "reference")


def requested_attention() -> str:
    """``JAXSERVE_ATTENTION`` (default ``auto``), validated."""
    return env_choice(ATTENTION_ENV, ATTENTION_CHOICES, "auto")
