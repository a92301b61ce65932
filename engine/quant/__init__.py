"""Quantized checkpoints (AWQ, GPTQ, GGUF): detected from their files (detect.py, no torch),
converted at load into the one layout of kernels/quant_layout.py (awq.py, gptq.py, gguf.py,
weights.py), held by quantized layers (model.py swaps them in: engine/layers/quant_linear.py).
docs/design.md, "Quantized weights"."""
