"""Decode-sized matmuls ``x[M, K] @ W`` bound by reading the weights: the pure-jnp reference
(``reference``), the Pallas Triton kernel (``triton``) and the choice of whether a step of a
given token count takes it (``dispatch``)."""
