"""Every tunable of the PyTorch backend in one place: eps, dispatch thresholds, Triton blocks.

Block sizes are (BLOCK_*, num_warps, num_stages) per kernel. Under the Triton
interpreter (``TRITON_INTERPRET=1``, CPU CI) every autotuned kernel is pruned to
one small config: the interpreter cannot time configs, and small blocks keep it fast.
"""

from __future__ import annotations

import os

import triton

#: Norm clamp: g = m / max(n, EPS). Must equal ``shared_spec.compose.EPS`` (a test checks).
EPS = 1e-12

#: impl="auto" picks the eager tier when the output has fewer elements than this: for tiny
#: layers kernel launches dominate and the plain torch path is as fast.
FUSED_MIN_ELEMENTS = 1 << 16

#: Columns of d_in per step when the norm upcasts W to fp32 (CPU / eager path): bounds the
#: transient fp32 copy of W to d_out × NORM_CHUNK × 4 bytes.
NORM_CHUNK = 2048

#: Rows of W per block when the detached norm is computed: U = W Aᵀ exists for one block
#: at a time (fp32 NORM_ROW_CHUNK × r), so the norm's transient stays small for wide layers.
NORM_ROW_CHUNK = 8192

#: Forward composition: True = fused into the epilogue of the Triton ``h @ Bᵀ`` GEMM (the
#: adapter product ``lora`` never touches memory); False = cuBLAS ``h @ Bᵀ`` then the
#: one-pass elementwise compose kernel. The layer benchmark measures both.
COMPOSE_IN_GEMM_EPILOGUE = True


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (read at call time)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- forward: h @ Bᵀ GEMM with the DoRA epilogue (kernels/compose.py) -------------------------
def lora_gemm_configs() -> list[triton.Config]:
    """Autotune space of the epilogue GEMM (K = r is small: the kernel is bound by the base
    read and the y write, so wide N tiles and few stages). ``DORA_TORCH_AUTOTUNE=0`` keeps
    only the first config (the GPU tests set it: compiling five configs per shape dominated
    their run time)."""
    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "GROUP_M": 4}, num_warps=1)]
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=w, num_stages=st)
        for bm, bn, w, st in [
            (128, 128, 8, 3),
            (128, 256, 8, 3),
            (64, 256, 8, 3),
            (128, 128, 4, 4),
            (64, 128, 4, 4),
        ]
    ]
    return configs[:1] if os.environ.get("DORA_TORCH_AUTOTUNE", "1") == "0" else configs


#: Contraction block of the epilogue GEMM (over r); rounded down to r's next power of two,
#: at least 16 (tl.dot's minimum).
LORA_GEMM_BLOCK_K = 64

# ---- forward: elementwise compose (kernels/compose.py) ----------------------------------------
COMPOSE_BLOCK_M = 32
COMPOSE_BLOCK_N = 128
COMPOSE_WARPS = 4

# ---- backward: scale by g + reduce dm, dbias over tokens (kernels/backward.py) ----------------
BWD_BLOCK_M = 32
BWD_BLOCK_N = 128
BWD_WARPS = 4
#: Tokens each program reduces; partial sums are [cdiv(T, BWD_ROWS_PER_PROGRAM), d_out] fp32.
BWD_ROWS_PER_PROGRAM = 256

# ---- backward: dm for rows with zero magnitude when inner is recovered from y -----------------
ZERO_MAG_BLOCK_T = 32
ZERO_MAG_BLOCK_D = 64
ZERO_MAG_WARPS = 4

# ---- norm assembly from U = W Aᵀ and G = A Aᵀ (kernels/norm.py) -------------------------------
NORM_BLOCK_M = 32
NORM_BLOCK_R = 32
NORM_WARPS = 4
#: tl.dot precision for B·G in the norm assembly: "tf32x3" splits each fp32 operand into two
#: TF32 parts (three tensor-core products), ~fp32 accuracy; "ieee" is exact fp32 FMA (slow).
NORM_DOT_PRECISION = "tf32x3"


def interp_small(block: int, small: int = 16) -> int:
    """Shrink a block under the interpreter (each program is Python-slow, big tiles cost RAM)."""
    return min(block, small) if interpreting() else block
