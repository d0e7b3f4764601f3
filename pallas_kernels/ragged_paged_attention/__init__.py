"""Ragged paged attention over a paged KV cache: the pure-jnp reference (``reference``), the
Pallas kernels (``mosaic_gpu`` for Hopper, ``triton`` before it, ``tpu``), the merge of a
KV-split launch's partial results (``splits``) and the entry point the models call, which
picks the kernel for the backend (``dispatch``)."""
