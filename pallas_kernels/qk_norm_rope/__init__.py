"""Qwen3's and Gemma 3's per-head RMSNorm and rotary embedding of q or k in one pass over the
fused q/k/v product (``triton``), its semantics (``reference``), and when a step takes it
(``dispatch``)."""
