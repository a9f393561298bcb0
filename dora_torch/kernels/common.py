"""Small helpers shared by the launchers."""

from __future__ import annotations

import torch

from .. import config


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for launch grids. Plain integer arithmetic: ``triton.cdiv`` became a
    ``constexpr_function`` (a few µs of host time per call, several calls per layer)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n (1 for n ≤ 1), like ``triton.next_power_of_2``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def dot_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels must feed tl.dot fp32 operands: under the interpreter bf16/fp16
    arithmetic is wrong (docs/design.md §7), so operands are upcast right after loading."""
    return config.interpreting() or dtype == torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 activations get IEEE fp32 dots (TF32 would be less accurate than cuBLAS fp32)."""
    return "ieee" if dtype == torch.float32 or config.interpreting() else "tf32"


#: The kernels index with int32 offsets (row · stride + col): every tensor they address must
#: span fewer elements than this.
MAX_KERNEL_SPAN = 2**31


def element_span(t: torch.Tensor) -> int:
    """Elements between a tensor's first and last addressed element, inclusive."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def check_launchable(*tensors: torch.Tensor) -> None:
    """The kernels can address these tensors: on CUDA (or the interpreter), int32-indexable."""
    for t in tensors:
        if t is None:
            continue
        if t.is_cpu and not config.interpreting():
            raise ValueError(
                "impl='fused' on CPU needs the Triton interpreter: set TRITON_INTERPRET=1 before "
                "importing dora_torch (or use impl='eager')"
            )
        # Contiguous tensors span numel() elements; an eager view spans at most its storage,
        # which settles the usual case without element_span's Python (column views of stacked
        # products). Traced code reads shapes and strides only.
        if t.is_contiguous():
            span = t.numel()
        elif torch.compiler.is_compiling():
            span = element_span(t)
        else:
            span = t.untyped_storage().nbytes() // t.element_size()
            if span >= MAX_KERNEL_SPAN:
                span = element_span(t)
        if span >= MAX_KERNEL_SPAN:
            raise ValueError(
                f"impl='fused' indexes with int32 offsets; a tensor of shape {tuple(t.shape)} "
                f"spans {span} elements (limit {MAX_KERNEL_SPAN}): split the tokens "
                "into smaller batches or use impl='eager'"
            )


def unit_stride(*vectors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Per-column vectors (magnitude, norm, bias, base_sq) as the kernels read them: with unit
    stride. A no-op for contiguous inputs; a strided view (e.g. a column of a matrix) is copied."""
    return tuple(None if v is None else v.contiguous() for v in vectors)
