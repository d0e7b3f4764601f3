"""An encoder's residual add and LayerNorm in one pass (``triton``), its reference and dispatch."""
