"""Loading the weights: a safetensors checkpoint read by several threads at once
(``checkpoint_reader``), each tensor converted to its field on the device (``field_conversion``)
and assembled into ``layers.Weights`` (``checkpoint_loader``), pre-quantized checkpoints' tensors
(``quant_checkpoint``), the progress lines (``load_progress``), and random weights in the same
architecture (``dummy``). What to read comes from the family's weight tables (``families/``)."""
