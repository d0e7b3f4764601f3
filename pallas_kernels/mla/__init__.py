"""Ragged paged attention over multi-head latent attention's latent cache (DeepSeek-V2/V3): the
pure-jnp reference (``reference``), which every backend runs until a Pallas kernel takes the
latent layout."""
