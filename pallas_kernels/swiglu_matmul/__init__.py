"""The MLP's first GEMM with its activation in the epilogue, on Hopper (``mosaic_gpu``): a
decoder's gate/up GEMM with SwiGLU, ``silu(x @ w_gate) * (x @ w_up)``, and an encoder's
intermediate GEMM with its bias and exact GELU, ``gelu(x @ w + b)``; their jnp semantics
(``reference``) and their switches (``dispatch``: ``JAXSERVE_SWIGLU_MATMUL``,
``JAXSERVE_GELU_MATMUL``)."""
