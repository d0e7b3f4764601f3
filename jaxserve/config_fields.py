"""Typed reads of a parsed ``config.json``: every field ``config.py`` reads goes through here.

transformers checks the types of the fields its config classes declare, but not those inside
``rope_parameters`` nor the fields a family's class does not know (``sliding_window`` on a
Llama, say): a ``factor`` of ``"abc"`` reached ``float()`` and ended start-up with a traceback
that named no field. Here a value of the wrong type is a ``ConfigError`` naming the field and
the value (``rope_parameters.factor must be a number, got 'abc'``).
"""

from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """A model directory or config.json that jaxserve cannot serve."""


class ConfigFields:
    """One object of config.json (``prefix`` names it in errors, e.g. ``rope_parameters.``).

    A field that is absent or null reads as ``default`` (``None`` for the ``optional_`` reads).
    """

    def __init__(self, raw: Any, prefix: str = "") -> None:
        if not isinstance(raw, dict):
            where = prefix.rstrip(".") or "config.json"
            raise ConfigError(f"{where} must be an object, got {raw!r:.80}")
        self.raw = raw
        self.prefix = prefix

    def __contains__(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def _error(self, key: str, kind: str, value: Any) -> ConfigError:
        return ConfigError(f"{self.prefix}{key} must be {kind}, got {value!r:.80}")

    def number(self, key: str, default: float) -> float:
        value = self.optional_number(key)
        return default if value is None else value

    def optional_number(self, key: str) -> float | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if not _is_number(value):
            raise self._error(key, "a number", value)
        return float(value)

    def integer(self, key: str, default: int) -> int:
        value = self.optional_integer(key)
        return default if value is None else value

    def required_integer(self, key: str) -> int:
        """An integer config.json must have (its range is checked by the config dataclass)."""
        value = self.optional_integer(key)
        if value is None:
            raise ConfigError(f"{self.prefix}{key} is missing; it must be an integer")
        return value

    def optional_integer(self, key: str) -> int | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if _is_number(value) and float(value).is_integer():
            return int(value)  # 4096.0 is 4096
        raise self._error(key, "an integer", value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._error(key, "true or false", value)
        return value

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self._error(key, "a string", value)
        return value

    def numbers(self, key: str) -> tuple[float, ...]:
        value = self.raw.get(key) or []
        if not isinstance(value, list) or not all(_is_number(x) for x in value):
            raise self._error(key, "a list of numbers", value)
        return tuple(float(x) for x in value)

    def integers(self, key: str) -> tuple[int, ...]:
        """A list of integers, or one integer (a list of one)."""
        value = self.raw.get(key)
        if value is None:
            return ()
        items = value if isinstance(value, list) else [value]
        if not all(_is_number(x) and float(x).is_integer() for x in items):
            raise self._error(key, "an integer or a list of integers", value)
        return tuple(int(x) for x in items)

    def strings(self, key: str) -> tuple[str, ...]:
        value = self.raw.get(key) or []
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise self._error(key, "a list of strings", value)
        return tuple(value)

    def section(self, key: str) -> ConfigFields:
        """A nested object (empty when absent)."""
        value = self.raw.get(key)
        return ConfigFields({} if value is None else value, f"{self.prefix}{key}.")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
