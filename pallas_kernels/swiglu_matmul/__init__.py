"""The MLP's gate/up GEMM with SwiGLU in its epilogue, ``silu(x @ w_gate) * (x @ w_up)`` in one
kernel on Hopper (``mosaic_gpu``), its jnp semantics (``reference``) and its switch
(``dispatch``)."""
