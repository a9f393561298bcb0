"""The least extra work exact DoRA does over LoRA, and what that allows of each speed target.

Arithmetic, not a measurement. With the norm detached (the default, docs/design.md §4) DoRA's
backward does LoRA's GEMMs plus elementwise work, but every forward whose adapters changed
must form the norm, and the factored norm's U = W·Aᵀ is a GEMM of 2·d_out·d_in·r FLOPs (plus
A·Aᵀ and the assembly, O((d_in + d_out)·r²)). No kernel removes it: U depends on A, which
every optimizer step changes (an incremental U + W·ΔAᵀ costs the same, ΔA having rank r).
Where the norm is recomputed on every forward (a training step, or a benchmark that times a
training forward alone), the lowest ratio of our time to LoRA's, if our GEMMs ran exactly as
fast as LoRA's and nothing else cost anything, is

    floor = (LoRA's FLOPs + the norm's FLOPs) / LoRA's FLOPs.

FLOPs are not time: LoRA's r-wide GEMMs run further below the tensor-core peak than U does, so
the time floor the script prints takes jnp LoRA's *measured* time and adds U's FLOPs at the
H200's datasheet rate (990 TFLOP/s dense bf16, ``PEAK_TFLOPS``) and at the rate a large bf16
GEMM reaches there (790, ``GEMM_TFLOPS``: the device library's KINDS.md). If our share of
LoRA's work (the base and adapter GEMMs) ran no faster than jnp LoRA's, no kernel could put
ours below the first of those floors. A target below it cannot be met by a faster kernel; one
a little above it leaves that little for everything else (the compose, the backward's
scale-and-reduce, launches).

The norm also reads W once more per step (LoRA's step reads it twice: forward and dx), and the
backward's scale-and-reduce reads dy and the saved activation and writes g ⊙ dy. Where the
GEMMs are short (few tokens) and launches are gone (CUDA graphs), those bytes, not the FLOPs,
set the floor: ``pass_floor`` adds them at the copy bandwidth measured on these machines. U
reads W and does the norm's FLOPs in one GEMM, so it takes the slower of the two
(``norm_ms``), not their sum (which sessions 15-29 used: it overstated the r = 384 floors,
where U is compute-bound, by up to 1.5%).

Memory has an account of the same kind. DoRA's magnitude gradient needs Σ_t dy ⊙ inner per
output feature, inner = x Wᵀ + s·h Bᵀ [tokens, d_out]; without recomputing a GEMM of the
forward's size the step must keep that tensor until its backward. Where the next op keeps the
same tensor for its own backward (gate and up, before SiLU and the product) it costs nothing;
where it does not (q, k, v, o, down of a Llama decoder layer) it is memory LoRA does not hold
(``kept_bytes``). ``cheapest_recompute`` lists, for a memory target, the layers whose
``recompute_inner`` frees enough of it for the fewest FLOPs.

``measured_kernel_floor`` is the same account with measured kernel times instead of rates:
the norm's GEMMs at what cuBLAS takes for them at the model's shapes (U at 225-650 TFLOP/s,
G at ~100: few output tiles), the assembly at a copy of U's bytes.

    python3 -m benchmarks.work_floor
"""

from __future__ import annotations

import csv
import itertools
import math
import pathlib
from dataclasses import dataclass

RESULTS = pathlib.Path(__file__).parent / "results"
PEAK_TFLOPS = 990.0  # H200 SXM dense bf16, datasheet
GEMM_TFLOPS = 790.0  # 8192³ bf16 matmul on random data, measured on these machines
COPY_TB_PER_S = 4.3  # device-to-device copy, bytes read + written, measured likewise


@dataclass(frozen=True)
class Layer:
    """One adapted linear layer: W [d_out, d_in], rank r, ``tokens`` rows of x."""

    d_in: int
    d_out: int
    r: int
    tokens: int

    def lora_forward(self) -> int:
        """x·Wᵀ, h = x·Aᵀ and h·Bᵀ."""
        t, i, o, r = self.tokens, self.d_in, self.d_out, self.r
        return 2 * t * i * o + 2 * t * i * r + 2 * t * r * o

    def lora_backward(self) -> int:
        """dx = dy·W, dh = dy·B, dx += dh·A, dB = dyᵀ·h, dA = dhᵀ·x (W is frozen: no dW)."""
        t, i, o, r = self.tokens, self.d_in, self.d_out, self.r
        return 2 * t * o * i + 2 * (2 * t * o * r) + 2 * (2 * t * r * i)

    def norm(self) -> int:
        """The factored norm: U = W·Aᵀ, G = A·Aᵀ, and rowsum((B·G) ⊙ B) in the assembly."""
        i, o, r = self.d_in, self.d_out, self.r
        return 2 * o * i * r + 2 * r * r * i + 2 * o * r * r

    def forward_floor(self) -> float:
        return (self.lora_forward() + self.norm()) / self.lora_forward()

    def grad_floor(self) -> float:
        lora = self.lora_forward() + self.lora_backward()
        return (lora + self.norm()) / lora


def pass_bytes(d_in: int, d_out: int, tokens: int, itemsize: int = 2) -> int:
    """Bytes ours moves per training step in passes of its own: W read by the norm, and dy and
    the saved activation read, g ⊙ dy written, by the backward's scale-and-reduce."""
    return (d_in * d_out + 3 * tokens * d_out) * itemsize


def norm_ms(layer: Layer, tb_per_s: float = COPY_TB_PER_S, tflops: float = GEMM_TFLOPS) -> float:
    """The least time of a layer's norm: U = W·Aᵀ reads W once and does ``Layer.norm``'s
    FLOPs, so it takes whichever of the two is slower (bytes at ``tb_per_s``, FLOPs at
    ``tflops``)."""
    read = pass_bytes(layer.d_in, layer.d_out, 0) / (tb_per_s * 1e12)
    return max(read, layer.norm() / (tflops * 1e12)) * 1e3


def activation_ms(layer: Layer, tb_per_s: float = COPY_TB_PER_S) -> float:
    """The backward's scale-and-reduce pass at ``tb_per_s``: dy and the saved activation read,
    g ⊙ dy written ([tokens, d_out] each)."""
    nbytes = pass_bytes(layer.d_in, layer.d_out, layer.tokens) - pass_bytes(
        layer.d_in, layer.d_out, 0
    )
    return nbytes / (tb_per_s * 1e12) * 1e3


def pass_floor(
    lora_ms: float, *layers: Layer, tb_per_s: float = COPY_TB_PER_S, backward: bool = True
) -> float:
    """The lowest ratio to LoRA's measured time (over ``layers``) with DoRA's own work added at
    the rates it can run at: every layer's ``norm_ms`` and, for a step with a backward, its
    ``activation_ms``."""
    extra_ms = sum(
        norm_ms(x, tb_per_s) + (activation_ms(x, tb_per_s) if backward else 0.0) for x in layers
    )
    return (lora_ms + extra_ms) / lora_ms


#: (d_out, d_in) of a Llama-8B decoder layer's seven projections (q, k, v, o, gate, up, down).
LLAMA_8B_PROJECTIONS = (
    (4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096),
    (14336, 4096), (14336, 4096), (4096, 14336),
)  # fmt: skip


#: The seven projections' names, in LLAMA_8B_PROJECTIONS' order.
LLAMA_8B_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Those whose output no later op of a transformers Llama decoder layer keeps for its own
#: backward: q and k before RoPE (which keeps cos and sin), v before repeat_kv's copy, o and
#: down before a residual add. SiLU keeps gate's output and the product keeps up's.
LLAMA_UNKEPT = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")
#: name → (d_out, d_in)
LLAMA_8B_SHAPES = dict(zip(LLAMA_8B_NAMES, LLAMA_8B_PROJECTIONS, strict=True))
GIB = 2.0**30


def kept_bytes(tokens: int, layers: int = 8, recomputed=(), itemsize: int = 2) -> int:
    """Bytes an exact DoRA step keeps beyond LoRA's until backward (the bench model: Llama-8B
    decoder layers, DoRA on all seven projections): every unkept projection's inner
    [tokens, d_out], except those in ``recomputed`` (``recompute_inner``). The [d_out] norms
    (~0.4 MiB per step) are left out."""
    per_token = sum(LLAMA_8B_SHAPES[n][0] for n in LLAMA_UNKEPT if n not in recomputed)
    return layers * tokens * per_token * itemsize


def recompute_flops(tokens: int, recomputed, layers: int = 8) -> int:
    """The GEMMs ``recompute_inner`` adds per step: x·Wᵀ again for every recomputed layer
    (2·tokens·d_in·d_out; the r-wide h·Bᵀ beside it is left out)."""
    return layers * sum(2 * tokens * math.prod(LLAMA_8B_SHAPES[n]) for n in recomputed)


def cheapest_recompute(lora_peak_gib: float, target: float, tokens: int, layers: int = 8):
    """The set of unkept projections whose recomputation brings the step's peak over
    weights to ≤ ``target`` × LoRA's (``lora_peak_gib`` measured, ``kept_bytes`` added) for
    the fewest FLOPs: (names, FLOPs), or None when even all five are not enough."""
    best = None
    for k in range(len(LLAMA_UNKEPT) + 1):
        for names in itertools.combinations(LLAMA_UNKEPT, k):
            peak = lora_peak_gib + kept_bytes(tokens, layers, names) / GIB
            flops = recompute_flops(tokens, names, layers)
            if peak <= target * lora_peak_gib and (best is None or flops < best[1]):
                best = (names, flops)
    return best


def model_peak_gib(csv_name: str, provider: str, rank: int, batch: int) -> float:
    """``train_peak_gib`` of the eager AdamW-foreach row of a ``bench_model_torch`` CSV."""
    with open(RESULTS / csv_name, newline="") as f:
        for row in csv.DictReader(f):
            if (row["provider"], row["mode"], row["optim"], row["rank"], row["batch"]) == (
                provider, "eager", "foreach", str(rank), str(batch)
            ):  # fmt: skip
                return float(row["train_peak_gib"])
    raise KeyError(f"no {provider} eager r={rank} batch-{batch} row in {csv_name}")


#: Issue 10's peak-memory target (≤ 1.05× PEFT LoRA, batch 4 × 2048): the run measuring it.
TORCH_MEMORY_TARGET = (16, 4, "model_torch_fused_run80.csv")


def model_layers(r: int, tokens: int = 0, layers: int = 8) -> list[Layer]:
    """Every adapted projection of the benches' model (8 Llama-8B decoder layers)."""
    return [Layer(i, o, r, tokens) for o, i in LLAMA_8B_PROJECTIONS] * layers


def model_norm_flops(r: int, layers: int = 8) -> int:
    """The norm's FLOPs per training step of the benches' model (all seven projections)."""
    return sum(x.norm() for x in model_layers(r, layers=layers))


def model_train_ms(csv_name: str, provider: str, rank: int, mode: str = "compile") -> float:
    """``train_ms`` of one row (batch 1, AdamW foreach) of a ``bench_model_torch`` CSV."""
    with open(RESULTS / csv_name, newline="") as f:
        for row in csv.DictReader(f):
            if (row["provider"], row["mode"], row["optim"], row["rank"], row["batch"]) == (
                provider, mode, "foreach", str(rank), "1"
            ):  # fmt: skip
                return float(row["train_ms"])
    raise KeyError(f"no {provider} {mode} r={rank} batch-1 row in {csv_name}")


#: Issue 10's compiled batch-1 step (≤ 1.10× compiled PEFT LoRA): rank → the run measuring it.
TORCH_COMPILED_TARGETS = ((16, "model_torch_run41.csv"), (384, "model_torch_run52.csv"))


#: The r = 384 step whose gap is placed by measured kernels (issue 10, reduce-overhead): its
#: interleaved rounds (LoRA and ours in one process), the cuBLAS times of the norm's GEMMs at
#: the model's shapes, and a copy of U (the assembly's one read) at those shapes.
MEASURED_FLOOR_RUNS = {
    "step": "step_interleaved_ro_ab_run161.csv",
    "norm_gemms": "norm_gemm_shapes_run63.log",
    "assembly_copy": "kernel_tiles_run160.csv",
}


def norm_gemms_ms(log_name: str) -> dict[str, float]:
    """The per-step ms of U = W·aᵀ and G = a·aᵀ (fp32 out, as the library runs them) at
    r = 384 from a ``norm_gemm_shapes`` log's summary lines."""
    wanted = {"U": "U = W·aᵀ, fp32 out", "G": "G = a·aᵀ, fp32 out"}
    out = {}
    for line in (RESULTS / log_name).read_text().splitlines():
        for key, label in wanted.items():
            if line.startswith(f"r=384 per 8-layer step: {label}"):
                out[key] = float(line.split()[-2])
    if set(out) != set(wanted):
        raise KeyError(f"{log_name} lacks the r = 384 per-step lines of {sorted(wanted)}")
    return out


def assembly_copy_ms(csv_name: str) -> float:
    """Per-step ms of a copy of U at r = 384 (``bench_kernel_tiles``' norm ``copy`` rows)."""
    with open(RESULTS / csv_name, newline="") as f:
        rows = [r for r in csv.DictReader(f) if (r["kernel"], r["form"], r["r"]) == (
            "norm", "copy", "384")]  # fmt: skip
    if not rows:
        raise KeyError(f"no norm copy rows at r = 384 in {csv_name}")
    return sum(float(r["us"]) * int(r["per_step"]) for r in rows) / 1e3


def step_medians(csv_name: str) -> dict[str, float]:
    """``step_median_ms`` per variant of a ``bench_step_interleaved`` CSV."""
    with open(RESULTS / csv_name, newline="") as f:
        return {r["variant"]: float(r["step_median_ms"]) for r in csv.DictReader(f)}


def measured_kernel_floor(lora_ms: float, norm_ms: float, assembly_ms: float) -> float:
    """The lowest ratio to LoRA's step when the norm's GEMMs take the time cuBLAS takes for
    them and its assembly that of one read of U, and nothing else costs anything."""
    return (lora_ms + norm_ms + assembly_ms) / lora_ms


def time_floor(lora_ms: float, norm_flops: int, tflops: float) -> float:
    """The lowest ratio to LoRA's measured time: its time plus U's FLOPs at ``tflops``."""
    return (lora_ms + norm_flops / (tflops * 1e12) * 1e3) / lora_ms


def measured_ms(csv_name: str, shape: str) -> dict[tuple[str, str], float]:
    """``{(provider, kind): ms}`` of one shape in a ``bench_jax_layer`` CSV."""
    with open(RESULTS / csv_name, newline="") as f:
        return {(row["provider"], row["kind"]): float(row["ms"])
                for row in csv.DictReader(f) if row["shape"] == shape and row["ms"]}  # fmt: skip


#: Issue 14's training-layer targets (≤ 1.05× jnp LoRA): the layer, and the run that measured it.
JAX_LAYER_TARGETS = (
    (Layer(8192, 8192, 384, 4096), "jax_layer_run138.csv", "8192x8192_r384_t4096"),
    (Layer(8192, 28672, 384, 2048), "jax_layer_run138.csv", "8192x28672_r384_t2048"),
)


def jax_model_train_ms(csv_name: str, provider: str, rank: int) -> float:
    """The training step's ms in one row of a ``bench_model_jax`` CSV (8 layers, batch
    1 × 2048): ``train_loop_ms`` (interleaved rounds, steps back to back, since run 133)
    where the row has it, else ``train_ms``."""
    with open(RESULTS / csv_name, newline="") as f:
        for row in csv.DictReader(f):
            if (row["provider"], row["rank"]) != (provider, str(rank)):
                continue
            value = row.get("train_loop_ms") or row["train_ms"]
            if value:
                return float(value)
    raise KeyError(f"no {provider} r={rank} row in {csv_name}")


#: Issue 14's model training step (≤ 1.05× jnp LoRA, ≥ 1.2× faster than naive jnp DoRA):
#: rank → the run measuring it.
JAX_MODEL_TARGETS = ((16, "model_jax_run133.csv"), (384, "model_jax_run133.csv"))


def naive_bound(naive_ms: float, lora_ms: float, floor: float) -> float:
    """The largest naive / ours speed-up that ``floor`` (ours / LoRA at best) allows."""
    return naive_ms / (floor * lora_ms)


def main() -> None:
    print("JAX training layer, norm recomputed every call (issue 14; target ≤ 1.05× jnp LoRA):")
    print(f"  {'shape':<24} {'kind':<5} {'LoRA ms':>8} {'FLOPs':>6} "
          f"{'@990':>6} {'@790':>6} {'passes':>6} {'ours_xla':>9}")  # fmt: skip
    for layer, csv_name, shape in JAX_LAYER_TARGETS:
        ms = measured_ms(csv_name, shape)
        for kind, flops in (("fwd", layer.forward_floor()), ("grad", layer.grad_floor())):
            lora = ms[("lora", kind)]
            ours = ms.get(("ours_xla", kind))
            print(
                f"  {shape:<24} {kind:<5} {lora:>8.3f} {flops:>5.3f}× "
                f"{time_floor(lora, layer.norm(), PEAK_TFLOPS):>5.3f}× "
                f"{time_floor(lora, layer.norm(), GEMM_TFLOPS):>5.3f}× "
                f"{pass_floor(lora, layer, backward=kind == 'grad'):>5.3f}× "
                + (f"{ours / lora:>8.3f}×" if ours else "")
                + f"  ({csv_name})"
            )
    layer = Layer(4096, 4096, 16, 512)
    with open(RESULTS / "torch_layer_run25.csv", newline="") as f:
        ms = {r["provider"]: float(r["ms"]) for r in csv.DictReader(f) if r["mode"] == "fwd_bwd"}
    lora, ours = ms["lora_eq_graphed"], ms["ours_bf16_graphed"]
    print(
        "torch layer 4096², r = 16, 512 tokens, fwd+bwd, CUDA-graphed (issue 10; target ≤ 1.10×): "
        f"LoRA-eq {lora * 1e3:.1f} µs, floor with the norm and the scale-and-reduce as passes of "
        f"their own {pass_floor(lora, layer):.3f}×, ours {ours / lora:.3f}× "
        "(torch_layer_run25.csv)"
    )
    for r, csv_name in TORCH_COMPILED_TARGETS:
        lora = model_train_ms(csv_name, "peft_lora_bf16", r)
        ours = model_train_ms(csv_name, "ours_bf16", r)
        print(
            f"torch model, compiled step, batch 1 × 2048, r = {r} (issue 10; target ≤ 1.10×): "
            f"PEFT LoRA {lora:.2f} ms, floor with the norm and the passes "
            f"{pass_floor(lora, *model_layers(r, tokens=2048)):.3f}×, ours {ours / lora:.3f}× "
            f"({csv_name})"
        )
    runs = MEASURED_FLOOR_RUNS
    steps = step_medians(runs["step"])
    gemms = norm_gemms_ms(runs["norm_gemms"])
    copy = assembly_copy_ms(runs["assembly_copy"])
    floor = measured_kernel_floor(steps["peft_lora"], gemms["U"] + gemms["G"], copy)
    print(
        "torch model, reduce-overhead step, batch 1 × 2048, r = 384 (issue 10; target ≤ 1.10×): "
        f"PEFT LoRA {steps['peft_lora']:.2f} ms; with the norm's U and G at cuBLAS' measured "
        f"{gemms['U']:.3f} + {gemms['G']:.3f} ms and its assembly at one read of U "
        f"({copy:.3f} ms) {floor:.3f}×, ours {steps['ours'] / steps['peft_lora']:.3f}× "
        f"({', '.join(runs.values())})"
    )
    for r, csv_name in JAX_MODEL_TARGETS:
        lora = jax_model_train_ms(csv_name, "jnp_lora", r)
        ours = jax_model_train_ms(csv_name, "ours_bf16", r)
        floor = pass_floor(lora, *model_layers(r, tokens=2048))
        line = (
            f"JAX model, training step, batch 1 × 2048, r = {r} (issue 14; targets ≤ 1.05×, "
            f"naive ≥ 1.2× ours): jnp LoRA {lora:.2f} ms, floor with the norm and the passes "
            f"{floor:.3f}×, ours {ours / lora:.3f}×"
        )
        try:
            naive = jax_model_train_ms(csv_name, "jnp_dora_naive", r)
        except KeyError:
            naive = None
        if naive is not None:
            bound = naive_bound(naive, lora, floor)
            line += f"; naive / ours {naive / ours:.3f}×, at most {bound:.3f}× at the floor"
        print(line + f" ({csv_name})")
    r, batch, csv_name = TORCH_MEMORY_TARGET
    lora = model_peak_gib(csv_name, "peft_lora_bf16", r, batch)
    ours = model_peak_gib(csv_name, "ours_bf16", r, batch)
    tokens = batch * 2048
    floor = (lora + kept_bytes(tokens) / GIB) / lora
    line = (
        f"torch model, peak memory over weights, batch {batch} × 2048, r = {r} (issue 10; target "
        f"≤ 1.05×): PEFT LoRA {lora:.2f} GiB, kept without recomputing +"
        f"{kept_bytes(tokens) / GIB:.3f} GiB = {floor:.3f}×, ours {ours / lora:.3f}×"
    )
    plan = cheapest_recompute(lora, 1.05, tokens)
    if plan is not None:
        names, flops = plan
        left = kept_bytes(tokens, recomputed=names) / GIB
        line += (
            f"; ≤ 1.05× with recompute_modules={list(names)}: {(lora + left) / lora:.3f}×, "
            f"+{flops / 1e12:.2f} TFLOP = +{flops / (GEMM_TFLOPS * 1e12) * 1e3:.1f} ms a step "
            f"at {GEMM_TFLOPS:.0f} TFLOP/s"
        )
    print(line + f" ({csv_name})")
    for r in (16, 384):
        flops = model_norm_flops(r)
        print(
            f"model (8 Llama-8B layers), r = {r}: the norm's FLOPs per step "
            f"{flops / 1e12:.3f} TFLOP = {flops / (GEMM_TFLOPS * 1e12) * 1e3:.2f} ms "
            f"at {GEMM_TFLOPS:.0f} TFLOP/s"
        )


if __name__ == "__main__":
    main()
