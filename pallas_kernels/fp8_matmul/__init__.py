"""fp8 GEMM for decode-sized steps on Hopper: fp8 weights ``[N, K]`` read at the bandwidth
(``mosaic_gpu``), its jnp semantics (``reference``) and its switch (``dispatch``)."""
