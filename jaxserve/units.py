"""Human-readable numbers on the command line: one parser for every flag that takes a count or
a size, and the formatter that prints counts back.

``jaxserve launch``, ``jaxserve capacity`` and ``jaxserve bench throughput`` read token counts
(``--max-model-len``, ``--max-num-batched-tokens``, ``--rate-limit-tpm``) through ``human_int``
and byte sizes (``--max-request-body-bytes``, ``--device-memory``) through ``human_bytes``.
The rule is vLLM's: a lowercase suffix is decimal (``8k`` = 8,000), an uppercase one binary
(``8K`` = 8,192), and decimal suffixes take fractions (``1.5k`` = 1,500).

``cdiv`` is the one ceiling division of jaxserve's integer arithmetic (pages of a sequence,
blocks of a bucket); the module imports nothing of jaxserve, so every layer may use it.
"""

from __future__ import annotations

import argparse
import re

_SUFFIXES = "kmgt"
_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)")
# A size with a unit that says its base whatever the case: 141GB, 80 GiB, 512mib.
_BYTES = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt])(i?)b", re.IGNORECASE)
COUNT_RULE = "8k = 8,000, 8K = 8,192, 1.5k = 1,500"


def _scaled(text: str, number: str, multiplier: int) -> int:
    value = float(number) * multiplier
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


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
    power = _SUFFIXES.index(suffix.lower()) + 1
    if suffix.isupper():
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: binary suffixes take whole numbers")
        return int(number) * 1024**power
    return _scaled(text, number, 1000**power)


def human_bytes(text: str) -> int:
    """A byte size: ``human_int``'s forms, or a number with a unit, ``141GB`` (141 x 10^9) or
    ``80GiB`` (80 x 2^30), in any case."""
    match = _BYTES.fullmatch(text.strip())
    if match is None:
        try:
            return human_int(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a size like 2097152, 2M, 141GB or 80GiB"
            ) from None
    number, suffix, binary = match.groups()
    power = _SUFFIXES.index(suffix.lower()) + 1
    return _scaled(text, number, (1024 if binary else 1000) ** power)


def human_count(n: int) -> str:
    """``8.03B``, ``12.35M``, ``48.1K``, ``900``: a count at the scale that shows its digits."""
    for scale, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up, in integers: ``cdiv(7, 4) == 2``, ``cdiv(8, 4) == 2``."""
    return -(-a // b)
