"""GEMMs with fp32 results from low-precision inputs (cuBLAS accumulates in fp32 anyway)."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms, compositions and reductions run in: promote(fp32, dtype) — fp32 for
    fp16, bf16 and fp32 inputs, float64 for float64 (docs/design.md §5)."""
    return torch.promote_types(dtype, torch.float32)


def mm_out(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` returned in ``dtype``, with fp32 accumulation.

    a, b: 2-D in the same (activation) dtype. When ``dtype`` is fp32 and the inputs are
    bf16/fp16 on CUDA, cuBLAS writes the fp32 accumulator directly (``out_dtype``), so the
    result is not rounded to 16 bits on the way; elsewhere the product is cast.
    """
    if a.dtype == dtype:
        return torch.mm(a, b)
    if dtype == torch.float32 and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # torch without mm.dtype
            pass
    return torch.mm(a, b).to(dtype)
