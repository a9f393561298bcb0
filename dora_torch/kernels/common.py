"""Small helpers shared by the launchers."""

from __future__ import annotations

import torch

from .. import config


def dot_fp32(dtype: torch.dtype) -> bool:
    """Whether kernels must feed tl.dot fp32 operands: under the interpreter bf16/fp16
    arithmetic is wrong (DESIGN §7), so operands are upcast right after loading."""
    return config.interpreting() or dtype == torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 activations get IEEE fp32 dots (TF32 would be less accurate than cuBLAS fp32)."""
    return "ieee" if dtype == torch.float32 or config.interpreting() else "tf32"


def check_launchable(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t is not None and t.device.type == "cpu" and not config.interpreting():
            raise ValueError(
                "impl='fused' on CPU needs the Triton interpreter: set TRITON_INTERPRET=1 before "
                "importing dora_torch (or use impl='eager')"
            )


def unit_stride(*vectors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Per-column vectors (magnitude, norm, bias, base_sq) as the kernels read them: with unit
    stride. A no-op for contiguous inputs; a strided view (e.g. a column of a matrix) is copied."""
    return tuple(None if v is None else v.contiguous() for v in vectors)
