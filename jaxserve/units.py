"""Human-readable counts on the command line: one parser for every flag that takes one.

``jaxserve launch``, ``jaxserve capacity`` and ``jaxserve bench throughput`` read token counts
(``--max-model-len``, ``--max-num-batched-tokens``, ``--rate-limit-tpm``) and byte counts
(``--max-request-body-bytes``) in vLLM's spelling, through ``human_int``.
"""

from __future__ import annotations

import argparse
import re

_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgG]?)")


def human_int(text: str) -> int:
    """``8192``, ``8k`` (8,000), ``8K`` (8,192), ``1.5m`` (1,500,000): vLLM's forms.

    An argparse ``type``: a bad value raises ``ArgumentTypeError``, which argparse prints after
    the flag's name (``argument --max-model-len: '8x' is not a number like 8192, 8k or 8K``).
    """
    match = _COUNT.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number like 8192, 8k or 8K")
    number, suffix = match.groups()
    if not suffix:
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r} must be a whole number")
        return int(number)
    power = "kmg".index(suffix.lower()) + 1
    if suffix.isupper():
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: binary suffixes take whole numbers")
        return int(number) * 1024**power
    value = float(number) * 1000**power
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)
