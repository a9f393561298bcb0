"""Our kernels that stream [T, d_out] or [d_out, r] tensors, at the bench model's shapes:
their tile candidates against the one the library picks, cuBLAS and copies, by device time.

**compose** (``kernels/compose._lora_gemm_compose_kernel``, the forward's epilogue GEMM):
y = g ⊙ (base + s·h Bᵀ) reads base [T, d_out] and writes y over it, with a K = r product in
between. At r = 384 its FLOPs (2·T·d_out·r) and bytes (4·T·d_out) are both near the H200's
limits (192 FLOP/byte against a ridge of ~200), so neither alone sets its time. In the
compiled r = 384 step (run 158's profile) it took 83.5 µs per gate/up call (T = 2048,
d_out = 14336) and 27 µs per q/o/down call, 2.5-3.4× what either limit allows. Forms:
``chosen`` (``config.lora_gemm_config``); every ``COMPOSE_CANDIDATES`` entry
(``config.GemmConfig``: tile, group, warps, stages, K block; runs 159-160 also timed forms
that loaded the base tile before the K loop, since removed); ``cublas_addmm`` (``addmm(base, h, Bᵀ,
alpha=s)``, LoRA's fused form of the product); ``copy`` (base into y: the bytes alone).

**scale_reduce** (``kernels/backward._scale_reduce_kernel``, recover mode as in a layer
without bias): reads dy and y, writes g ⊙ dy, reduces dm over tokens. Run 158: 1.58 ms per
step against 0.98 ms for its bytes at copy speed; at d_out = 1024 the default tile gives 64
programs for 132 SMs. (``bench_torch_layer``'s sweep timed these shapes with ``do_bench``,
which at ~25 µs per call measured the launcher, not the kernel.) Forms: ``chosen``
(``config.BWD``); ``c{i}`` for each ``config.BWD_CANDIDATES`` entry; ``add``
(``torch.add(dy, y, out=z)``: the same bytes).

**norm** (``kernels/norm.assemble_norm`` for a 16-bit layer with bf16 B, as the bench model's
bf16 adapters have; tokens do not enter): n from ‖W‖², U = W·Aᵀ [d_out, r] fp32, B and
G = A·Aᵀ. Forms: ``chosen`` (``"auto"``: the gemm from r = ``config.NORM_GEMM_MIN_RANK``);
``gemm`` (split G, one cuBLAS GEMM writing a [d_out, 2r] fp32 B·G, the rows kernel);
``kernel`` (B·G in registers by 3xTF32 dots); ``pairs`` and every ``NORM_PAIRS_CANDIDATES``
entry (the gemm's bf16 products in registers, ``config.NORM_PAIRS`` blocks or the entry's);
``copy`` (U copied: the bytes of its one read).

Each form's launches are captured in a CUDA graph and replayed ``--per-round`` times back
to back (device time; no host in it), the forms taking turns over ``--rounds`` rounds;
medians in µs, and each form's paired ratio to ``chosen``. ``max_rel_diff``: the largest
difference of a form's output from ``chosen``'s, over chosen's largest magnitude (a different
K block or token chunking sums in another order; anything larger is a bug).

    python3 -m benchmarks.bench_kernel_tiles --out $OUT     # on the GPU (~3 min)
    TRITON_INTERPRET=1 python3 -m benchmarks.bench_kernel_tiles --tiny   # CPU: forms agree

Writes ``kernel_tiles.csv``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
from typing import NamedTuple

import torch

from benchmarks import measure
from benchmarks.measure import paired_ratio, write_csv
from dora_torch import config
from dora_torch.kernels.backward import scale_reduce
from dora_torch.kernels.compose import compose_forward
from dora_torch.kernels.norm import assemble_norm, assembly_method

#: A probe with its own command line: ``make gpu`` (benchmarks/run.py) skips it.
IN_MAKE_GPU = False
#: d_out of the Llama-8B projections (k/v, q/o/down, gate/up) and how many of each a decoder
#: layer has (per-step totals in the summary).
WIDTHS = ((1024, 2), (4096, 3), (14336, 2))
LAYERS = 8
G = config.GemmConfig
COMPOSE_CANDIDATES = {
    "narrow": G(64, 128, 8, 4, 4),
    "wide": G(128, 256, 8, 8, 3),
    "narrow_k128": G(64, 128, 8, 4, 3, block_k=128),
    "sq128_w8": G(128, 128, 8, 8, 3),
    "sq128_w8_k128": G(128, 128, 8, 8, 2, block_k=128),
    "wide_k128": G(128, 256, 8, 8, 2, block_k=128),
    "tall": G(256, 128, 8, 8, 3),
    # around the square tile (config.LORA_GEMM_SQUARE, runs 159-160): stages and group
    "sq128_w4": G(128, 128, 8, 4, 3),
    "sq128_w4_s2": G(128, 128, 8, 4, 2),
    "sq128_w4_s4": G(128, 128, 8, 4, 4),
    "sq128_w4_g4": G(128, 128, 4, 4, 3),
    "sq128_w4_g16": G(128, 128, 16, 4, 3),
}
TINY_COMPOSE = ("narrow", "narrow_k128")
#: (BLOCK_M, BLOCK_R, warps, stages) of the pairs assembly's kernel (runs 205-206 timed the form
#: that formed all of G's blocks, and the loads of B's and U's tiles after the products).
NORM_PAIRS_CANDIDATES = {
    "pairs_s3": (64, 64, 4, 3),
    "pairs_m128_w8": (128, 64, 8, 3),
    "pairs_m128_w8_s2": (128, 64, 8, 2),
    "pairs_r32_m128_w4": (128, 32, 4, 3),
    "pairs_r32": (64, 32, 4, 2),
}
TINY_NORM = ("gemm", "kernel", "pairs", "pairs_r32")
NORM_FORMS = ("gemm", "kernel", "pairs", *NORM_PAIRS_CANDIDATES)
SCALE_REDUCE_CANDIDATES = {f"c{i}": c for i, c in enumerate(config.BWD_CANDIDATES)}
TINY_SCALE_REDUCE = ("c0", "c10")
KERNELS = ("compose", "scale_reduce", "norm")


class Operands:
    """h [T, r], B [d_out, r], base [T, d_out] (and its pristine copy), m and n with g ≈ 1;
    dy and y [T, d_out] for the scale-and-reduce pass; the norm's fp32 U [d_out, r] (and a
    buffer to copy it into), G [r, r] and ‖W‖² [d_out]."""

    def __init__(self, tokens, d_out, r, *, dtype, device, seed=0):
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def rand(*shape, std=1.0):
            return (torch.randn(*shape, generator=gen) * std).to(device=device, dtype=dtype)

        self.h = rand(tokens, r)
        self.b = rand(d_out, r, std=r**-0.5)
        self.base0 = rand(tokens, d_out)
        self.base = self.base0.clone()
        self.m = (torch.rand(d_out, generator=gen) + 0.5).to(device)
        self.n = self.m * (1.0 + 0.01 * torch.randn(d_out, generator=gen).to(device))
        self.s = 0.5
        self.dy = rand(tokens, d_out)
        self.y = rand(tokens, d_out)
        self.z = torch.empty_like(self.y)
        # the norm's terms (fp32, as the norm's GEMMs write them): |U| keeps every n² > 0
        a = torch.randn(r, 256, generator=gen) / 16
        self.g = (a @ a.t()).to(device)
        self.u = (torch.randn(d_out, r, generator=gen) * 0.1).to(device)
        self.u2 = torch.empty_like(self.u)
        self.base_sq = (torch.rand(d_out, generator=gen) + 1.0).to(device)


class NormBlocks(NamedTuple):
    """The pairs kernel's blocks (``config.NORM_PAIRS``'s order), named for the CSV."""

    block_m: int
    block_r: int
    num_warps: int
    num_stages: int


def candidates(kernel: str) -> dict:
    return {"compose": COMPOSE_CANDIDATES, "scale_reduce": SCALE_REDUCE_CANDIDATES,
            "norm": {"pairs": config.NORM_PAIRS, **NORM_PAIRS_CANDIDATES}}[kernel]  # fmt: skip


def form(kernel: str, name: str, o: Operands):
    """The call of one form. The compose writes y over ``o.base``, as the layer's does; the
    pass returns (dy_g, None, dm, None)."""
    if kernel == "compose":
        if name == "copy":
            return lambda: o.base.copy_(o.base0)
        if name == "cublas_addmm":
            return lambda: torch.addmm(o.base, o.h, o.b.t(), alpha=o.s)
        cfg = None if name == "chosen" else COMPOSE_CANDIDATES[name]
        return lambda: compose_forward(o.h, o.b, o.base, o.m, o.n, o.s, gemm_config=cfg)
    if kernel == "norm":
        if name == "copy":
            return lambda: o.u2.copy_(o.u)
        method = {"chosen": "auto", "gemm": "gemm", "kernel": "kernel"}.get(name, "pairs")
        blocks = candidates("norm").get(name)
        return lambda: assemble_norm(
            o.base_sq, o.u, o.b, o.g, o.s, method=method, bf16x3=True, pairs_blocks=blocks
        )
    if name == "add":
        return lambda: torch.add(o.dy, o.y, out=o.z)
    cfg = None if name == "chosen" else SCALE_REDUCE_CANDIDATES[name]
    return lambda: scale_reduce(
        o.dy, o.y, o.m, o.n, recover=True, dropout=False, need_dbias=False, x=o.dy,
        weight=o.dy, h=o.dy, lora_B=o.dy, reduce_config=cfg,
    )  # fmt: skip


def rel_diff(kernel: str, o: Operands, name: str) -> float:
    """The largest |output_name − output_chosen| over chosen's largest magnitude (the
    compose from the pristine base; the pass over dy_g and dm)."""
    outs = []
    for n in ("chosen", name):
        o.base.copy_(o.base0)
        out = form(kernel, n, o)()
        if kernel == "norm":
            parts = (out,)
        else:
            parts = (out[0],) if kernel == "compose" else (out[0], out[2])
        outs.append([t.float().clone() for t in parts])
    o.base.copy_(o.base0)
    return max(
        float((u - w).abs().max() / w.abs().max().clamp_min(1e-30))
        for u, w in zip(outs[1], outs[0], strict=True)
    )


def _chosen(kernel: str, tokens: int, d_out: int, rank: int):
    """What the library runs at this shape: a tile config, or for the norm the form name of
    the method "auto" resolves to."""
    if kernel == "compose":
        return config.lora_gemm_config(tokens, d_out, rank)
    if kernel == "norm":
        return assembly_method(rank, bf16x3=True)
    return config.BWD


def _is_chosen(kernel: str, name: str, cfg, chosen) -> bool:
    if kernel == "norm":  # "pairs" runs config.NORM_PAIRS' blocks; its candidates do not
        return name in ("chosen", chosen)
    return cfg == chosen


def run(*, tiny: bool, kernels, ranks, tokens_list, rounds: int, per_round: int) -> list[dict]:
    cuda = torch.cuda.is_available() and not tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    widths = ((48, 1), (80, 1)) if tiny else WIDTHS
    rows = []
    for kernel in kernels:
        names = {"compose": TINY_COMPOSE, "scale_reduce": TINY_SCALE_REDUCE,
                 "norm": TINY_NORM}[kernel]  # fmt: skip
        names = names if tiny else NORM_FORMS if kernel == "norm" else tuple(candidates(kernel))
        refs = {"compose": ("cublas_addmm", "copy"), "scale_reduce": ("add",),
                "norm": ("copy",)}[kernel]  # fmt: skip
        # the pass does not depend on r, the norm not on the tokens: one of each
        for rank in ranks[:1] if kernel == "scale_reduce" else ranks:
            for tokens in tokens_list[:1] if kernel == "norm" else tokens_list:
                for d_out, per_layer in widths:
                    o = Operands(tokens, d_out, rank, dtype=dtype, device=device)
                    diffs = {n: rel_diff(kernel, o, n) for n in names}
                    head = {"kernel": kernel, "d_out": d_out, "r": rank, "tokens": tokens}
                    if not cuda:  # the interpreter: agreement only
                        for n in names:
                            rows.append({**head, "form": n, "max_rel_diff": diffs[n]})
                            _print(rows[-1])
                        continue
                    forms = ("chosen", *names, *refs)
                    calls = {n: measure.cuda_graph(form(kernel, n, o))[0].replay for n in forms}
                    times = measure.torch_time_rounds(
                        calls, rounds=rounds, per_round=per_round, timing="gpu"
                    )
                    chosen = _chosen(kernel, tokens, d_out, rank)
                    for n in forms:
                        fallback = chosen if n == "chosen" and kernel != "norm" else None
                        cfg = candidates(kernel).get(n, fallback)
                        if kernel == "norm" and cfg is not None:  # a blocks tuple
                            cfg = NormBlocks(*cfg)
                        rows.append({**head, "form": n, "us": statistics.median(times[n]),
                                     "ratio_to_chosen": paired_ratio(times, n, "chosen"),
                                     "max_rel_diff": diffs.get(n, 0.0 if n == "chosen" else None),
                                     "per_step": per_layer * LAYERS,
                                     "is_chosen": _is_chosen(kernel, n, cfg, chosen),
                                     **_fields(cfg)})  # fmt: skip
                        _print(rows[-1])
                    del o, calls
    return rows


def _fields(cfg) -> dict:
    """A candidate's parameters as CSV columns (none for cuBLAS, copies and "auto")."""
    if cfg is None:
        return {}
    return cfg._asdict() if isinstance(cfg, NormBlocks) else dataclasses.asdict(cfg)


def _print(row: dict) -> None:
    print("kernel_tiles " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes in fp32 (CPU)")
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    ap.add_argument("--ranks", type=measure.positive_int, nargs="+", default=[384, 16])
    ap.add_argument("--tokens", type=measure.positive_int, nargs="+", default=[2048, 8192])
    measure.add_round_args(ap, rounds=5, per_round=20)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    rows = run(tiny=args.tiny, kernels=args.kernels, ranks=args.ranks, tokens_list=args.tokens,
               **measure.round_args(ap, args))  # fmt: skip
    if args.out is not None:
        write_csv(args.out / "kernel_tiles.csv", rows)
    return rows


if __name__ == "__main__":
    main()
