"""Ragged paged attention over multi-head latent attention's latent cache (DeepSeek-V2/V3): the
pure-jnp reference (``reference``), the Pallas Triton kernel (``triton``), the Pallas Mosaic GPU
kernel for Hopper (``mosaic_gpu``) and the choice between them (``dispatch``), which the model
calls."""
