"""Layer benchmark of dora_torch on the GPU (H200, bf16 activations): time, memory, bandwidth.

Providers (same run, same inputs):
  ours            dora_torch.Linear, fp32 adapters (PEFT's default), impl="auto" (fused)
  ours_bf16       the same with bf16 adapter parameters (like-for-like with lora_eq)
  ours_bf16_stacked  ours_bf16 with ``stack_weights=True`` (W and A in one buffer: dx as one
                  GEMM; x Wᵀ and x Aᵀ as one too with ``config.STACK_FORWARD``;
                  ``dora_torch.stacking``)
  ours_elementwise  ours with the compose as cuBLAS h Bᵀ + elementwise kernel (headline
                  shape only)
  peft_dora_fp32  PEFT DoRA, default (adapters upcast to fp32)
  peft_dora_bf16  PEFT DoRA, autocast_adapter_dtype=False (bf16 adapters)
  peft_lora_bf16  PEFT LoRA, bf16 adapters
  lora_eq         cuBLAS bf16 ``addmm(x Wᵀ, x Aᵀ, Bᵀ)`` — the LoRA cost floor
  *_graphed       ours_bf16, ours_bf16_stacked and lora_eq replayed from a CUDA graph (input
                  copied into the graph's static buffer each call): host overhead removed, as under
                  ``torch.compile(mode="reduce-overhead")``; small (host-bound) shapes only.
                  fwd_bwd captures forward and backward, ours with its norm computed inside
                  the graph (the cache is cleared before capture), so every replay
                  recomputes it as a training step would

Environment: ``TORCH_LAYER_SHAPES`` (e.g. ``4096x4096_r16_t512``, comma-separated) and
``TORCH_LAYER_PROVIDERS`` restrict the layer rows; ``TORCH_LAYER_SWEEPS=0`` skips the kernel
sweeps and the bandwidth / norm-transient extras after them, and a comma-separated list
(``gemm_configs``, ``reduce_configs``, ``assembly_configs``) runs only those sweeps.

Modes: ``inference`` (no grad, eval; ours reuses its cached norm — weights unchanged),
``inference_norm`` (ours and ours_bf16 only: the same with the norm invalidated before every
call, beside the cached row, as PEFT DoRA recomputes its norm in every call) and
``fwd_bwd`` (y.backward(dy); ours' norm is invalidated before every call, i.e. the worst case
of one optimizer step per micro-batch); x requires grad, so dx is computed. Median of
triton.testing.do_bench with inputs rotated over 3 buffers; peak extra memory =
max_memory_allocated during one call minus allocated before it (parameter grads are set to
None first, so they count for everyone).

Also: the compose kernels' achieved bandwidth against a measured device-to-device copy, the
transient memory of the norm (ours factored vs PEFT's dense) at 8192→28672, r=384, and the
epilogue GEMM's time for each tile config in ``config.LORA_GEMM_CANDIDATES`` on every shape,
in the inference, store-inner and dropout forms (``torch_layer_gemm_configs.csv``;
``config.lora_gemm_config`` encodes the winner), the backward reduce pass for each
``config.BWD_CANDIDATES`` and the norm's time (``torch_layer_reduce_configs.csv``).
A failing provider is recorded in the CSV with its error and does not stop the others.

    python3 -m benchmarks.run --only torch_layer --skip-tests
"""

from __future__ import annotations

import copy
import gc
import os
import pathlib
import traceback

import torch
from torch import nn

from benchmarks.measure import cuda_graph, cuda_peak_bytes, error_text, write_csv

BENCH = "torch_layer"
SHAPES = [  # (d_in, d_out, r, tokens)
    (8192, 8192, 16, 4096),
    (8192, 8192, 128, 4096),
    (8192, 8192, 384, 4096),
    (8192, 28672, 384, 2048),
    (4096, 4096, 384, 512),
    (4096, 4096, 16, 512),
]
PROVIDERS = [
    "ours",
    "ours_bf16",
    "ours_elementwise",
    "peft_dora_fp32",
    "peft_dora_bf16",
    "peft_lora_bf16",
    "lora_eq",
    "ours_bf16_graphed",
    "ours_bf16_stacked",
    "ours_bf16_stacked_graphed",
    "lora_eq_graphed",
]
GRAPHED_SHAPES = [(4096, 4096, 384, 512), (4096, 4096, 16, 512)]
MODES = ("inference", "inference_norm", "fwd_bwd")
#: The providers timed in ``inference_norm`` (the others have no norm cache to invalidate).
NORM_RECOMPUTED_PROVIDERS = ("ours", "ours_bf16")
HEADLINE = (8192, 8192, 384, 4096)
DT = torch.bfloat16
ROTATE = 3
WARMUP_MS, REP_MS = 10, 60


# ------------------------------------------------------------------------------ providers
def _trained_like(A, B, m, s):
    """Give the adapter trained-looking values (B ≠ 0, m ≠ n) in place."""
    with torch.no_grad():
        B.normal_(0, 0.5 / (s * B.shape[1] ** 0.5))
        m.mul_(1 + 0.05 * torch.randn_like(m))


def _make(provider: str, base: nn.Linear, r: int):
    """Returns (module-like callable, list of trainable tensors, hook before each call)."""
    import dora_torch

    alpha = 2 * r
    if provider.startswith("ours"):
        dtype = DT if provider.startswith("ours_bf16") else torch.float32
        layer = dora_torch.Linear.from_linear(
            base, r=r, lora_alpha=alpha, adapter_dtype=dtype,
            stack_weights=provider.endswith("_stacked"),
        )  # fmt: skip
        _trained_like(layer.lora_A, layer.lora_B, layer.lora_magnitude_vector, layer.scaling)
        params = [layer.lora_A, layer.lora_B, layer.lora_magnitude_vector]
        return layer, params, layer
    if provider.startswith("peft"):
        import peft

        cfg = peft.LoraConfig(
            r=r,
            lora_alpha=alpha,
            use_dora=provider.startswith("peft_dora"),
            target_modules=["0"],
        )
        model = peft.get_peft_model(
            nn.Sequential(base), cfg, autocast_adapter_dtype=provider.endswith("fp32")
        )
        layer = model.base_model.model[0]
        A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        if provider.startswith("peft_dora"):
            m = layer.lora_magnitude_vector["default"].weight
            _trained_like(A, B, m, layer.scaling["default"])
            params = [A, B, m]
        else:
            _trained_like(A, B, torch.ones(1, device=A.device), layer.scaling["default"])
            params = [A, B]
        return model, params, None
    if provider == "lora_eq":
        W = base.weight
        A = nn.Parameter(torch.randn(r, W.shape[1], device=W.device, dtype=DT) / W.shape[1] ** 0.5)
        B = nn.Parameter(torch.randn(W.shape[0], r, device=W.device, dtype=DT) * 0.01)
        s = 2.0

        def lora_eq(x):
            x2 = x.reshape(-1, x.shape[-1])
            y = torch.addmm(torch.mm(x2, W.t()), torch.mm(x2, A.t()), B.t(), alpha=s)
            return y.reshape(*x.shape[:-1], W.shape[0])

        return lora_eq, [A, B], None
    raise ValueError(provider)


def _measure(provider, d_in, d_out, r, T, mode):
    import triton.testing

    from dora_torch import config

    torch.manual_seed(0)
    base = nn.Linear(d_in, d_out, bias=False, device="cuda", dtype=DT)
    base.weight.requires_grad_(False)
    graphed = provider.endswith("_graphed")
    fn, params, ours = _make(provider.removesuffix("_graphed"), base, r)
    train = mode == "fwd_bwd"
    stale = train or mode == "inference_norm"  # an update changed A: the norm is recomputed
    if isinstance(fn, nn.Module):
        fn.train(train)
    # fwd+bwd includes dx for every provider (a layer inside a network needs it).
    xs = [torch.randn(T, d_in, device="cuda", dtype=DT, requires_grad=train) for _ in range(ROTATE)]
    if graphed and train:
        fn = _graphed_train(fn, params, ours, xs[0], torch.randn(T, d_out, device="cuda", dtype=DT))
    elif graphed:
        fn = _graphed(fn, xs[0])
    dy = torch.randn(T, d_out, device="cuda", dtype=DT)
    state = {"i": 0}
    epilogue_before = config.COMPOSE_IN_GEMM_EPILOGUE
    config.COMPOSE_IN_GEMM_EPILOGUE = provider != "ours_elementwise"

    def step():
        x = xs[state["i"] % ROTATE]
        state["i"] += 1
        if train and graphed:
            fn(x)  # forward and backward replayed (the norm recomputed inside)
        else:
            if stale and ours is not None:
                torch.autograd.graph.increment_version(ours.lora_A)
            if train:
                fn(x).backward(dy)
            else:
                with torch.no_grad():
                    fn(x)

    try:
        for _ in range(3):  # warm-up: autotune, caches, cuBLAS handles
            step()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(step, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
        for p in params:
            p.grad = None
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    finally:
        config.COMPOSE_IN_GEMM_EPILOGUE = epilogue_before
    return {"ms": ms, "peak_extra_mib": peak, "impl": getattr(ours, "last_impl", "")}


def _graphed_train(fn, params, ours, example, dy):
    """fn's forward + backward (dy) captured in one CUDA graph; the returned callable copies
    its input into the static buffer and replays (gradients land in static .grad buffers).
    For ours the norm cache is cleared right before capture (‖W‖² of the frozen W is kept),
    so the capture computes the norm and every replay recomputes it from the adapters'
    current values."""
    import dora_torch

    static_x = example.detach().clone().requires_grad_(example.requires_grad)

    def before_capture():
        for p in [*params, static_x]:
            p.grad = None
        if ours is not None:
            dora_torch.clear_caches(ours)
            ours._dora_norm_cache.base_sq(ours.weight)  # W is frozen: ‖W‖² stays cached

    graph, _ = cuda_graph(lambda: fn(static_x).backward(dy), before_capture=before_capture)

    def replay(x):
        static_x.detach().copy_(x)
        graph.replay()

    return replay


def _graphed(fn, example):
    """fn (inference) captured in a CUDA graph; the returned callable copies its input into the
    graph's static buffer and replays."""
    static_x = example.detach().clone()

    def call():
        with torch.no_grad():
            return fn(static_x)

    graph, static_y = cuda_graph(call)

    def replay(x):
        static_x.copy_(x)
        graph.replay()
        return static_y

    return replay


# ----------------------------------------------------------------------- kernel bandwidth
def _bandwidth(T=4096, N=8192):
    import triton.testing

    from dora_torch.kernels.backward import scale_reduce
    from dora_torch.kernels.compose import compose_elementwise, compose_forward

    torch.manual_seed(0)
    a = torch.randn(T, N, device="cuda", dtype=DT)
    lora = torch.randn_like(a)
    base = torch.randn_like(a)
    out = torch.empty_like(a)
    m = torch.rand(N, device="cuda") + 0.5
    n = torch.rand(N, device="cuda") + 0.5
    h = torch.randn(T, 384, device="cuda", dtype=DT)
    B = torch.randn(N, 384, device="cuda", dtype=DT) * 0.05
    nbytes = a.numel() * a.element_size()

    def bench(f):
        return triton.testing.do_bench(f, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")

    copy_ms = bench(lambda: out.copy_(a))
    compose_ms = bench(lambda: compose_elementwise(lora, base, m, n, 2.0, y=out))
    epi_ms = bench(lambda: compose_forward(h, B, base, m, n, 2.0, epilogue=True))
    bwd_ms = bench(
        lambda: scale_reduce(a, base, m, n, recover=False, dropout=False, need_dbias=False)
    )
    gbs = lambda moved, ms: moved / (ms * 1e-3) / 1e9  # noqa: E731
    return {
        "copy_GBps": gbs(2 * nbytes, copy_ms),
        "compose_GBps": gbs(3 * nbytes, compose_ms),  # read base, lora; write y
        "epilogue_gemm_GBps": gbs(2 * nbytes, epi_ms),  # read base; write y (h, B are small)
        "bwd_scale_reduce_GBps": gbs(3 * nbytes, bwd_ms),  # read dy, y; write dy_g
        "compose_ms": compose_ms,
        "epilogue_gemm_ms": epi_ms,
        "bwd_scale_reduce_ms": bwd_ms,
    }


# ------------------------------------------------------------------- epilogue GEMM configs
def _gemm_configs() -> list[dict]:
    """Time the epilogue GEMM for every candidate tile config on every benchmark shape, in
    three forms: inference (y = compose(h Bᵀ)), ``store_inner`` (a layer with a bias keeps
    inner for the backward) and ``dropout`` (base and base_d both read, inner kept). The
    training forms spill registers at the wide tile (``benchmarks/kernel_resources.py``;
    NOTES.md, session 14), so their best tile may differ."""
    import triton.testing

    from dora_torch import config
    from dora_torch.kernels.compose import compose_forward

    rows = []
    for _, d_out, r, T in SHAPES:
        torch.manual_seed(0)
        h = torch.randn(T, r, device="cuda", dtype=DT)
        B = torch.randn(d_out, r, device="cuda", dtype=DT) * 0.05
        base = torch.randn(T, d_out, device="cuda", dtype=DT)
        base_x = torch.randn(T, d_out, device="cuda", dtype=DT)
        m = torch.rand(d_out, device="cuda") + 0.5
        n = torch.rand(d_out, device="cuda") + 0.5
        forms = {  # training with dropout always keeps inner (dora_torch/ops.py, SAVE_INNER)
            "inference": {},
            "store_inner": {"store_inner": True},
            "dropout": {"base": base_x, "store_inner": True},
        }
        for form, kw in forms.items():
            for i, cand in enumerate(config.LORA_GEMM_CANDIDATES):
                ms = triton.testing.do_bench(
                    lambda h=h, B=B, base=base, m=m, n=n, cand=cand, kw=kw: compose_forward(
                        h, B, base, m, n, 2.0, epilogue=True, gemm_config=cand, **kw
                    ),
                    warmup=WARMUP_MS,
                    rep=REP_MS,
                    return_mode="median",
                )
                chosen = cand == config.lora_gemm_config(
                    T, d_out, r, store_inner="store_inner" in kw, dropout="base" in kw
                )
                rows.append(
                    {"d_out": d_out, "r": r, "tokens": T, "form": form, "candidate": i,
                     **vars(cand), "ms": ms, "chosen": chosen}
                )  # fmt: skip
                print(f"[{BENCH}] gemm config {rows[-1]}", flush=True)
    return rows


# (tokens, d_out) of the reduce sweep: the headline layer, then batch 1 × 2048 of the Llama-8B
# projections' widths (k/v, q/o/down, gate/up), where the model step's passes run.
REDUCE_SHAPES = ((4096, 8192), (2048, 1024), (2048, 4096), (2048, 14336))


def _reduce_configs(N=8192) -> list[dict]:
    """Time the backward scale-and-reduce pass for every candidate in
    ``config.BWD_CANDIDATES`` on each of ``REDUCE_SHAPES`` (bandwidth: reads dy and y,
    writes dy_g; recovering inner from y, as for a layer without bias), next to a copy; and
    the detached norm of the headline layer (time of ``factored_norm`` and of its assembly
    kernel alone), to account for the fwd+bwd overhead over LoRA."""
    import triton.testing

    from dora_torch import config, factored_norm
    from dora_torch.kernels.backward import scale_reduce

    def bench(f):
        return triton.testing.do_bench(f, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")

    torch.manual_seed(0)
    rows = []
    for T, width in REDUCE_SHAPES:
        dy = torch.randn(T, width, device="cuda", dtype=DT)
        y = torch.randn_like(dy)
        m = torch.rand(width, device="cuda") + 0.5
        n = torch.rand(width, device="cuda") + 0.5
        nbytes = dy.numel() * dy.element_size()
        copy_ms = bench(lambda y=y, dy=dy: y.copy_(dy))
        shape = {"T": T, "N": width}
        rows.append({"what": "copy", **shape, "ms": copy_ms,
                     "GBps": 2 * nbytes / (copy_ms * 1e-3) / 1e9})  # fmt: skip
        for i, cand in enumerate(config.BWD_CANDIDATES):
            ms = bench(
                lambda cand=cand, dy=dy, y=y, m=m, n=n: scale_reduce(
                    dy, y, m, n, recover=True, dropout=False, need_dbias=False,
                    x=dy, weight=dy, h=dy, lora_B=dy, reduce_config=cand,
                )
            )  # fmt: skip
            rows.append(
                {"what": f"scale_reduce candidate {i}", **shape, **vars(cand), "ms": ms,
                 "GBps": 3 * nbytes / (ms * 1e-3) / 1e9, "chosen": cand == config.BWD}
            )  # fmt: skip
    W = torch.randn(N, N, device="cuda", dtype=DT) / N**0.5
    A = torch.randn(384, N, device="cuda") / N**0.5
    B = torch.randn(N, 384, device="cuda") * 0.01
    base_sq = torch.rand(N, device="cuda")
    with torch.no_grad():
        rows.append(
            {"what": "factored_norm 8192x8192 r384 (base_sq cached)",
             "ms": bench(lambda: factored_norm(W, A, B, 2.0, base_sq=base_sq))}
        )  # fmt: skip
    for row in rows:
        print(f"[{BENCH}] {row}", flush=True)
    return rows


#: (BLOCK_M, BLOCK_R, warps) of the fused assembly kernel tried by ``_assembly_configs``.
ASSEMBLY_KERNEL_CONFIGS = [(32, 32, 4), (64, 32, 4), (64, 64, 4), (64, 64, 8), (128, 64, 8)]


def _assembly_configs(ranks=(16, 64, 128, 256, 384), rows_n=8192) -> list[dict]:
    """Norm assembly (kernels/norm.py) per rank: the fused kernel under each block config of
    ``ASSEMBLY_KERNEL_CONFIGS`` and the cuBLAS "gemm" method, in fp32 and as bf16x3 (a 16-bit
    layer's); the evidence for ``config.NORM_ASSEMBLY = "auto"``'s rank threshold and the
    kernel's blocks."""
    import triton

    from dora_torch import config
    from dora_torch.kernels.norm import assemble_norm

    def bench(f):
        return triton.testing.do_bench(f, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")

    rows = []
    saved = (config.NORM_KERNEL_BLOCKS, config.NORM_KERNEL_BLOCKS_WIDE)
    try:
        for r in ranks:
            U = torch.randn(rows_n, r, device="cuda")
            B = torch.randn(rows_n, r, device="cuda", dtype=DT) * 0.01
            A = torch.randn(r, 4096, device="cuda") / 64
            G = A @ A.t()
            args = (torch.rand(rows_n, device="cuda") + 1.0, U, B, G, 2.0)
            with torch.no_grad():
                ms = bench(lambda args=args: assemble_norm(*args, method="gemm"))
                rows.append({"r": r, "rows": rows_n, "method": "gemm", "ms": ms})
                ms = bench(lambda args=args: assemble_norm(*args, method="gemm", bf16x3=True))
                rows.append({"r": r, "rows": rows_n, "method": "gemm_bf16x3", "ms": ms})
                for bm, br, warps in ASSEMBLY_KERNEL_CONFIGS:
                    config.NORM_KERNEL_BLOCKS = config.NORM_KERNEL_BLOCKS_WIDE = (bm, br, warps)
                    ms = bench(lambda args=args: assemble_norm(*args, method="kernel"))
                    rows.append({"r": r, "rows": rows_n, "method": "kernel", "block_m": bm,
                                 "block_r": br, "warps": warps, "ms": ms})  # fmt: skip
    finally:
        config.NORM_KERNEL_BLOCKS, config.NORM_KERNEL_BLOCKS_WIDE = saved
    for row in rows:
        print(f"[{BENCH}] assembly {row}", flush=True)
    return rows


# --------------------------------------------------------------------- norm transient memory
def _peak_of(f):
    """Peak transient MiB of one call (the shared helper in benchmarks/measure.py)."""
    return cuda_peak_bytes(f) / 2**20


def _norm_transient(d_in=8192, d_out=28672, r=384):
    import peft

    import dora_torch

    torch.manual_seed(0)
    base = nn.Linear(d_in, d_out, bias=False, device="cuda", dtype=DT)
    base.weight.requires_grad_(False)
    res = {}
    ours = dora_torch.Linear.from_linear(copy.deepcopy(base), r=r, lora_alpha=2 * r)
    base_sq = dora_torch.base_sq_norm(ours.weight)
    with torch.no_grad():
        res["ours_mib"] = _peak_of(
            lambda: dora_torch.factored_norm(
                ours.weight, ours.lora_A, ours.lora_B, ours.scaling, base_sq=base_sq
            )
        )
    for label, fp32 in (("peft_fp32_mib", True), ("peft_bf16_mib", False)):
        cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, use_dora=True, target_modules=["0"])
        model = peft.get_peft_model(
            nn.Sequential(copy.deepcopy(base)), cfg, autocast_adapter_dtype=fp32
        )
        layer = model.base_model.model[0]
        dora = layer.lora_magnitude_vector["default"]
        A, B = layer.lora_A["default"], layer.lora_B["default"]
        x_dtype = A.weight.dtype  # PEFT casts x to the adapter dtype before DoRA's forward

        def peft_norm(dora=dora, A=A, B=B, x_dtype=x_dtype, layer=layer):
            lw = dora.get_lora_weight(lora_A=A, lora_B=B).to(x_dtype)  # the dense B·A
            w = layer.get_base_layer().weight.to(x_dtype)
            return dora.get_weight_norm(w, lw.detach(), scaling=layer.scaling["default"])

        with torch.no_grad():
            res[label] = _peak_of(peft_norm)
        del model, layer, dora
    return res


# ------------------------------------------------------------------------------ protocol
def _shape_name(shape) -> str:
    d_in, d_out, r, T = shape
    return f"{d_in}x{d_out}_r{r}_t{T}"


def _selected(var: str, name: str) -> bool:
    """Whether ``name`` is in the comma-separated ``var`` (everything when it is unset)."""
    chosen = [v for v in os.environ.get(var, "").split(",") if v]
    return not chosen or name in chosen


def run(out_dir: pathlib.Path) -> list[dict]:
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        return [{"bench": BENCH, "metric": "skipped (no CUDA)", "value": 0, "ok": None}]
    rows = []
    shapes = [sh for sh in SHAPES if _selected("TORCH_LAYER_SHAPES", _shape_name(sh))]
    for d_in, d_out, r, T in shapes:
        for mode in MODES:
            for provider in PROVIDERS:
                if not _selected("TORCH_LAYER_PROVIDERS", provider):
                    continue
                if mode == "inference_norm" and provider not in NORM_RECOMPUTED_PROVIDERS:
                    continue
                if provider == "ours_elementwise" and (d_in, d_out, r, T) != HEADLINE:
                    continue
                if provider.endswith("_graphed") and (d_in, d_out, r, T) not in GRAPHED_SHAPES:
                    continue
                row = {
                    "d_in": d_in,
                    "d_out": d_out,
                    "r": r,
                    "tokens": T,
                    "mode": mode,
                    "provider": provider,
                    "ms": "",
                    "peak_extra_mib": "",
                    "impl": "",
                    "error": "",
                }
                try:
                    row.update(_measure(provider, d_in, d_out, r, T, mode))
                except Exception as e:  # one provider must not kill the others
                    traceback.print_exc()
                    row["error"] = error_text(e)
                rows.append(row)
                print(f"[{BENCH}] {row}", flush=True)
                gc.collect()
                torch.cuda.empty_cache()
    write_csv(out_dir / "torch_layer.csv", rows)
    sweeps = os.environ.get("TORCH_LAYER_SWEEPS", "1")
    if sweeps == "0":
        return _summary(rows, {})
    for name, fn in (
        ("gemm_configs", _gemm_configs),
        ("reduce_configs", _reduce_configs),
        ("assembly_configs", _assembly_configs),
    ):
        if sweeps != "1" and name not in sweeps.split(","):
            continue
        try:
            write_csv(out_dir / f"torch_layer_{name}.csv", fn())
        except Exception:
            traceback.print_exc()

    extra = {}
    for name, fn in (("bandwidth", _bandwidth), ("norm", _norm_transient)):
        try:
            extra.update({f"{name}.{k}": v for k, v in fn().items()})
        except Exception as e:
            traceback.print_exc()
            extra[f"{name}.error"] = error_text(e)
        gc.collect()
        torch.cuda.empty_cache()
    write_csv(
        out_dir / "torch_layer_kernels.csv",
        [{"metric": k, "value": v} for k, v in extra.items()],
    )
    return _summary(rows, extra)


def _get(rows, shape, mode, provider, key="ms"):
    for row in rows:
        if (row["d_in"], row["d_out"], row["r"], row["tokens"]) == shape and (
            row["mode"],
            row["provider"],
        ) == (mode, provider):
            v = row[key]
            return float(v) if v != "" else None
    return None


def _summary(rows, extra) -> list[dict]:
    out = []

    def add(metric, value, target=None, ok=None):
        out.append({"bench": BENCH, "metric": metric, "value": value, "target": target, "ok": ok})

    def ratio(metric, num, den, target=None, cmp=None):
        if num is None or den is None or den == 0:
            add(metric + " (missing)", float("nan"), target, False if target else None)
            return
        v = num / den
        add(metric, v, target, None if cmp is None else cmp(v))

    big, small = HEADLINE, (4096, 4096, 384, 512)
    # lora_eq has bf16 parameters: ours_bf16 is the like-for-like row, ours (fp32 adapters,
    # fp32 gradients) is reported beside it.
    for prov in ("ours_bf16", "ours"):
        for shape, tag in ((big, "8192² r384 4096tok"), (small, "4096² r384 512tok")):
            ratio(
                f"inference {prov}/lora_eq {tag}",
                _get(rows, shape, "inference", prov),
                _get(rows, shape, "inference", "lora_eq"),
                "<= 1.10",
                lambda v: v <= 1.10,
            )
        ratio(
            f"fwd+bwd {prov}/lora_eq 8192² r384",
            _get(rows, big, "fwd_bwd", prov),
            _get(rows, big, "fwd_bwd", "lora_eq"),
            "<= 1.15",
            lambda v: v <= 1.15,
        )
        ratio(
            f"fwd+bwd peak extra mem {prov}/lora_eq 8192² r384",
            _get(rows, big, "fwd_bwd", prov, "peak_extra_mib"),
            _get(rows, big, "fwd_bwd", "lora_eq", "peak_extra_mib"),
            "<= 1.05",
            lambda v: v <= 1.05,
        )
    tiny = (4096, 4096, 16, 512)  # issue 10's one-layer target
    for suffix, how, tgt in (("", "eager", 1.3), ("_graphed", "both CUDA-graphed", 1.1)):
        for prov in ("ours_bf16", "ours_bf16_stacked"):
            ratio(
                f"fwd+bwd {prov}/lora_eq 4096² r16 512tok, {how}",
                _get(rows, tiny, "fwd_bwd", prov + suffix),
                _get(rows, tiny, "fwd_bwd", "lora_eq" + suffix),
                f"<= {tgt}",
                lambda v, t=tgt: v <= t,
            )
    ratio(
        "inference ours_bf16/lora_eq 4096² r384 512tok, both CUDA-graphed",
        _get(rows, small, "inference", "ours_bf16_graphed"),
        _get(rows, small, "inference", "lora_eq_graphed"),
    )
    ratio(  # both recompute the norm in every call: no cache on either side
        "inference speedup vs PEFT DoRA bf16-adapters 8192² r384, ours_bf16's norm recomputed",
        _get(rows, big, "inference", "peft_dora_bf16"),
        _get(rows, big, "inference_norm", "ours_bf16"),
    )
    ratio(
        "inference ours_bf16 norm recomputed/cached 8192² r384",
        _get(rows, big, "inference_norm", "ours_bf16"),
        _get(rows, big, "inference", "ours_bf16"),
    )
    for mode, tgt in (("inference", 2.0), ("fwd_bwd", 1.4)):
        ratio(
            f"{mode} speedup vs PEFT DoRA bf16-adapters 8192² r384",
            _get(rows, big, mode, "peft_dora_bf16"),
            _get(rows, big, mode, "ours"),
            f">= {tgt}",
            lambda v, t=tgt: v >= t,
        )
        ratio(
            f"{mode} speedup vs PEFT DoRA default(fp32-adapters) 8192² r384",
            _get(rows, big, mode, "peft_dora_fp32"),
            _get(rows, big, mode, "ours"),
        )
        ratio(
            f"{mode} epilogue/elementwise compose time 8192² r384",
            _get(rows, big, mode, "ours"),
            _get(rows, big, mode, "ours_elementwise"),
        )
    if "norm.ours_mib" in extra:
        for label in ("peft_bf16_mib", "peft_fp32_mib"):
            if f"norm.{label}" in extra:
                ratio(
                    f"norm transient {label[:-4]}/ours 8192→28672 r384",
                    extra[f"norm.{label}"],
                    extra["norm.ours_mib"],
                    ">= 20",
                    lambda v: v >= 20,
                )
    if "bandwidth.copy_GBps" in extra:
        ratio(
            "compose kernel / copy bandwidth",
            extra["bandwidth.compose_GBps"],
            extra["bandwidth.copy_GBps"],
            ">= 0.85",
            lambda v: v >= 0.85,
        )
        ratio(
            "bwd scale-reduce / copy bandwidth",
            extra["bandwidth.bwd_scale_reduce_GBps"],
            extra["bandwidth.copy_GBps"],
        )
    for k, v in extra.items():
        if k.endswith("error"):
            add(k, v, None, False)
    return out
