"""The grouped matmul of a mixture of experts' experts (``jax.lax.ragged_dot``'s semantics): the
pure-jnp reference (``reference``), the Pallas Triton kernel (``triton``) and the entry point
the models call, which picks the kernel or ``ragged_dot`` for the backend (``dispatch``)."""
