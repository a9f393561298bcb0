"""Which tier runs a call (docs/design.md §6): the rule, in one function.

- ``"fused"``: Triton compose / backward kernels around cuBLAS GEMMs. On CUDA for fp16,
  bf16 and fp32 activations; on CPU only through the Triton interpreter (CI).
- ``"eager"``: the same factored algorithm in plain torch ops (fp32 norm and composition).

``impl="auto"`` → fused on CUDA unless the dtype is unsupported or the layer is tiny
(fewer than ``config.FUSED_MIN_ELEMENTS`` output elements, where launches dominate);
eager everywhere else. Inference vs training needs no separate tier: without gradients
the fused forward saves nothing, and modules pass their cached norm (so g is not recomputed).
"""

from __future__ import annotations

import logging

import torch

from . import checks, config
from .kernels.common import MAX_KERNEL_SPAN

logger = logging.getLogger("dora_torch")

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def resolve_impl(impl: str, x: torch.Tensor, d_out: int) -> str:
    """The tier ("fused" or "eager") that ``impl`` resolves to for input x [..., d_in]."""
    checks.check_impl(impl)
    if impl == "eager":
        chosen = "eager"
    elif impl == "fused":
        if x.dtype not in FUSED_DTYPES:
            raise TypeError(f"impl='fused' supports x of dtype {FUSED_DTYPES}; got {x.dtype}")
        if not x.is_cuda and not config.interpreting():
            raise ValueError(
                f"impl='fused' on {x.device} needs CUDA or the Triton interpreter "
                "(set TRITON_INTERPRET=1 before importing dora_torch); use impl='eager'"
            )
        chosen = "fused"
    else:
        tokens = x.numel() // max(x.shape[-1], 1)
        big = tokens * d_out >= config.FUSED_MIN_ELEMENTS
        # Beyond int32 offsets (kernels/common.MAX_KERNEL_SPAN) only the eager tier is safe.
        fits = max(tokens * d_out, x.numel()) < MAX_KERNEL_SPAN
        ok = x.is_cuda and x.dtype in FUSED_DTYPES and big and fits
        chosen = "fused" if ok else "eager"
    if not torch.compiler.is_compiling() and logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "dora_linear: impl=%s -> %s (x %s %s %s)",
            impl,
            chosen,
            tuple(x.shape),
            x.dtype,
            x.device,
        )
    return chosen
