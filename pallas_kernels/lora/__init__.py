"""The LoRA adapters' per-token product ``x @ A[slot] @ B[slot]`` over a step's tokens, each
token with its own adapter slot (0: none): the pure-jnp reference (``reference``, the dense
one-hot product the model used first), the Pallas Triton grouped (segmented) kernel
(``triton``, Punica's SGMV shrink and expand) and the choice between them (``dispatch``)."""
