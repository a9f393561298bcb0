"""One Mosaic cotangent pass launched from PyTorch, for Nsight Compute, with a copy of the
same bytes beside it as the bandwidth yardstick.

Nsight Compute kills JAX processes on these machines (runs 63-64), but it profiles PyTorch
programs. ``plgpu.as_torch_kernel`` runs a Mosaic kernel on torch tensors, so the kernel
that ``dora_jax.mosaic.scale_reduce`` or ``swiglu_backward`` launches (``mosaic.pass_kernel``,
the same kernel with the same tiles) can be profiled in a torch process: registers, shared
memory and occupancy, DRAM throughput, warp stall reasons. The kernel is compiled and warmed
first; the profiler range (``cuProfilerStart`` / ``Stop``, ``ncu_jax_layer.ProfilerRange``)
then holds ``--calls`` calls of it and one elementwise torch kernel (``torch.neg`` into a
second buffer; a plain ``copy_`` would be a memcpy, which ncu does not profile) moving as
many bytes as the pass must read and write (the floor's traffic at copy speed):

    ncu --clock-control none --profile-from-start off --set full --csv --page details \\
        python3 -m benchmarks.ncu_mosaic_pass --op swiglu --shape 2048x14336 > $OUT/ncu.csv

``--tile MxN`` or ``MxNcC`` picks other tiles (``bench_jax_passes.parse_tile``; default: the
default config's).

ncu's Duration of each is the number to compare: launched through ``as_torch_kernel`` the
pass costs ~0.2 ms of host time per call (run 134), so CUDA events around it time the host.
Without a GPU (``--dry``) the raw kernel runs under Pallas' interpreter and is checked
against the public function (``scale_reduce`` / ``swiglu_backward``), which tests the
plumbing on the CPU.
"""

from __future__ import annotations

import argparse
import re

from benchmarks.bench_jax_passes import ARRAYS

_SHAPE = re.compile(r"(\d+)x(\d+)")


def parse_shape(text: str) -> tuple[int, int]:
    """(T, N) from ``TxN``, e.g. ``2048x14336``."""
    m = _SHAPE.fullmatch(text)
    if m is None:
        raise ValueError(f"--shape must look like TxN (e.g. 2048x14336); got {text!r}")
    return int(m.group(1)), int(m.group(2))


def operands(op: str, tokens: int, n: int, seed: int = 0):
    """The pass's operands as JAX arrays: bf16 [T, N] cotangent and inners, f32 [N] g's."""
    import jax
    import jax.numpy as jnp

    from dora_jax import mosaic

    layers, _ = mosaic.PASSES[op]
    k = jax.random.split(jax.random.key(seed), 2 + 2 * layers)
    arrays = [jax.random.normal(k[i], (tokens, n), jnp.bfloat16) for i in range(1 + layers)]
    gs = [1 + 0.1 * jax.random.normal(k[1 + layers + i], (n,)) for i in range(layers)]
    return arrays, gs


def config_for(op: str, tile: str | None):
    """The MosaicConfig of ``--tile`` for ``op`` (None: the default config)."""
    from benchmarks.bench_jax_passes import parse_tile, tile_config
    from dora_jax.config import DEFAULT_MOSAIC

    return DEFAULT_MOSAIC if tile is None else tile_config(op, *parse_tile(tile))


def dry_check(op: str, tokens: int, n: int, config=None) -> None:
    """On the CPU: the raw kernel, interpreted, gives the public function's outputs (the
    scaled cotangents bit for bit, the column sums once its partials are added up)."""
    import numpy as np

    from dora_jax import mosaic

    config = config_for(op, None) if config is None else config
    arrays, gs = operands(op, tokens, n)
    kernel, blocks = mosaic.pass_kernel(
        op, tokens, n, arrays[0].dtype, config=config, interpret=True
    )
    outs = kernel(*arrays, *gs)
    public = mosaic.scale_reduce if op == "scale_reduce" else mosaic.swiglu_backward
    ref = public(*arrays, *gs, config=config, interpret=True)
    layers = len(gs)
    for got, want in zip(outs[:layers], ref[:layers], strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for got, want in zip(outs[layers:], ref[layers:], strict=True):
        summed = np.asarray(got).reshape(blocks, n).sum(0)
        np.testing.assert_allclose(summed, np.asarray(want), rtol=1e-5, atol=1e-4)


def torch_calls(op: str, tokens: int, n: int, config):
    """(pass(), copy()): the kernel on torch tensors through ``plgpu.as_torch_kernel``, and an
    elementwise kernel reading and writing as many bytes as the pass (ARRAYS / 2 arrays each
    way)."""
    import numpy as np
    import torch
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from dora_jax import mosaic

    arrays, gs = operands(op, tokens, n)
    to_torch = lambda a: torch.tensor(np.asarray(a, np.float32), device="cuda")  # noqa: E731
    args = [to_torch(a).to(torch.bfloat16) for a in arrays] + [to_torch(g) for g in gs]
    kernel, _ = mosaic.pass_kernel(op, tokens, n, arrays[0].dtype, config=config)
    launch = plgpu.as_torch_kernel(kernel)
    size = ARRAYS[op] * tokens * n // 2
    src = torch.empty(size, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return (lambda: launch(*args)), (lambda: torch.neg(src, out=dst))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="swiglu", choices=("scale_reduce", "swiglu"))
    ap.add_argument("--shape", default="2048x14336", help="TxN")
    ap.add_argument("--tile", default=None, help="MxN or MxNcC (default: the default config's)")
    ap.add_argument("--calls", type=int, default=1, help="pass calls inside the range")
    ap.add_argument("--dry", action="store_true", help="CPU: the interpreted kernel's check")
    args = ap.parse_args(argv)
    tokens, n = parse_shape(args.shape)
    config = config_for(args.op, args.tile)
    if args.dry:
        dry_check(args.op, tokens, n, config)
        print(f"{args.op} {tokens}x{n}: the raw kernel matches the public function")
        return 0
    import torch

    from benchmarks.ncu_jax_layer import ProfilerRange

    run_pass, copy = torch_calls(args.op, tokens, n, config)
    run_pass(), copy()  # compile and warm, outside the range
    torch.cuda.synchronize()
    with ProfilerRange():
        for _ in range(args.calls):
            run_pass()
        copy()
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
