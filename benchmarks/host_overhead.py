"""Host (CPU) time per call of each piece of a dora_torch layer call, on a tiny CUDA shape.

Not part of `make gpu`'s table: a diagnostic for launch overhead. On a tiny layer the GPU
work is a few µs, so the time to *issue* N calls without synchronising is the host cost of
each piece: Python glue, aten dispatch, Triton's launcher. Prints µs per call, then a
cProfile of the layer's inference and fwd+bwd calls.

    python3 -m benchmarks.host_overhead
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch
import triton
import triton.language as tl
from torch import nn
from torch.nn import functional as F

DT = torch.bfloat16


@triton.jit
def _noop3(a_ptr, b_ptr, n):
    pass


@triton.jit
def _noop25(
    p0_ptr, p1_ptr, p2_ptr, p3_ptr, p4_ptr, p5_ptr, p6_ptr, p7_ptr, p8_ptr,
    i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, s, e,
    A: tl.constexpr, B: tl.constexpr, C: tl.constexpr,
):  # fmt: skip
    pass


@triton.autotune(configs=[triton.Config({"BLK": 16})], key=["n"])
@triton.jit
def _noop_tuned(a_ptr, b_ptr, n, BLK: tl.constexpr):
    pass


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def host_us(fn, n: int = 400) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt / n * 1e6


def launch_rows(run, big: torch.Tensor) -> None:
    """The ``Launcher``'s fast path on ``_noop25`` (9 pointers), and the compiled kernel's C
    launcher alone with the pointers passed as tensors (what the fast path does: Triton's C
    code calls ``data_ptr()`` and ``cuPointerGetAttribute`` per pointer) or as ints (neither):
    their difference over 9 is the C side's cost per pointer argument."""
    from triton.runtime import driver

    from dora_torch.kernels.launch import Launcher

    launcher = Launcher(_noop25)
    ints = (*range(14), 1.0, 2.0)
    named = {"A": 1, "B": 2, "C": 3}
    pointers = (big,) * 9

    def fast_path():
        launcher((1,), *pointers, *ints, num_warps=4, **named)

    run("Launcher fast path, 25 args + 3 constexpr", fast_path)
    if not launcher.fast_launches:
        raise RuntimeError("the Launcher never took its fast path: the rows below would be wrong")
    (c_launch, function, packed), *_ = launcher._compiled.values()
    stream = driver.active.get_current_stream(torch.cuda.current_device())
    head = (1, 1, 1, stream, function, packed, None, None, None)
    tail = (*ints, *named.values())
    as_ints = (big.data_ptr(),) * 9
    run("compiled.run, 9 pointers as tensors", lambda: c_launch(*head, *pointers, *tail))
    run("compiled.run, 9 pointers as ints", lambda: c_launch(*head, *as_ints, *tail))


def main() -> None:
    import dora_torch
    from dora_torch import checks, ops
    from dora_torch.dispatch import resolve_impl
    from dora_torch.kernels.backward import scale_reduce
    from dora_torch.kernels.compose import compose_forward
    from dora_torch.kernels.norm import assemble_norm
    from dora_torch.norm import factored_norm

    torch.manual_seed(0)
    d, r, T = 256, 16, 256  # d_out·T = 65536 = FUSED_MIN_ELEMENTS: the fused tier
    base = nn.Linear(d, d, bias=False, device="cuda", dtype=DT)
    layer = dora_torch.Linear.from_linear(base, r=r, lora_alpha=2 * r)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.01)
    x = torch.randn(T, d, device="cuda", dtype=DT, requires_grad=True)
    dy = torch.randn(T, d, device="cuda", dtype=DT)
    W, A, B, m = layer.weight, layer.lora_A, layer.lora_B, layer.lora_magnitude_vector
    a16, b16 = A.detach().to(DT), B.detach().to(DT)
    n = layer.norm()
    xd = x.detach()
    h = xd @ a16.t()
    U = torch.randn(d, r, device="cuda")
    G = torch.randn(r, r, device="cuda")
    base_sq = torch.rand(d, device="cuda")
    f = torch.empty(1, device="cuda")
    big = torch.empty(64, device="cuda")
    res: dict[str, float] = {}

    def run(name, fn):
        res[name] = host_us(fn)
        print(f"{name:<44} {res[name]:8.1f} us", flush=True)

    run("torch.mm", lambda: torch.mm(xd, W.t()))
    run("F.linear", lambda: F.linear(xd, W))
    run("tensor.to(bf16) of fp32 A", lambda: A.detach().to(DT))
    run("triton noop, 3 args", lambda: _noop3[(1,)](f, f, 1))
    run(
        "triton noop, 25 args + 3 constexpr",
        lambda: _noop25[(1,)](*([big] * 9), *range(14), 1.0, 2.0, A=1, B=2, C=3),
    )
    run("triton noop, autotune (1 config)", lambda: _noop_tuned[(1,)](f, f, 1))
    launch_rows(run, big)
    run(
        "checks.check_adapter + check_input",
        lambda: (checks.check_adapter(W, A, B, m, None), checks.check_input(xd, W)),
    )
    run("resolve_impl", lambda: resolve_impl("auto", xd, d))
    run("layer._norm_cache.norm (hit)", lambda: layer.norm(impl="fused"))
    run(
        "compose_forward (epilogue GEMM)",
        lambda: compose_forward(h, b16, torch.empty_like(xd), m, n, 2.0),
    )
    run(
        "scale_reduce (recover)",
        lambda: scale_reduce(
            dy, dy, m, n, recover=True, dropout=False, need_dbias=False,
            x=xd, weight=W, h=h, lora_B=b16, scaling=2.0,
        ),
    )  # fmt: skip
    run("assemble_norm", lambda: assemble_norm(base_sq, U, B, G, 2.0))
    with torch.no_grad():
        run(
            "factored_norm (detached, fused)",
            lambda: factored_norm(W, A, B, 2.0, base_sq=base_sq, impl="fused"),
        )
        run(
            "ops.forward_core save=0",
            lambda: ops.forward_core(
                xd, None, W, a16, b16, m, n, None, ops.LinearOptions(2.0, "fused", ops.SAVE_NONE)
            ),
        )
        run("LoRA-eq inference", lambda: F.linear(xd, W) + (xd @ a16.t()) @ b16.t())
        layer.eval()
        run("Linear inference (no_grad)", lambda: layer(xd))
    layer.train()

    a_l = A.detach().clone().requires_grad_(True)
    b_l = B.detach().clone().requires_grad_(True)

    def lora_fb():
        y = F.linear(x, W) + (x @ a_l.to(DT).t()) @ b_l.to(DT).t()
        y.backward(dy)

    def ours_fb():
        layer(x).backward(dy)

    def ours_fb_norm():
        torch.autograd.graph.increment_version(layer.lora_A)
        layer(x).backward(dy)

    run("LoRA-eq fwd+bwd (fp32 adapters)", lora_fb)
    run("Linear fwd+bwd (norm cached)", ours_fb)
    run("Linear fwd+bwd (norm recomputed)", ours_fb_norm)

    # Where the backward's host time goes.
    params = [x, layer.lora_A, layer.lora_B, layer.lora_magnitude_vector, a_l, b_l]

    def no_grads(fn):
        def f():
            for p in params:
                p.grad = None
            fn()

        return f

    run("LoRA-eq fwd+bwd, grads cleared", no_grads(lora_fb))
    run("Linear fwd+bwd (norm cached), grads cleared", no_grads(ours_fb))
    run("Linear forward only, grad enabled", lambda: layer(x))
    y = layer(x)
    run(
        "autograd.grad of a kept graph (retain)",
        lambda: torch.autograd.grad(y, params[:4], dy, retain_graph=True),
    )
    ident = _Identity.apply
    run("trivial autograd.Function fwd+bwd", lambda: ident(x).backward(dy[:, : x.shape[1]]))
    with torch.no_grad():
        run(
            "ops.backward_core (recover)",
            lambda: ops.backward_core(
                dy,
                xd,
                None,
                W,
                a16,
                b16,
                m,
                n,
                None,
                h,
                dy,
                ops.LinearOptions(2.0, "fused", ops.SAVE_RECOVER),
                need_dx=True,
                need_dn=False,
                need_dbias=False,
                dA_dtype=A.dtype,
                dB_dtype=B.dtype,
            ),  # fmt: skip,
        )
    dyt = dy.t()
    run("mm bf16", lambda: torch.mm(dyt, h))
    run("mm out_dtype=fp32", lambda: torch.mm(dyt, h, out_dtype=torch.float32))
    run("mm bf16 then .float()", lambda: torch.mm(dyt, h).float())
    run("mul_ fp32 [d, r]", lambda: U.mul_(1.0))
    run("torch.empty [T, d]", lambda: torch.empty((T, d), device="cuda", dtype=DT))
    layer_e = dora_torch.Linear.from_linear(base, r=r, lora_alpha=2 * r, impl="eager")
    run("Linear impl=eager fwd+bwd (norm cached)", lambda: layer_e(x).backward(dy))

    def inference():
        with torch.no_grad():
            layer(xd)

    layer.eval()
    for name, fn, k in (("inference", inference, 300), ("fwd_bwd", ours_fb_norm, 200)):
        layer.train(name != "inference")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(k):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"\n=== cProfile {name}, {k} calls (tottime, top 25)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
