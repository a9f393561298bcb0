"""One call of a JAX layer provider between ``cuProfilerStart`` and ``cuProfilerStop``, for
Nsight Compute (issue 14 asks for a profile of every target Mosaic GPU cannot reach).

Compilation and a warm-up call run first, outside the profiled range, so with
``--profile-from-start off`` ncu sees exactly the kernels of one forward (or one forward +
VJP) of one provider. Run one provider per ncu process, so each report holds one provider:

    for p in lora ours_xla ours_mosaic; do
      ncu --clock-control none --profile-from-start off --set full --csv --page details \\
        python3 -m benchmarks.ncu_jax_layer --shape 8192x8192_r384_t4096 --kind grad \\
        --provider $p > $OUT/ncu_$p.csv
    done

Shapes, inputs and providers are ``bench_jax_layer``'s. Without a GPU (``--dry``, or no CUDA
device) the call runs without the profiler range, which checks the plumbing on the CPU.
"""

from __future__ import annotations

import argparse
import ctypes

import jax

from benchmarks import bench_jax_layer as bj


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} returned CUDA driver error {code}")


class ProfilerRange:
    """``cuProfilerStart`` / ``cuProfilerStop`` on the device's primary context, which JAX
    uses too; the context is made current on this thread first (JAX may have bound it only
    on its own threads)."""

    def __init__(self) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        _check(self.cuda.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        _check(self.cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        _check(
            self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain"
        )
        _check(self.cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def __enter__(self):
        _check(self.cuda.cuProfilerStart(), "cuProfilerStart")
        return self

    def __exit__(self, *exc) -> None:
        _check(self.cuda.cuProfilerStop(), "cuProfilerStop")


def one_call(shape_name: str, provider: str, kind: str, *, dry: bool = False) -> None:
    """Compile and warm ``provider``'s ``kind`` ("fwd" or "grad") at ``shape_name``, then run
    it once inside the profiler range (outside it when ``dry``)."""
    shapes = {s[0]: s for s in bj.SHAPES}
    if shape_name not in shapes:
        raise ValueError(f"shape must be one of {sorted(shapes)}; got {shape_name!r}")
    if kind not in ("fwd", "grad"):
        raise ValueError(f"kind must be 'fwd' or 'grad'; got {kind!r}")
    if provider not in bj.PROVIDER_NAMES:
        raise ValueError(f"provider must be one of {bj.PROVIDER_NAMES}; got {provider!r}")
    _, d_in, d_out, r, tokens, mode = shapes[shape_name]
    kernel, a, b, m, bias, xs, dys = bj._inputs(d_in, d_out, r, tokens, seed=0)
    norm = bj.frozen_norm(kernel, a, b) if mode == "infer" else None
    f, params = bj._providers(kernel, a, b, m, bias, norm, with_auto=False)[provider]
    fn = bj._fwd(f) if kind == "fwd" else bj._grad(f)
    args = (xs[0], *params) if kind == "fwd" else (xs[0], dys[0], *params)
    jax.block_until_ready(fn(*args))  # compile + warm-up, outside the range
    if dry or jax.default_backend() != "gpu":
        jax.block_until_ready(fn(*args))
        return
    with ProfilerRange():
        jax.block_until_ready(fn(*args))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8192x8192_r384_t4096")
    ap.add_argument("--provider", default="ours_xla")
    ap.add_argument("--kind", default="grad", choices=("fwd", "grad"))
    ap.add_argument("--dry", action="store_true", help="no profiler range (CPU check)")
    args = ap.parse_args(argv)
    one_call(args.shape, args.provider, args.kind, dry=args.dry)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
