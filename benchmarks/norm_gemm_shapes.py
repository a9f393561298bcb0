"""The norm's GEMMs and the epilogue GEMM at the 8-layer Llama-8B model's shapes (issue 10).

Where the compiled r = 384 step's extra GPU time sits (NOTES.md, session 17: cuBLAS +2.31 ms
per step, the compose kernel 2.11 ms), measured GEMM by GEMM at the shapes the model runs:
W [d_out, d_in] ∈ {q/o 4096², k/v 1024 × 4096, gate/up 14336 × 4096, down 4096 × 14336},
2048 tokens, r = 384 and 16, bf16, ``triton.testing.do_bench`` means.

``forms``: U = W·aᵀ as the norm forms it (fp32 out), in bf16 out, transposed (Uᵀ = a·Wᵀ), in
row blocks of 8192 (``config.NORM_U_ELEMENTS`` at r = 384 until session 20); G = a·aᵀ; B·G in
fp32 (what the bf16x3 assembly replaces); the base GEMM x·Wᵀ for the rate a large GEMM
reaches. Per form,
TFLOP/s and the total over one 8-layer step.

``splitk``: G and U as a batch of K-slices (strided views, no copy) summed afterwards,
against one GEMM: does splitting the contraction help the skinny norm GEMMs?

``compose``: the epilogue GEMM (y = compose(h·Bᵀ + base), inference form, the tile
``config.lora_gemm_config`` picks and every candidate) against cuBLAS
``addmm(base, h, Bᵀ)`` (LoRA's product and add in one call) and a floor (read base, write y
at 4.3 TB/s plus h·Bᵀ's FLOPs at 790 TFLOP/s).

    python3 -m benchmarks.norm_gemm_shapes [--only forms splitk compose]
"""

from __future__ import annotations

import argparse

from benchmarks.work_floor import COPY_TB_PER_S, GEMM_TFLOPS, LLAMA_8B_PROJECTIONS

_NAMES = {(4096, 4096): "q/o", (1024, 4096): "k/v", (14336, 4096): "gate/up", (4096, 14336): "down"}
#: (name, d_out, d_in, projections per decoder layer)
PROJECTIONS = tuple(
    (name, d_out, d_in, LLAMA_8B_PROJECTIONS.count((d_out, d_in)))
    for (d_out, d_in), name in _NAMES.items()
)
TOKENS = 2048
LAYERS = 8
RANKS = (384, 16)


def _bench_us(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3


def _forms_of(W, a, x, B, G):
    """form → (callable, FLOPs) for one projection."""
    import torch

    f32 = torch.float32
    (d_out, d_in), r = W.shape, a.shape[0]
    u_flops = 2 * d_out * d_in * r

    def blocks():
        return [torch.mm(W[i : i + 8192], a.t(), out_dtype=f32) for i in range(0, d_out, 8192)]

    return {
        "U = W·aᵀ, fp32 out": (lambda: torch.mm(W, a.t(), out_dtype=f32), u_flops),
        "U = W·aᵀ, bf16 out": (lambda: torch.mm(W, a.t()), u_flops),
        "Uᵀ = a·Wᵀ, fp32 out": (lambda: torch.mm(a, W.t(), out_dtype=f32), u_flops),
        "Uᵀ = a·Wᵀ, bf16 out": (lambda: torch.mm(a, W.t()), u_flops),
        "U in 8192-row blocks": (blocks, u_flops),
        "G = a·aᵀ, fp32 out": (lambda: torch.mm(a, a.t(), out_dtype=f32), 2 * r * r * d_in),
        "B·G, fp32": (lambda: B @ G, 2 * d_out * r * r),
        "base x·Wᵀ": (lambda: torch.mm(x, W.t()), 2 * x.shape[0] * d_out * d_in),
    }


def forms() -> None:
    import torch

    for r in RANKS:
        totals: dict[str, float] = {}
        for name, d_out, d_in, count in PROJECTIONS:
            cases = _forms_of(
                torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16),
                torch.randn(r, d_in, device="cuda", dtype=torch.bfloat16),
                torch.randn(TOKENS, d_in, device="cuda", dtype=torch.bfloat16),
                torch.randn(d_out, r, device="cuda", dtype=torch.float32),
                torch.randn(r, r, device="cuda", dtype=torch.float32),
            )
            for form, (fn, flops) in cases.items():
                us = _bench_us(fn)
                totals[form] = totals.get(form, 0.0) + us * count * LAYERS / 1e3
                rate = flops / us / 1e6
                print(f"r={r:4d} {name:8s} {form:24s} {us:8.1f} µs {rate:7.1f} TFLOP/s", flush=True)
        for form, ms in totals.items():
            print(f"r={r} per {LAYERS}-layer step: {form:24s} {ms:7.3f} ms")


def _slices(t, parts: int):
    """t [rows, k] as [parts, rows, k / parts]: K-slices as strided views, no copy."""
    return t.view(t.shape[0], parts, t.shape[1] // parts).transpose(0, 1)


def _sliced_product(p, q, *, summed: bool):
    """Σ over K-slices of p_slice · q_sliceᵀ (fp32 out), or the batch of slice products."""
    import torch

    out = torch.bmm(p, q.transpose(1, 2), out_dtype=torch.float32)
    return out.sum(0) if summed else out


def splitk() -> None:
    import functools

    import torch

    f32 = torch.float32
    for r, d_in in ((384, 4096), (384, 14336), (16, 4096)):
        a = torch.randn(r, d_in, device="cuda", dtype=torch.bfloat16)
        ref = torch.mm(a, a.t(), out_dtype=f32)
        row = {"one GEMM": _bench_us(functools.partial(torch.mm, a, a.t(), out_dtype=f32))}
        for parts in (2, 4, 8, 16, 32):
            v = _slices(a, parts)
            g = functools.partial(_sliced_product, v, v, summed=True)
            row[f"{parts} slices + sum"] = _bench_us(g)
            row[f"{parts}: max |Δ|"] = (g() - ref).abs().max().item()
        print(f"G r={r} d_in={d_in}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    for name, d_out, d_in, _ in PROJECTIONS:
        if name == "gate/up":
            continue
        r = 384
        W = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16)
        a = torch.randn(r, d_in, device="cuda", dtype=torch.bfloat16)
        row = {"one GEMM": _bench_us(functools.partial(torch.mm, W, a.t(), out_dtype=f32))}
        for parts in (2, 4, 8):
            Wv, av = _slices(W, parts), _slices(a, parts)
            for summed in (False, True):
                label = f"{parts} slices" + (" + sum" if summed else "")
                row[label] = _bench_us(functools.partial(_sliced_product, Wv, av, summed=summed))
        text = ", ".join(f"{k} {v:.2f} µs" for k, v in row.items())
        print(f"U r={r} {name} {d_out}x{d_in}: {text}")


def compose() -> None:
    import functools

    import torch

    from dora_torch import config
    from dora_torch.kernels.compose import compose_forward

    widths: dict[int, int] = {}  # d_out → projections per layer with that width
    for _, d_out, _, count in PROJECTIONS:
        widths[d_out] = widths.get(d_out, 0) + count
    for r in RANKS:
        sums = {"chosen": 0.0, "best": 0.0, "cuBLAS addmm": 0.0, "floor": 0.0}
        for d_out, count in sorted(widths.items()):
            h = torch.randn(TOKENS, r, device="cuda", dtype=torch.bfloat16)
            B = torch.randn(d_out, r, device="cuda", dtype=torch.bfloat16) * 0.05
            base = torch.randn(TOKENS, d_out, device="cuda", dtype=torch.bfloat16)
            m = torch.rand(d_out, device="cuda") + 0.5
            n = torch.rand(d_out, device="cuda") + 0.5
            call = functools.partial(compose_forward, h, B, base, m, n, 2.0, epilogue=True)
            times = [_bench_us(functools.partial(call, gemm_config=c))
                     for c in config.LORA_GEMM_CANDIDATES]  # fmt: skip
            chosen = config.LORA_GEMM_CANDIDATES.index(config.lora_gemm_config(TOKENS, d_out, r))
            addmm = _bench_us(functools.partial(torch.addmm, base, h, B.t(), alpha=2.0))
            moved = 2 * TOKENS * d_out * 2  # read base, write y (bf16)
            floor = (
                moved / (COPY_TB_PER_S * 1e12) + 2 * TOKENS * d_out * r / (GEMM_TFLOPS * 1e12)
            ) * 1e6
            found = {"chosen": times[chosen], "best": min(times), "cuBLAS addmm": addmm,
                     "floor": floor}  # fmt: skip
            for key, us in found.items():
                sums[key] += us * count * LAYERS / 1e3
            tiles = " ".join(f"{i}:{t:.1f}" for i, t in enumerate(times))
            print(f"compose r={r} d_out={d_out} (x{count} per layer): chosen tile {chosen} "
                  f"{times[chosen]:.1f} µs, all {tiles} | cuBLAS addmm(base, h, Bᵀ) "
                  f"{addmm:.1f} µs | floor {floor:.1f} µs", flush=True)  # fmt: skip
        text = ", ".join(f"{k} {v:.3f} ms" for k, v in sums.items())
        print(f"compose r={r} per {LAYERS}-layer step: {text}")


PARTS = {"forms": forms, "splitk": splitk, "compose": compose}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", default=list(PARTS), choices=list(PARTS))
    args = ap.parse_args(argv)
    import torch

    torch.manual_seed(0)
    for part in args.only:
        PARTS[part]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
