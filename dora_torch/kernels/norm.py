"""Norm assembly from the factored terms (docs/design.md §2).

    n_i = sqrt(max(‖W_i‖² + 2s·Σ_j B_ij U_ij + s²·Σ_j (B G)_ij B_ij, 0))

with U = W Aᵀ [d_out, r] and G = A Aᵀ [r, r] (fp32, from GEMMs). Three ways
(``config.NORM_ASSEMBLY``):

- ``"kernel"``: ``_norm_assemble_kernel``, one program per block of rows: (B G) is formed tile
  by tile in registers and reduced at once, so B G is never written. The dots run as 3xTF32
  (``config.NORM_DOT_PRECISION``): fp32-level accuracy on tensor cores (IEEE fp32 dots cost
  134 µs at d_out = 8192, r = 384; 3xTF32 0.132 ms in run 8).
- ``"gemm"``: B G by one cuBLAS GEMM (an fp32 transient, like U), then ``_norm_rows_kernel``
  reduces each row in one pass. For a layer whose W is 16-bit (``bf16x3``, with
  ``config.NORM_GEMM_BF16X3``) the GEMM runs on bf16 tensor cores: each fp32 operand is split
  into two bf16 terms, x = hi + lo to 2⁻¹⁶ relative, and

      B G ≈ [B_hi | B_lo] · [[G_hi, G_lo], [G_hi, 0]]   ([rows, 2r] fp32, halves summed)

  drops only B_lo·G_lo: each entry within 3·2⁻¹⁶ of Σ_k |B_ik||G_kj| (the dropped product
  and the two split residuals, 2⁻¹⁶ each), below the 2⁻⁸ (bf16) or 2⁻¹¹ (fp16) rounding of
  the layer's output (a bf16 B has B_lo = 0 and the K = r half alone). Otherwise an fp32
  GEMM, whose accuracy follows ``torch.backends.cuda.matmul.allow_tf32`` (off by default:
  IEEE fp32).
- ``"pairs"``: the bf16x3 products of ``"gemm"`` (a 16-bit W only), formed tile by tile in
  ``_norm_pairs_kernel`` and reduced at once, as ``"kernel"`` does: B·G never reaches memory
  (at r = 384 the gemm writes and the rows kernel reads a [rows, 2r] fp32 B·G, ~2 GB per
  8-layer step), and one launch replaces the GEMM and the rows kernel. The same bf16 products
  as ``"gemm"``, summed into one fp32 accumulator instead of two halves added after, and
  only those with G's blocks on and above its diagonal: Σ_jk B_ij G_kj B_ik is symmetric in
  j and k, so the blocks below count through their mirror images.
- ``"auto"`` (``assembly_method``): for large r, "pairs" for a 16-bit W (bf16x3) and "gemm"
  for an fp32 W with IEEE fp32 matmuls, else "kernel": the accuracy never depends on a global
  flag.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import config
from ..matmul import mm_out
from .common import cdiv, check_launchable, dot_fp32, next_pow2, unit_stride
from .launch import Launcher
from .workspace import ticket_counters


@triton.jit
def _norm_assemble_kernel(
    base_sq_ptr,
    u_ptr,
    lb_ptr,
    g_ptr,
    out_ptr,
    N,
    R,
    stride_un,
    stride_ur,
    stride_bn,
    stride_br,
    stride_gr,
    stride_gc,
    s,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Scalars arrive as fp64 when Inductor launches the kernel: keep the math in fp32.
    s = tl.cast(s, tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < N
    cross = tl.zeros((BLOCK_M,), dtype=tl.float32)
    gram = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for j0 in range(0, R, BLOCK_R):
        js = j0 + tl.arange(0, BLOCK_R)
        mj = mask_m[:, None] & (js < R)[None, :]
        bj = tl.load(
            lb_ptr + rows[:, None] * stride_bn + js[None, :] * stride_br, mask=mj, other=0.0
        ).to(tl.float32)
        uj = tl.load(
            u_ptr + rows[:, None] * stride_un + js[None, :] * stride_ur, mask=mj, other=0.0
        ).to(tl.float32)
        cross += tl.sum(bj * uj, axis=1)
        bg = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, R, BLOCK_R):
            ks = k0 + tl.arange(0, BLOCK_R)
            bk = tl.load(
                lb_ptr + rows[:, None] * stride_bn + ks[None, :] * stride_br,
                mask=mask_m[:, None] & (ks < R)[None, :],
                other=0.0,
            ).to(tl.float32)
            gk = tl.load(
                g_ptr + ks[:, None] * stride_gr + js[None, :] * stride_gc,
                mask=(ks < R)[:, None] & (js < R)[None, :],
                other=0.0,
            ).to(tl.float32)
            bg = tl.dot(bk, gk, bg, input_precision=DOT_PRECISION)
        gram += tl.sum(bg * bj, axis=1)
    base_sq = tl.load(base_sq_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
    sq = base_sq + 2.0 * s * cross + s * s * gram
    tl.store(out_ptr + rows, tl.sqrt(tl.maximum(sq, 0.0)), mask=mask_m)


_launch_norm_assemble = Launcher(_norm_assemble_kernel)


#: The values of ``assemble_norm``'s ``method`` (and ``config.NORM_ASSEMBLY``).
ASSEMBLY_METHODS = ("kernel", "gemm", "pairs", "auto")


def assembly_method(r: int, bf16x3: bool = False) -> str:
    """The method ``"auto"`` picks for rank r (module docstring); ``bf16x3``: the layer's W is
    16-bit, so the gemm's operands may be split into bf16 terms, and "pairs" forms those
    products in registers instead of writing B·G (0.61-0.88× the gemm at d_out 4096-14336,
    1.10× at 1024; run 164, benchmarks/NOTES.md session 37)."""
    pairs = bf16x3 and config.NORM_GEMM_BF16X3
    exact = pairs or not torch.backends.cuda.matmul.allow_tf32
    if not exact or r < config.NORM_GEMM_MIN_RANK:
        return "kernel"
    return "pairs" if pairs else "gemm"


def resolve_method(method: str | None, r: int, bf16x3: bool) -> str:
    """The assembly ("kernel", "gemm" or "pairs") a layer of rank r runs: ``method``, or
    ``config.NORM_ASSEMBLY`` when None, with "auto" resolved by ``assembly_method``. "pairs"
    needs a 16-bit layer (``bf16x3``): asked for explicitly elsewhere it raises; set in config
    it leaves such a layer to "auto"."""
    explicit = method is not None
    method = method if explicit else config.NORM_ASSEMBLY
    if method not in ASSEMBLY_METHODS:
        raise ValueError(f"method must be one of {ASSEMBLY_METHODS}; got {method!r}")
    if method == "pairs" and not bf16x3:
        if explicit:
            raise ValueError(
                "method='pairs' forms B·G from bf16 pairs, within the error bound of a 16-bit "
                "layer only: it needs bf16x3=True (a 16-bit W)"
            )
        method = "auto"
    return assembly_method(r, bf16x3) if method == "auto" else method


def assemble_norm(
    base_sq: torch.Tensor,
    U: torch.Tensor,
    lora_B: torch.Tensor,
    G: torch.Tensor,
    scaling: float,
    *,
    method: str | None = None,
    bf16x3: bool = False,
    pairs_blocks: tuple | None = None,
) -> torch.Tensor:
    """n [d_out] fp32 from base_sq [d_out] fp32, U [d_out, r] fp32, lora_B [d_out, r] (any
    float dtype), G [r, r] fp32. ``method``: "kernel", "gemm", "pairs" or "auto"
    (default ``config.NORM_ASSEMBLY``); ``bf16x3``: the layer's W is 16-bit, and the gemm forms
    B·G from bf16 products when ``config.NORM_GEMM_BF16X3`` (see the module docstring);
    "pairs" always does, so it needs ``bf16x3`` (``config.NORM_ASSEMBLY = "pairs"`` leaves
    other layers to "auto"; it reads only G's blocks on and above the diagonal, so G must be
    symmetric, as A·Aᵀ is). ``pairs_blocks``: the pairs kernel's (BLOCK_M, BLOCK_R, warps,
    stages) instead of ``config.NORM_PAIRS`` (benchmarks)."""
    N, R = lora_B.shape
    method = resolve_method(method, R, bf16x3)
    check_launchable(U)
    (base_sq,) = unit_stride(base_sq)
    out = torch.empty(N, dtype=torch.float32, device=U.device)
    if N == 0:
        return out
    if method == "gemm":
        split = bf16x3 and config.NORM_GEMM_BF16X3
        return _assemble_by_gemm(base_sq, U, lora_B, G, scaling, out, split)
    if method == "pairs":
        return _assemble_by_pairs(base_sq, U, lora_B, G, scaling, out, pairs_blocks)
    wide = R >= config.NORM_WIDE_RANK
    bm, br, warps = config.NORM_KERNEL_BLOCKS_WIDE if wide else config.NORM_KERNEL_BLOCKS
    bm = config.interp_small(bm)
    br = max(16, min(br, next_pow2(R)))
    _launch_norm_assemble(
        (cdiv(N, bm),),
        base_sq,
        U,
        lora_B,
        G,
        out,
        N,
        R,
        U.stride(0),
        U.stride(1),
        lora_B.stride(0),
        lora_B.stride(1),
        G.stride(0),
        G.stride(1),
        float(scaling),
        BLOCK_M=bm,
        BLOCK_R=br,
        DOT_PRECISION="ieee" if config.interpreting() else config.NORM_DOT_PRECISION,
        num_warps=warps,
    )
    return out


@triton.jit
def _norm_rows_kernel(
    base_sq_ptr,
    u_ptr,
    bg_ptr,
    lb_ptr,
    out_ptr,
    N,
    R,
    stride_un,
    stride_bgn,
    stride_bn,
    stride_br,
    s,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """n_i = sqrt(max(base_sq_i + Σ_j B_ij (2s·U_ij + s²·(BG)_ij), 0)) for a block of rows
    (U and BG fp32 with unit column stride; ``SPLIT``: BG is [rows, 2R], (BG)_ij the sum of
    columns j and R + j)."""
    # Scalars arrive as fp64 when Inductor launches the kernel: keep the math in fp32.
    s = tl.cast(s, tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < N
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for j0 in range(0, R, BLOCK_R):
        js = j0 + tl.arange(0, BLOCK_R)
        mask = mask_m[:, None] & (js < R)[None, :]
        b = tl.load(
            lb_ptr + rows[:, None] * stride_bn + js[None, :] * stride_br, mask=mask, other=0.0
        ).to(tl.float32)
        u = tl.load(u_ptr + rows[:, None] * stride_un + js[None, :], mask=mask, other=0.0)
        bg_tile = bg_ptr + rows[:, None] * stride_bgn + js[None, :]
        bg = tl.load(bg_tile, mask=mask, other=0.0)
        if SPLIT:
            bg += tl.load(bg_tile + R, mask=mask, other=0.0)
        acc += tl.sum(b * (2.0 * s * u + s * s * bg), axis=1)
    base_sq = tl.load(base_sq_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, tl.sqrt(tl.maximum(base_sq + acc, 0.0)), mask=mask_m)


_launch_norm_rows = Launcher(_norm_rows_kernel)


@triton.jit
def finish_norm_rows(
    share, part_ptr, tickets_ptr, base_sq_ptr, out_ptr, rows, mask_m, pid_m, pid_j, N
):  # fmt: skip
    """The finisher of a norm kernel whose row block is split over axis 1 of the grid
    (kernels/workspace.py): store this program's ``share`` of n² for ``rows`` in part
    [programs along axis 1, N] and take a ticket; the last program of the row block adds the
    shares in order, then ‖W‖² from ``base_sq_ptr``, writes n = sqrt(max(·, 0)) and sets its
    counter back to zero."""
    blocks = tl.num_programs(1)
    tl.store(part_ptr + pid_j * N + rows, share, mask=mask_m)
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr + pid_m, 1, sem="acq_rel")
    if ticket == blocks - 1:
        acc = tl.zeros_like(share)
        for j in range(0, blocks):
            acc += tl.load(part_ptr + j * N + rows, mask=mask_m, other=0.0)
        acc = tl.load(base_sq_ptr + rows, mask=mask_m, other=0.0).to(tl.float32) + acc
        tl.store(out_ptr + rows, tl.sqrt(tl.maximum(acc, 0.0)), mask=mask_m)
        tl.store(tickets_ptr + pid_m, 0)


@triton.jit
def _pairs_block(bg, kb, lhs_ptr, rhs_ptr, rows, mask_m, js, mask_j, R, stride_ln, stride_rk,
                 BLOCK_R: tl.constexpr, SPLIT_B: tl.constexpr,
                 DOT_FP32: tl.constexpr):  # fmt: skip
    """bg + lhs[rows, ks] · (G_hi + G_lo)[ks, js] for K block ``kb`` (ks = kb·BLOCK_R…), from
    rhs rows ks ([G_hi | G_lo]); with ``SPLIT_B`` also B_lo's columns R + ks against the same
    G_hi tile (the stacked rhs' rows R + k repeat it beside zeros). Products of bf16 values,
    accumulated in fp32."""
    ks = kb * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_k = ks < R
    mask_mk = mask_m[:, None] & mask_k[None, :]
    at = lhs_ptr + rows[:, None] * stride_ln + ks[None, :]
    lhs = tl.load(at, mask=mask_mk, other=0.0)
    g_at = rhs_ptr + ks[:, None] * stride_rk + js[None, :]
    mask_kj = mask_k[:, None] & mask_j[None, :]
    hi = tl.load(g_at, mask=mask_kj, other=0.0)
    lo = tl.load(g_at + R, mask=mask_kj, other=0.0)
    if DOT_FP32:  # the interpreter (common.dot_fp32): exact upcasts of bf16 values
        lhs, hi, lo = lhs.to(tl.float32), hi.to(tl.float32), lo.to(tl.float32)
    # "ieee" matters only to those fp32 upcasts; bf16 products are exact either way
    bg = tl.dot(lhs, hi, bg, input_precision="ieee")
    bg = tl.dot(lhs, lo, bg, input_precision="ieee")
    if SPLIT_B:
        lhs_lo = tl.load(at + R, mask=mask_mk, other=0.0)
        if DOT_FP32:
            lhs_lo = lhs_lo.to(tl.float32)
        bg = tl.dot(lhs_lo, hi, bg, input_precision="ieee")
    return bg


@triton.jit
def _norm_pairs_kernel(
    base_sq_ptr,
    u_ptr,
    lhs_ptr,
    rhs_ptr,
    lb_ptr,
    part_ptr,
    tickets_ptr,
    out_ptr,
    N,
    R,
    stride_un,
    stride_ln,
    stride_rk,
    stride_bn,
    stride_br,
    s,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_R: tl.constexpr,
    SPLIT_B: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """n_i = sqrt(max(base_sq_i + Σ_j B_ij (2s·U_ij + s²·(BG)_ij), 0)), program (i, J) taking
    row block i and column block J of the sum, with (BG)_ij = Σ_k lhs_ik (rhs_kj + rhs_k(R+j)):
    ``bg_bf16x3``'s operands (lhs [N, R] bf16 B and rhs [R, 2R] [G_hi | G_lo], or with
    ``SPLIT_B`` lhs [N, 2R] [B_hi | B_lo] and rhs [2R, 2R] [[G_hi, G_lo], [G_hi, 0]], of
    which only the first R rows are read; all bf16 with unit column strides), the products
    accumulated in fp32 in one tile. U is fp32 with unit column stride;
    lb is B as the layer holds it (the reduction's own factor).

    G = A·Aᵀ is symmetric, so Σ_jk B_ij G_kj B_ik is the same sum with j and k swapped: over
    column blocks J and K it is Σ_J T_JJ + 2·Σ_{J<K} T_JK, T_JK = Σ_{j∈J, k∈K} B_ij G_kj B_ik.
    Program J forms its diagonal block at half weight and the K blocks after it at full
    weight, and doubles its s² term (the scalings by ½ and 2 are exact): 21 of 36 K blocks at
    r = 384 with 64-wide blocks. ``SPLIT_R`` (more than one column block): each program
    stores its partial [rows] in part [col blocks, N] and takes a ticket; the last of a row
    block adds the partials up in column order (kernels/workspace.py) and writes n."""
    # Scalars arrive as fp64 when Inductor launches the kernel: keep the math in fp32.
    s = tl.cast(s, tl.float32)
    pid_m, pid_j = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rows < N
    js = pid_j * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_j = js < R
    mask = mask_m[:, None] & mask_j[None, :]
    # the reduction's factors first: their loads are in flight during the products
    b = tl.load(
        lb_ptr + rows[:, None] * stride_bn + js[None, :] * stride_br, mask=mask, other=0.0
    ).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_un + js[None, :], mask=mask, other=0.0)
    bg = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    bg = _pairs_block(bg, pid_j, lhs_ptr, rhs_ptr, rows, mask_m, js, mask_j, R, stride_ln,
                      stride_rk, BLOCK_R, SPLIT_B, DOT_FP32)  # fmt: skip
    bg = bg * 0.5
    for kb in range(pid_j + 1, tl.cdiv(R, BLOCK_R)):
        bg = _pairs_block(bg, kb, lhs_ptr, rhs_ptr, rows, mask_m, js, mask_j, R, stride_ln,
                          stride_rk, BLOCK_R, SPLIT_B, DOT_FP32)  # fmt: skip
    acc = tl.sum(b * (2.0 * s * u + 2.0 * s * s * bg), axis=1)
    if SPLIT_R:
        finish_norm_rows(
            acc, part_ptr, tickets_ptr, base_sq_ptr, out_ptr, rows, mask_m, pid_m, pid_j, N
        )
    else:
        base_sq = tl.load(base_sq_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, tl.sqrt(tl.maximum(base_sq + acc, 0.0)), mask=mask_m)


_launch_norm_pairs = Launcher(_norm_pairs_kernel)


@triton.jit
def _round_bf16(x):
    """x (fp32) rounded to the nearest bf16 value, ties to even, still as fp32: on the bits (add
    0x7FFF plus the lsb kept, clear the low 16 bits), so the Triton interpreter (whose casts
    truncate) and the GPU round alike. For finite, normal x (B and G of a layer): the
    interpreter's casts of subnormals differ from the GPU's."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _split_bf16_kernel(x_ptr, out_ptr, numel, cols, STACKED: tl.constexpr, BLOCK: tl.constexpr):
    """out[i, :cols] = hi = bf16(x[i]), out[i, cols:] = bf16(x[i] − hi), both rounded to
    nearest even, for a contiguous x [rows, cols] and out [rows, 2·cols]; ``STACKED``: out is
    [2·rows, 2·cols] and its rows below ``rows`` are [hi | 0]."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    x = tl.load(x_ptr + i, mask=mask, other=0.0).to(tl.float32)
    hi = _round_bf16(x)
    lo = _round_bf16(x - hi)  # x − hi is exact in fp32
    at = out_ptr + (i // cols) * (2 * cols) + i % cols
    tl.store(at, hi.to(tl.bfloat16), mask=mask)  # exact casts: both are bf16 values already
    tl.store(at + cols, lo.to(tl.bfloat16), mask=mask)
    if STACKED:
        below = at + numel * 2  # numel · 2 = rows · 2·cols
        tl.store(below, hi.to(tl.bfloat16), mask=mask)
        tl.store(below + cols, tl.zeros_like(lo).to(tl.bfloat16), mask=mask)


_launch_split_bf16 = Launcher(_split_bf16_kernel)


def split_bf16(x: torch.Tensor, *, stacked: bool = False) -> torch.Tensor:
    """[hi | lo]: x [rows, cols] as one bf16 [rows, 2·cols] tensor, x = hi + lo to 2⁻¹⁶
    relative (lo = 0 for a bf16 x); ``stacked``: [[hi, lo], [hi, 0]], [2·rows, 2·cols] (the
    right operand of ``bg_bf16x3`` for a B that is split too). One launch. A Triton kernel,
    not torch ops: Inductor may keep a fused ``x.to(bf16)`` unrounded in fp32
    (``emulate_precision_casts`` off), and lo would then vanish in compiled graphs."""
    check_launchable(x)
    x = x.contiguous()
    rows, cols = x.shape
    out_rows = 2 * rows if stacked else rows
    out = torch.empty(out_rows, 2 * cols, dtype=torch.bfloat16, device=x.device)
    if x.numel():
        block = config.SPLIT_BF16_BLOCK
        grid = (cdiv(x.numel(), block),)
        _launch_split_bf16(grid, x, out, x.numel(), cols, STACKED=stacked, BLOCK=block, num_warps=4)
    return out


def bg_bf16x3(lora_B: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """[B_hi | B_lo]·[[G_hi, G_lo], [G_hi, 0]] as [rows, 2r] fp32 (module docstring): bf16
    products accumulated in fp32 (cuBLAS on CUDA; fp32 arithmetic on exact bf16 values
    elsewhere, the same sums)."""
    lhs, rhs = _pair_operands(lora_B, G)
    if lhs.is_cuda:
        return mm_out(lhs, rhs, torch.float32)
    return lhs.float() @ rhs.float()


def _assemble_by_gemm(base_sq, U, lora_B, G, scaling, out, split: bool):
    """The ``"gemm"`` assembly: one cuBLAS GEMM for B·G (bf16x3 with ``split``), then one
    row-reduction pass."""
    N, R = lora_B.shape
    U = U.contiguous()
    BG = bg_bf16x3(lora_B, G) if split else torch.mm(lora_B.float(), G.float())
    bm = config.interp_small(config.NORM_ROWS_BLOCK_M)
    br = max(16, min(config.NORM_ROWS_BLOCK_R, next_pow2(R)))
    _launch_norm_rows(
        (cdiv(N, bm),),
        base_sq,
        U,
        BG,
        lora_B,
        out,
        N,
        R,
        U.stride(0),
        BG.stride(0),
        lora_B.stride(0),
        lora_B.stride(1),
        float(scaling),
        SPLIT=split,
        BLOCK_M=bm,
        BLOCK_R=br,
        num_warps=config.NORM_ROWS_WARPS,
    )
    return out


def _pair_operands(lora_B: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``bg_bf16x3``'s operands: (B, [G_hi | G_lo]) for a bf16 B, else ([B_hi | B_lo],
    [[G_hi, G_lo], [G_hi, 0]])."""
    if lora_B.dtype == torch.bfloat16:
        return lora_B, split_bf16(G)
    return split_bf16(lora_B), split_bf16(G, stacked=True)


def _assemble_by_pairs(base_sq, U, lora_B, G, scaling, out, blocks=None):
    """The ``"pairs"`` assembly: G (and a non-bf16 B) split into bf16 pairs, then one kernel
    over row blocks × column blocks of the sum (the column blocks give small layers enough
    programs). ``blocks``: (BLOCK_M, BLOCK_R, warps, stages), default ``config.NORM_PAIRS``."""
    N, R = lora_B.shape
    U = U.contiguous()
    lhs, rhs = _pair_operands(lora_B, G)
    lhs = lhs.contiguous()
    check_launchable(lhs)  # [N, 2r] for a split B: twice U's elements
    bm, br, warps, stages = config.NORM_PAIRS if blocks is None else blocks
    bm = config.interp_small(bm)
    br = max(16, min(config.interp_small(br), next_pow2(R)))
    grid = (cdiv(N, bm), cdiv(R, br))
    split = grid[1] > 1
    if split:
        part = torch.empty((grid[1], N), dtype=torch.float32, device=U.device)
        tickets = ticket_counters(U.device, grid[0])
    else:  # placeholders the kernel never reads
        part = tickets = out
    _launch_norm_pairs(
        grid,
        base_sq,
        U,
        lhs,
        rhs,
        lora_B,
        part,
        tickets,
        out,
        N,
        R,
        U.stride(0),
        lhs.stride(0),
        rhs.stride(0),
        lora_B.stride(0),
        lora_B.stride(1),
        float(scaling),
        BLOCK_M=bm,
        BLOCK_R=br,
        SPLIT_R=split,
        SPLIT_B=lhs.shape[1] != R,
        DOT_FP32=dot_fp32(lhs.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return out
