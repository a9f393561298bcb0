"""Where a dora_torch layer call spends its time (GPU kernels and host overhead).

Not part of `make gpu`'s table: a diagnostic for kernel work. Prints, per shape and mode,
the median GPU time, the host time per call (no sync), and the top CUDA kernels.

    python3 -m benchmarks.profile_torch
"""

from __future__ import annotations

import time

import torch
from torch import nn

DT = torch.bfloat16


def _layer(d_in, d_out, r):
    import dora_torch

    torch.manual_seed(0)
    base = nn.Linear(d_in, d_out, bias=False, device="cuda", dtype=DT)
    base.weight.requires_grad_(False)
    layer = dora_torch.Linear.from_linear(base, r=r, lora_alpha=2 * r)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.01)
    return layer


def _mm_out_dtype(M=8192, K=4096, N=384):
    import triton.testing

    a = torch.randn(K, M, device="cuda", dtype=DT).t()
    b = torch.randn(K, N, device="cuda", dtype=DT)
    res = {}
    res["mm_bf16"] = triton.testing.do_bench(lambda: torch.mm(a, b), return_mode="median")
    try:
        res["mm_out_fp32"] = triton.testing.do_bench(
            lambda: torch.mm(a, b, out_dtype=torch.float32), return_mode="median"
        )
    except Exception as e:
        res["mm_out_fp32"] = repr(e)
    res["mm_fp32_inputs"] = triton.testing.do_bench(
        lambda: torch.mm(a.float(), b.float()), return_mode="median"
    )
    return res


def main() -> None:
    import triton.testing

    print("mm variants [8192x4096]@[4096x384] ms:", _mm_out_dtype(), flush=True)
    for d_in, d_out, r, T in [(4096, 4096, 384, 512), (8192, 8192, 384, 4096)]:
        layer = _layer(d_in, d_out, r)
        x = torch.randn(T, d_in, device="cuda", dtype=DT, requires_grad=True)
        dy = torch.randn(T, d_out, device="cuda", dtype=DT)
        for mode in ("inference", "fwd_bwd"):

            def step(mode=mode, layer=layer, x=x, dy=dy):
                if mode == "inference":
                    with torch.no_grad():
                        layer(x)
                else:
                    torch.autograd.graph.increment_version(layer.lora_A)
                    layer(x).backward(dy)

            for _ in range(5):
                step()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(step, return_mode="median")
            t0 = time.perf_counter()
            for _ in range(20):
                step()
            host_ms = (time.perf_counter() - t0) / 20 * 1e3
            torch.cuda.synchronize()
            with torch.profiler.profile(
                activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
            ) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            print(
                f"\n=== {d_in}->{d_out} r={r} T={T} {mode}: {ms:.3f} ms GPU median, "
                f"{host_ms:.3f} ms host per call (async)"
            )
            print(
                prof.key_averages().table(
                    sort_by="cuda_time_total", row_limit=14, max_name_column_width=60
                )
            )
            print(
                prof.key_averages().table(
                    sort_by="cpu_time_total", row_limit=10, max_name_column_width=60
                )
            )


if __name__ == "__main__":
    main()
