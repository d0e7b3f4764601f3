"""The shape buckets of every compiled program, computed once from the engine's settings.

A step of T tokens runs padded to the smallest token bucket that holds it (powers of two from
``MIN_TOKEN_BUCKET`` up to ``max_num_batched_tokens``), with S = min(T, the largest sequence
bucket) sequence rows, each with a page table of ``pages_per_seq`` entries. ``ModelRunner``
makes one ``Buckets`` and hands it to ``InputBuilder`` (which pads each step to it) and
``StepPrograms`` (which compiles one program per bucket); ``capacity.py`` plans the memory of
the largest. Plain Python: no numpy, no jax.
"""

from __future__ import annotations

import dataclasses
import math

from jaxserve.units import cdiv

MIN_TOKEN_BUCKET = 16


def next_power_of_2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def token_buckets_for(max_num_batched_tokens: int) -> list[int]:
    """Padded token counts of the compiled steps: powers of two from 16 up."""
    top = max(next_power_of_2(max_num_batched_tokens), MIN_TOKEN_BUCKET)
    return [1 << i for i in range(4, top.bit_length())]


@dataclasses.dataclass(frozen=True)
class Buckets:
    token_buckets: tuple[int, ...]  # ascending
    max_seq_bucket: int  # the most sequence rows of any step
    pages_per_seq: int  # entries of a sequence's page table: max_model_len in blocks

    @classmethod
    def of(
        cls, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int
    ) -> Buckets:
        return cls(
            token_buckets=tuple(token_buckets_for(max_num_batched_tokens)),
            max_seq_bucket=next_power_of_2(max_num_seqs),
            pages_per_seq=cdiv(max_model_len, block_size),
        )

    def token_bucket(self, num_tokens: int) -> int:
        """The smallest token bucket that holds ``num_tokens``."""
        for bucket in self.token_buckets:
            if bucket >= num_tokens:
                return bucket
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.token_buckets[-1]}")

    def seq_bucket(self, token_bucket: int) -> int:
        """The sequence rows of a step in ``token_bucket``."""
        return min(token_bucket, self.max_seq_bucket)
