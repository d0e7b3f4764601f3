"""A ``Batch`` of whole sequences over contiguous pages, for code that runs the model outside
the runner: the fixture scripts (``scripts/make_spec_fixtures.py``), tests and offline
evaluation. Sequence s owns pages [s * pages_per_seq, (s + 1) * pages_per_seq); each brings
its new tokens and the position of the first, the tokens before it already in its pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jaxserve.models.batch import Batch


def sequences_batch(
    sequences: Sequence[tuple[Sequence[int], int]],  # (new token ids, first one's position)
    page_size: int,
    pages_per_seq: int,
) -> Batch:
    """The step that appends each sequence's tokens at its positions; ``logits_indices`` is
    each sequence's last new row. A sequence past its pages is a ``ValueError``."""
    ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    kv_lens: list[int] = []
    cu = [0]
    for s, (tokens, start) in enumerate(sequences):
        end = start + len(tokens)
        if not tokens or start < 0 or end > page_size * pages_per_seq:
            raise ValueError(
                f"sequence {s}: positions [{start}, {end}) must be non-empty and within "
                f"page_size * pages_per_seq = {page_size * pages_per_seq}"
            )
        pos = np.arange(start, end, dtype=np.int32)
        ids.extend(tokens)
        positions.append(pos)
        slots.append(s * pages_per_seq * page_size + pos)
        kv_lens.append(end)
        cu.append(cu[-1] + len(tokens))
    num_seqs = len(sequences)
    pages = np.arange(num_seqs * pages_per_seq, dtype=np.int32).reshape(num_seqs, pages_per_seq)
    return Batch(
        input_ids=jnp.asarray(ids, jnp.int32),
        positions=jnp.asarray(np.concatenate(positions)),
        slot_mapping=jnp.asarray(np.concatenate(slots)),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        page_indices=jnp.asarray(pages),
        cu_q_lens=jnp.asarray(cu, jnp.int32),
        num_seqs=jnp.asarray([num_seqs], jnp.int32),
        logits_indices=jnp.asarray(np.asarray(cu[1:]) - 1, jnp.int32),
    )
