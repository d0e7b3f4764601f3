"""The device kernels of jaxserve, one folder per operation, each with its pure-jnp reference
(``reference.py``, the same signature: the tests compare every kernel against it) beside its
Pallas kernels, and a ``dispatch`` module that picks the path for the backend where there is a
choice: ``ragged_paged_attention`` (Mosaic GPU, Pallas Triton, Mosaic TPU), ``mla`` (multi-head
latent attention over its latent cache: the reference), ``grouped_matmul`` (a mixture of
experts' experts: Pallas Triton or ``jax.lax.ragged_dot``) and ``skinny_matmul`` (decode-sized
matmuls: Pallas Triton); ``kv_cache`` holds what the paged cache stores and how the models
write it. The models import the operation modules directly; nothing here imports jaxserve.
"""
