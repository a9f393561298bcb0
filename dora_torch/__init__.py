"""dora_torch — DoRA for PyTorch with a factored norm and fused Triton kernels."""
