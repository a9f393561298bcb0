"""Triton kernels and their launchers (one file per job).

- compose.py:  forward composition, fused into the ``h @ Bᵀ`` GEMM epilogue or elementwise
- backward.py: scale by g + token reduction of dm / dbias; dm of zero-magnitude rows
- norm.py:     norm assembly from U = W Aᵀ and G = A Aᵀ

Launchers take 2-D tensors with any strides, never sync with the host and never copy
large tensors.
"""
