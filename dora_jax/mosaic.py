"""Pallas Mosaic GPU kernels (Hopper: TMA copies, wgmma) for DoRA, and their launchers.

Three kernels: the compose fused into the LoRA product (docs/design.md §6.4), and two
cotangent passes built on one kernel body (``cotangent_kernel``, after the compose): the
backward's scale-and-reduce of one layer (``scale_reduce``, §4) and of a SwiGLU pair of DoRA
layers (``swiglu_backward``, §4.1).

The compose:

    y[t, j] = g[j] · (base[t, j] + s · Σ_k h[t, k] b[k, j]) + bias[j]

with base = x·K and h = x·a from XLA GEMMs in the activation dtype (bf16 or f16). Each program
owns one [tile_m, tile_n] tile of y:

  1. it starts TMA copies of its base tile, and of g and bias over its columns, so they land
     while the tensor cores work;
  2. ``emit_pipeline`` walks the rank in steps of tile_k (TMA into swizzled SMEM, one wgmma
     per step into an f32 accumulator in registers; ``MosaicConfig.compose_wgmma_in_flight``
     lets one wgmma run on while the next step's is issued);
  3. the epilogue forms g ⊙ (base + s·acc) + bias in f32, rounds once into the base tile's
     SMEM and stores it with TMA. h·b never reaches HBM; base is read once and y written once.

Shapes: the kernel tiles tokens and d_out exactly (``compose_supported``: tokens a multiple
of tile_m, d_out of tile_n; every projection of an LLM at batch × sequence lengths that are
multiples of 64). The rank is zero-padded to a multiple of tile_k (16, 32 or 64) here, at the
cost of copying h and b, which are small. Other shapes, f32 and f64 take the XLA path
(``config.resolve_impl``).

Off the GPU the kernel runs under Pallas' GPU interpreter (``interpret=True``), which checks
the same program on the CPU; it does not model layouts, so row vectors are loaded with an
explicit wgmma-column layout only when compiled. ``tests/jax/test_mosaic.py`` also lowers
every kernel for CUDA on the CPU, which catches layout and tiling errors without a GPU.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .config import DEFAULT_MOSAIC, MosaicConfig

#: Activation dtypes the wgmma kernels take (f32 keeps XLA's HIGHEST-precision dots).
MOSAIC_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# jax 0.10 needs ``plgpu.load``'s index argument; 0.11 deprecates it (index the ref instead).
_LOAD_NEEDS_INDEX = (
    inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty
)


def compose_supported(tokens: int, d_out: int, dtype, config: MosaicConfig = DEFAULT_MOSAIC):
    """Whether ``compose`` takes this shape and activation dtype (module docstring)."""
    return (
        jnp.dtype(dtype) in MOSAIC_DTYPES
        and tokens > 0
        and tokens % config.compose_tile_m == 0
        and d_out % config.compose_tile_n == 0
    )


def _rank_tile(rank: int) -> int:
    """The wgmma contraction step for rank r: 64 (a 128-byte swizzled row of 16-bit values),
    or the smallest of 16 and 32 that holds a small rank."""
    for tile in (16, 32):
        if rank <= tile:
            return tile
    return 64


def _swizzled(cols: int, itemsize: int) -> tuple:
    """SMEM transforms wgmma and TMA want for a tile with ``cols`` 16-bit columns."""
    swizzle = plgpu.find_swizzle(cols * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def compose(
    base,
    h,
    lora_b,
    g,
    bias=None,
    *,
    scaling: float,
    config: MosaicConfig = DEFAULT_MOSAIC,
    interpret: bool = False,
):
    """``g ⊙ (base + s·h·lora_b) + bias`` in one pass (module docstring).

    base [T, N], h [T, r] and lora_b [r, N] in one 16-bit activation dtype; g [N] (any float,
    used in f32); bias [N] or None. Returns [T, N] in base's dtype. The shape must pass
    ``compose_supported``.
    """
    tokens, d_out = base.shape
    rank = h.shape[1]
    dtype = base.dtype
    if not (h.dtype == lora_b.dtype == dtype):
        raise ValueError(f"base {base.dtype}, h {h.dtype} and lora_b {lora_b.dtype} must match")
    if not compose_supported(tokens, d_out, dtype, config):
        raise ValueError(
            f"mosaic compose needs a bf16/f16 [T, N] with T % {config.compose_tile_m} == 0 and "
            f"N % {config.compose_tile_n} == 0; got {dtype} {base.shape}"
        )
    tm, tn = config.compose_tile_m, config.compose_tile_n
    in_flight = config.compose_wgmma_in_flight
    tk = _rank_tile(rank)
    padded = -(-rank // tk) * tk
    if padded != rank:  # zero columns of h meet zero rows of b: the product is unchanged
        h = jnp.pad(h, ((0, 0), (0, padded - rank)))
        lora_b = jnp.pad(lora_b, ((0, padded - rank), (0, 0)))
    item = jnp.dtype(dtype).itemsize
    has_bias = bias is not None
    s = float(scaling)

    def row_vector(ref):
        """A [tn] f32 vector laid out to broadcast over the rows of a wgmma accumulator."""
        return _load(ref, plgpu.Layout.WGMMA.reduce(0), interpret).astype(jnp.float32)

    def kernel(base_gmem, h_gmem, b_gmem, g_gmem, *rest, tile, g_smem, bias_smem, barriers):
        bias_gmem, y_gmem = rest if has_bias else (None, rest[0])
        i, j = lax.axis_index("m"), lax.axis_index("n")
        rows, cols = pl.ds(i * tm, tm), pl.ds(j * tn, tn)
        plgpu.copy_gmem_to_smem(base_gmem.at[rows, cols], tile, barriers.at[0])
        plgpu.copy_gmem_to_smem(g_gmem.at[cols], g_smem, barriers.at[1])
        if has_bias:
            plgpu.copy_gmem_to_smem(bias_gmem.at[cols], bias_smem, barriers.at[2])

        def lora_product(acc):
            def step(_, h_smem, b_smem):
                plgpu.wgmma(acc, h_smem, b_smem)
                plgpu.wgmma_wait(in_flight)

            spec = functools.partial(
                plgpu.BlockSpec, transforms=_swizzled(tk, item), delay_release=in_flight
            )
            plgpu.emit_pipeline(
                step,
                grid=(padded // tk,),
                in_specs=[spec((tm, tk), lambda k: (i, k)), spec((tk, tn), lambda k: (k, j))],
                max_concurrent_steps=config.compose_max_concurrent_steps,
            )(h_gmem, b_gmem)
            plgpu.wgmma_wait(0)
            return acc[...]

        lora = pl.run_scoped(lora_product, plgpu.ACC((tm, tn), jnp.float32))
        for k in range(3 if has_bias else 2):
            plgpu.barrier_wait(barriers.at[k])
        y = tile[...].astype(jnp.float32) + s * lora
        y = lax.broadcast_in_dim(row_vector(g_smem), (tm, tn), [1]) * y
        if has_bias:
            y = y + lax.broadcast_in_dim(row_vector(bias_smem), (tm, tn), [1])
        tile[...] = y.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(tile, y_gmem.at[rows, cols])
        plgpu.wait_smem_to_gmem(0)

    bias_dtype = bias.dtype if has_bias else jnp.float32
    scratch = dict(
        tile=plgpu.SMEM((tm, tn), dtype, transforms=_swizzled(tn, item)),
        g_smem=plgpu.SMEM((tn,), jnp.float32),
        bias_smem=plgpu.SMEM((tn,), bias_dtype),
        barriers=plgpu.Barrier(num_barriers=3, num_arrivals=1),
    )
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((tokens, d_out), dtype),
        scratch_types=scratch,
        grid=(tokens // tm, d_out // tn),
        grid_names=("m", "n"),
        interpret=_interpret_params() if interpret else None,
    )
    args = (base, h, lora_b, g.astype(jnp.float32)) + ((bias,) if has_bias else ())
    return call(*args)


def _tile_rows(tokens: int, tile_m: int) -> int:
    """Rows of one tile of a cotangent pass (``scale_reduce``, ``swiglu_backward``):
    ``tile_m``, halved down to 64 until it divides the token count (0: none does)."""
    tm = tile_m
    while tm >= 64:
        if tokens % tm == 0:
            return tm
        tm //= 2
    return 0


def _pass_supported(tokens: int, d_out: int, dtype, tile_m: int, tile_n: int) -> bool:
    return (
        jnp.dtype(dtype) in MOSAIC_DTYPES
        and tokens > 0
        and _tile_rows(tokens, tile_m) > 0
        and d_out % tile_n == 0
    )


def scale_reduce_supported(tokens: int, d_out: int, dtype, config: MosaicConfig = DEFAULT_MOSAIC):
    """Whether ``scale_reduce`` takes this shape and activation dtype: bf16 or f16, tokens a
    positive multiple of 64, d_out of ``config.scale_reduce_tile_n``."""
    tm, tn = config.scale_reduce_tile_m, config.scale_reduce_tile_n
    return _pass_supported(tokens, d_out, dtype, tm, tn)


def swiglu_supported(tokens: int, d_out: int, dtype, config: MosaicConfig = DEFAULT_MOSAIC):
    """Whether ``swiglu_backward`` takes this shape and activation dtype: bf16 or f16, tokens
    a positive multiple of 64, d_out of ``config.swiglu_tile_n``."""
    return _pass_supported(tokens, d_out, dtype, config.swiglu_tile_m, config.swiglu_tile_n)


def _check_pass_operands(op: str, arrays: dict, vectors: dict, supported, tile_n: int) -> None:
    """The [T, N] operands of a cotangent pass are 2-D and share one dtype and shape, each g is
    [N], and the kernel tiles the shape (``supported(tokens, n, dtype)``)."""
    (_, v0), *rest = arrays.items()
    if any(jnp.ndim(v) != 2 for v in arrays.values()):
        listing = ", ".join(f"{k} {jnp.shape(v)}" for k, v in arrays.items())
        raise ValueError(f"mosaic {op} takes 2-D [T, N] arrays; got {listing}")
    if any(v.dtype != v0.dtype for _, v in rest):
        listing = ", ".join(f"{k} {v.dtype}" for k, v in arrays.items())
        raise ValueError(f"{listing} must match")
    if any(v.shape != v0.shape for _, v in rest):
        listing = ", ".join(f"{k} {v.shape}" for k, v in arrays.items())
        raise ValueError(f"{listing} must have one shape")
    tokens, n = v0.shape
    for name, g in vectors.items():
        if jnp.shape(g) != (n,):
            raise ValueError(f"{name} must have shape ({n},) (N of {v0.shape}); got {jnp.shape(g)}")
    if not supported(tokens, n, v0.dtype):
        raise ValueError(
            f"mosaic {op} needs a bf16/f16 [T, N] with T % 64 == 0 and N % {tile_n} == 0; "
            f"got {v0.dtype} {v0.shape}"
        )


def _cotangent_pass(op, cotangent, inners, gs, *, config, interpret):
    """The cotangent pass ``op`` (``pass_kernel``) with its column-sum partials added up:
    (g_l ⊙ dy_l for each layer, then Σ_t dy_l ⊙ inner_l for each layer)."""
    tokens, d_out = cotangent.shape
    layers = len(inners)
    call, blocks = pass_kernel(
        op, tokens, d_out, cotangent.dtype, config=config, interpret=interpret
    )
    outs = call(cotangent, *inners, *(g.astype(jnp.float32) for g in gs))
    scaled, partials = outs[:layers], outs[layers:]
    return (*scaled, *(p.reshape(blocks, d_out).sum(0) for p in partials))


def cotangent_kernel(
    tokens, d_out, dtype, layers, derivative, *, tile_m, tile_n, chunk_m=None, interpret=False
):
    """(kernel, blocks): the Mosaic kernel of one pass over [T, N] for L layers
    (``scale_reduce``: L = 1; ``swiglu_backward``: 2), a function of (cotangent, *inners, *gs)
    with the g's in f32, and its number of token tiles. Alone (no XLA op around it) it is
    what ``plgpu.as_torch_kernel`` takes (``benchmarks/ncu_mosaic_pass.py``). The pass:

        dy_l     = derivative(cotangent, inners, gs)[l]   f32, rounded as the unfused program
                                                           rounds it
        returns    g_l ⊙ dy_l                             saturated at ±finfo(dtype).max, in
                                                           the activation dtype
                   Σ_t dy_l ⊙ inner_l                     f32 [N]

    Each program owns one [tile_m, tile_n] tile: TMA copies of its cotangent and inner tiles
    and of each g's columns, the arithmetic in f32, each layer's scaled cotangent stored over
    its inner tile's SMEM, and the tile's column sums written as one row of f32 partials that
    XLA adds up (T / tile_m rows). The arithmetic walks the tile in slabs of ``chunk_m`` rows
    (None: the whole tile at once), so the registers hold one slab of every operand and not
    the tile: a 256-row tile held whole takes all 255 registers a thread has and spills
    (run 134). ``derivative(ct, inners, gs)`` sees one slab of the cotangent and inner tiles
    in f32 and the g's broadcast to it; it returns one dy per layer. The kernel's outputs:
    each layer's scaled cotangent [T, N], then each layer's partials [blocks · N].
    """
    dtype = jnp.dtype(dtype)
    tm, tn = _tile_rows(tokens, tile_m), tile_n
    slab = tm if chunk_m is None else min(chunk_m, tm)
    blocks = tokens // tm
    item = jnp.dtype(dtype).itemsize
    big = float(jnp.finfo(dtype).max)
    f32 = jnp.float32
    wgmma = plgpu.Layout.WGMMA
    load = functools.partial(_load, interpret=interpret)

    def kernel(*refs, t_ct, t_in, g_smem, c_smem, barriers):
        ct_gmem, in_gmem = refs[0], refs[1 : 1 + layers]
        g_gmem = refs[1 + layers : 1 + 2 * layers]
        out_gmem = refs[1 + 2 * layers : 1 + 3 * layers]
        col_gmem = refs[1 + 3 * layers :]
        i, j = lax.axis_index("m"), lax.axis_index("n")
        rows, cols = pl.ds(i * tm, tm), pl.ds(j * tn, tn)
        copies = [(ct_gmem.at[rows, cols], t_ct)]
        copies += [(src.at[rows, cols], dst) for src, dst in zip(in_gmem, t_in, strict=True)]
        copies += [(src.at[cols], dst) for src, dst in zip(g_gmem, g_smem, strict=True)]
        for k, (src, dst) in enumerate(copies):
            plgpu.copy_gmem_to_smem(src, dst, barriers.at[k])
        for k in range(len(copies)):
            plgpu.barrier_wait(barriers.at[k])
        column = wgmma.reduce(0)
        gs = [lax.broadcast_in_dim(load(g, column), (slab, tn), [1]) for g in g_smem]
        sums = [None] * layers
        for k in range(tm // slab):
            part = (lambda t: t) if slab == tm else (lambda t, k=k: t.at[pl.ds(k * slab, slab)])
            inner = [load(part(t), wgmma).astype(f32) for t in t_in]
            dys = derivative(load(part(t_ct), wgmma).astype(f32), inner, gs)
            for l, (dy, v, g, t) in enumerate(zip(dys, inner, gs, t_in, strict=True)):
                col_sum = jnp.sum(dy * v, axis=0)
                sums[l] = col_sum if sums[l] is None else sums[l] + col_sum
                part(t)[...] = jnp.clip(dy * g, -big, big).astype(dtype)
        for c, total in zip(c_smem, sums, strict=True):
            c[...] = total
        plgpu.commit_smem()
        partial = pl.ds(i * d_out + j * tn, tn)
        for t, c, out, col in zip(t_in, c_smem, out_gmem, col_gmem, strict=True):
            plgpu.copy_smem_to_gmem(t, out.at[rows, cols])
            plgpu.copy_smem_to_gmem(c, col.at[partial])
        plgpu.wait_smem_to_gmem(0)

    tile = functools.partial(plgpu.SMEM, (tm, tn), dtype, transforms=_swizzled(tn, item))
    vector = functools.partial(plgpu.SMEM, (tn,), f32)
    scratch = dict(
        t_ct=tile(),
        t_in=[tile() for _ in range(layers)],
        g_smem=[vector() for _ in range(layers)],
        c_smem=[vector() for _ in range(layers)],
        barriers=plgpu.Barrier(num_barriers=1 + 2 * layers, num_arrivals=1),
    )
    call = plgpu.kernel(
        kernel,
        out_type=(
            *[jax.ShapeDtypeStruct((tokens, d_out), dtype)] * layers,
            *[jax.ShapeDtypeStruct((blocks * d_out,), f32)] * layers,
        ),
        scratch_types=scratch,
        grid=(blocks, d_out // tn),
        grid_names=("m", "n"),
        interpret=_interpret_params() if interpret else None,
    )
    return call, blocks


def scale_reduce(dy, saved, g, *, config: MosaicConfig = DEFAULT_MOSAIC, interpret: bool = False):
    """``xla_ops.scale_reduce`` as one Mosaic pass: (g ⊙ dy in dy's dtype, saturated at
    ±finfo(dtype).max; Σ_t dy ⊙ saved in f32 [N]), reading dy and saved once
    (``cotangent_kernel``; docs/design.md §4, §6.4).

    dy, saved: [T, N] in one 16-bit dtype; g: [N] (used in f32). The shape must pass
    ``scale_reduce_supported``.
    """
    _check_pass_operands(
        "scale_reduce",
        {"dy": dy, "saved": saved},
        {"g": g},
        functools.partial(scale_reduce_supported, config=config),
        config.scale_reduce_tile_n,
    )
    return _cotangent_pass("scale_reduce", dy, (saved,), (g,), config=config, interpret=interpret)


def swiglu_backward(
    d_act,
    inner_gate,
    inner_up,
    g_gate,
    g_up,
    *,
    config: MosaicConfig = DEFAULT_MOSAIC,
    interpret: bool = False,
):
    """The backward pass over [T, N] of ``act = silu(y_gate) · y_up`` for two DoRA layers,
    y = round(g ⊙ inner) each (the XLA compose's output), in one read of its inputs:

        dy_gate = d_act · y_up · σ(y_gate) · (1 + y_gate · (1 − σ(y_gate)))
        dy_up   = d_act · y_gate · σ(y_gate)              (each rounded to the activation dtype)
        returns  g_gate ⊙ dy_gate, g_up ⊙ dy_up            (saturated, in the activation dtype)
                 Σ_t dy_gate ⊙ inner_gate, Σ_t dy_up ⊙ inner_up     (f32 [N])

    the scale-and-reduce of both layers (``xla_ops.scale_reduce``) with the SwiGLU derivative
    in front (``cotangent_kernel``). XLA runs the same work as two or three passes that write
    the cotangents and read them back (benchmarks/NOTES.md, session 26). The arithmetic is
    f32 with one rounding per cotangent, where XLA's bf16 ops round after each.

    d_act, inner_gate, inner_up: [T, N] in one 16-bit dtype; g_gate, g_up: [N] (used in f32).
    The shape must pass ``swiglu_supported``.
    """
    _check_pass_operands(
        "swiglu_backward",
        {"d_act": d_act, "inner_gate": inner_gate, "inner_up": inner_up},
        {"g_gate": g_gate, "g_up": g_up},
        functools.partial(swiglu_supported, config=config),
        config.swiglu_tile_n,
    )
    return _cotangent_pass(
        "swiglu", d_act, (inner_gate, inner_up), (g_gate, g_up), config=config, interpret=interpret
    )


def _identity(ct, inners, gs):
    """The one-layer pass's derivative: dy is the cotangent."""
    return [ct]


def _swiglu_derivative(da, inners, gs, *, dtype):
    """The SwiGLU pair's dy_gate and dy_up from d_act (``swiglu_backward``), each rounded to
    ``dtype`` as the unfused program rounds it."""
    (ig, iu), (gg, gu) = inners, gs
    yg = (gg * ig).astype(dtype).astype(jnp.float32)  # the forward's outputs, rounded
    yu = (gu * iu).astype(dtype).astype(jnp.float32)
    sig = 1.0 / (1.0 + jnp.exp(-yg))
    dyg = (da * yu * (sig * (1.0 + yg * (1.0 - sig)))).astype(dtype).astype(jnp.float32)
    dyu = (da * (yg * sig)).astype(dtype).astype(jnp.float32)
    return [dyg, dyu]


#: The cotangent passes by op name (also the prefix of their MosaicConfig tile fields):
#: (layers, the derivative for an activation dtype).
PASSES = {
    "scale_reduce": (1, lambda dtype: _identity),
    "swiglu": (2, lambda dtype: functools.partial(_swiglu_derivative, dtype=dtype)),
}


def pass_kernel(
    op: str, tokens: int, d_out: int, dtype, *, config: MosaicConfig = DEFAULT_MOSAIC,
    interpret: bool = False,
):  # fmt: skip
    """(kernel, blocks) of the cotangent pass ``op`` ("scale_reduce" or "swiglu") at [T, N]
    with ``config``'s tiles: ``cotangent_kernel``'s raw kernel, as ``scale_reduce`` and
    ``swiglu_backward`` run it (for profiling it alone)."""
    if op not in PASSES:
        raise ValueError(f"op must be one of {sorted(PASSES)}; got {op!r}")
    layers, derivative = PASSES[op]
    return cotangent_kernel(
        tokens, d_out, dtype, layers, derivative(jnp.dtype(dtype)),
        tile_m=getattr(config, f"{op}_tile_m"), tile_n=getattr(config, f"{op}_tile_n"),
        chunk_m=getattr(config, f"{op}_chunk_m"), interpret=interpret,
    )  # fmt: skip


def _load(ref, layout, interpret: bool):
    """The whole SMEM ref in registers with ``layout`` (the interpreter models no layouts)."""
    if interpret:
        return ref[...]
    if _LOAD_NEEDS_INDEX:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _interpret_params():
    """Pallas' GPU interpreter's parameters (no public name yet in jax 0.10-0.11)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
