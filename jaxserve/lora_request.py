"""``LoRARequest``: which adapter a request runs with, as vLLM spells it.

Made by the user of ``LLM.generate(..., lora_request=...)`` and by the server from the adapters
it serves (``--lora-modules``, ``/v1/load_lora_adapter``); read by the engine (the adapter's
slot, the prefix cache's keys) and the runner's slots (``runner/lora_slots.py``), so it lives
below all three, beside ``sampling_params.py``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter by name, id and directory. ``lora_int_id`` (>= 1) is its identity: two
    requests with one id run the same weights and share prefix-cache blocks; an adapter replaced
    in place gets a new id."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id} must be at least 1")
        if not self.lora_path:
            raise ValueError(f"lora_path of adapter {self.lora_name!r} must not be empty")

    @property
    def cache_key(self) -> str:
        """What the prefix cache's block hashes take in, so no two adapters share blocks."""
        return f"lora:{self.lora_int_id}"
