"""Registers and spills of dora_torch's Triton kernels on Hopper, compiled without a GPU.

A memory-bound pass runs at the bandwidth its occupancy allows, and occupancy is set by the
registers per thread: at 255 registers a 4-warp program leaves room for two programs per SM,
and spills add local-memory traffic inside the loop. ``triton.compile`` builds a cubin for
sm_90 on any machine with Triton's bundled ptxas, and ``cuobjdump -res-usage`` reads the
registers (REG) and the per-thread stack (STACK, spills) from it. The signature mimics Triton's
own specialisation for the training case: 16-bit activations, 16-byte aligned pointers, unit
inner strides, sizes divisible by 16 (benchmarks/NOTES.md, session 14, found the backward pass
at 255 registers with spills this way).

The shared memory a program needs (its pipeline's stages) comes from Triton's metadata: above
``SHARED_LIMIT`` a kernel cannot launch.

    python3 -m benchmarks.kernel_resources [--all | --pairs-candidates] [--json]
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass

SM90 = ("cuda", 90, 32)


@dataclass(frozen=True)
class Resources:
    registers: int
    stack_bytes: int  # per thread; > 0 means spills
    shared_bytes: int  # per program (the pipeline's stages); over SHARED_LIMIT cannot launch


#: Shared memory one program may use on sm_90 (Triton's launch check names this limit).
SHARED_LIMIT = 232448


def tools_present() -> bool:
    """Whether Triton's NVIDIA backend ships ptxas and cuobjdump here."""
    try:
        return all(os.path.exists(_tool(t)) for t in ("ptxas", "cuobjdump"))
    except ImportError:
        return False


def _tool(name: str) -> str:
    import triton.backends.nvidia as nvidia

    return os.path.join(os.path.dirname(nvidia.__file__), "bin", name)


def resources(
    kernel,
    constexprs: dict,
    *,
    unit_strides: tuple[str, ...] = (),
    fp32_pointers: tuple[str, ...] = (),
    int32_pointers: tuple[str, ...] = (),
    floats: tuple[str, ...] = (),
    num_warps: int,
    num_stages: int = 3,
) -> Resources:
    """Compile ``kernel`` (a ``@triton.jit`` function) for sm_90 and read its resources.

    Parameters ending in ``_ptr`` are bf16 pointers unless named in ``fp32_pointers`` or
    ``int32_pointers``;
    ``constexprs`` gives the constexpr values; ``unit_strides`` are specialised to 1 (as
    Triton does for a stride of 1); ``floats`` are fp32 scalars; every other parameter is an
    int32 divisible by 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(kernel.fn).parameters)
    unknown = set(constexprs) - set(params)
    if unknown:
        raise ValueError(f"constexprs names no parameter of {kernel.fn.__name__}: {unknown}")
    signature, values, attrs = {}, {}, {}
    for i, name in enumerate(params):
        if name in constexprs or name in unit_strides:
            signature[name] = "constexpr"
            values[(i,)] = constexprs.get(name, 1)
        elif name.endswith("_ptr"):
            kind = "fp32" if name in fp32_pointers else "i32" if name in int32_pointers else "bf16"
            signature[name] = "*" + kind
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=values, attrs=attrs),
        target=GPUTarget(*SM90),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        out = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if found is None:
        raise RuntimeError(f"no resource line in cuobjdump's output:\n{out}")
    return Resources(int(found.group(1)), int(found.group(2)), int(compiled.metadata.shared))


def scale_reduce_resources(cfg, *, recover: bool, dropout: bool, has_dbias: bool) -> Resources:
    """The backward's scale-and-reduce pass (``kernels/backward._scale_reduce_kernel``) at one
    ``config.ReduceConfig`` (in recover mode with the finish of dm, ``_finish_dm``, that the
    last program of each column block runs)."""
    import torch

    from dora_torch import config
    from dora_torch.kernels import backward
    from dora_torch.kernels.common import dot_fp32, dot_precision

    return resources(
        backward._scale_reduce_kernel,
        {
            "EPS": config.EPS,
            "RECOVER": recover,
            "DROPOUT": dropout,
            "HAS_DBIAS": has_dbias,
            "DOT_FP32": dot_fp32(torch.bfloat16),
            "DOT_PRECISION": dot_precision(torch.bfloat16),
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "SUB_M": config.BWD_SUB_M,
            "SUB_N": min(config.BWD_SUB_N, cfg.block_n),
            "BLOCK_D": config.BWD_BLOCK_D,
            "BLOCK_R": config.BWD_BLOCK_R,
        },
        unit_strides=("stride_dyn", "stride_sn", "stride_gn", "stride_xd", "stride_wd"),
        fp32_pointers=("m_ptr", "n_ptr", "dm_part_ptr", "db_part_ptr"),
        int32_pointers=("tickets_ptr",),
        floats=("OUT_MAX", "s"),
        num_warps=cfg.num_warps,
    )


def compose_resources(*, has_bias: bool, dropout: bool) -> Resources:
    """The forward's elementwise compose (``kernels/compose._compose_kernel``)."""
    from dora_torch import config
    from dora_torch.kernels import compose

    return resources(
        compose._compose_kernel,
        {
            "EPS": config.EPS,
            "HAS_BIAS": has_bias,
            "DROPOUT": dropout,
            "STORE_INNER": False,
            "BLOCK_M": config.COMPOSE_BLOCK_M,
            "BLOCK_N": config.COMPOSE_BLOCK_N,
        },
        unit_strides=("stride_ln", "stride_bn", "stride_yn", "stride_in"),
        fp32_pointers=("m_ptr", "n_ptr"),
        floats=("s",),
        num_warps=config.COMPOSE_WARPS,
    )


def lora_gemm_compose_resources(cfg, *, has_bias: bool, dropout: bool, store_inner: bool):
    """The forward's epilogue GEMM (``kernels/compose._lora_gemm_compose_kernel``) at one
    ``config.GemmConfig``, r ≥ 64 (one full K block)."""
    import torch

    from dora_torch import config
    from dora_torch.kernels import compose
    from dora_torch.kernels.common import dot_fp32, dot_precision

    return resources(
        compose._lora_gemm_compose_kernel,
        {
            "EPS": config.EPS,
            "HAS_BIAS": has_bias,
            "DROPOUT": dropout,
            "STORE_INNER": store_inner,
            "DOT_FP32": dot_fp32(torch.bfloat16),  # as the launcher passes them for bf16
            "DOT_PRECISION": dot_precision(torch.bfloat16),
            "BLOCK_K": cfg.block_k,
            "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n,
            "GROUP_M": cfg.group_m,
        },
        unit_strides=("stride_hk", "stride_lbk", "stride_bn", "stride_yn", "stride_in"),
        fp32_pointers=("m_ptr", "n_ptr"),
        floats=("s",),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def norm_pairs_resources(blocks, *, split: bool, split_b: bool) -> Resources:
    """The pairs norm assembly (``kernels/norm._norm_pairs_kernel``) at one blocks tuple of
    ``config.NORM_PAIRS``'s form: its column blocks summed by a ticket finisher or not
    (``split``), for a split B ([B_hi | B_lo]) or a bf16 one."""
    from dora_torch.kernels import norm

    bm, br, warps, stages = blocks
    return resources(
        norm._norm_pairs_kernel,
        {"BLOCK_M": bm, "BLOCK_R": br, "SPLIT_R": split, "SPLIT_B": split_b, "DOT_FP32": False},
        fp32_pointers=("base_sq_ptr", "u_ptr", "lb_ptr", "part_ptr", "out_ptr"),
        int32_pointers=("tickets_ptr",),
        floats=("s",),
        num_warps=warps,
        num_stages=stages,
    )


def rows(all_candidates: bool) -> list[dict]:
    """One row per kernel, config and flag set: config.BWD's (or every candidate's) pass for
    every valid flag set (recover mode has no bias, so no dbias), the compose, the epilogue
    GEMM at the two tiles ``config.lora_gemm_config`` picks (or every candidate), and the
    pairs norm assembly at ``config.NORM_PAIRS`` with and without its ticket finisher, for a
    bf16 and a split B."""
    from dora_torch import config

    out = []
    cands = config.BWD_CANDIDATES if all_candidates else (config.BWD,)
    for i, cfg in enumerate(cands):
        for recover, dropout, dbias in itertools.product([True, False], repeat=3):
            if recover and dbias:
                continue
            got = scale_reduce_resources(cfg, recover=recover, dropout=dropout, has_dbias=dbias)
            flags = {"recover": recover, "dropout": dropout, "has_dbias": dbias}
            out.append({"kernel": "scale_reduce", "candidate": i, "num_warps": cfg.num_warps,
                        **flags, **asdict(got)})  # fmt: skip
    for has_bias in (False, True):
        got = compose_resources(has_bias=has_bias, dropout=False)
        out.append({"kernel": "compose", "num_warps": config.COMPOSE_WARPS,
                    "has_bias": has_bias, **asdict(got)})  # fmt: skip
    gemms = dict(enumerate(config.LORA_GEMM_CANDIDATES))
    if not all_candidates:  # the two tiles config.lora_gemm_config picks from
        picks = (config.LORA_GEMM_NARROW, config.LORA_GEMM_SQUARE)
        gemms = {i: c for i, c in gemms.items() if c in picks}
    for i, cfg in gemms.items():
        for has_bias, dropout, store in itertools.product([False, True], repeat=3):
            got = lora_gemm_compose_resources(
                cfg, has_bias=has_bias, dropout=dropout, store_inner=store
            )
            flags = {"has_bias": has_bias, "dropout": dropout, "store_inner": store}
            out.append({"kernel": "lora_gemm_compose", "candidate": i,
                        "num_warps": cfg.num_warps, **flags,
                        **asdict(got)})  # fmt: skip
    for split, split_b in itertools.product([False, True], repeat=2):
        got = norm_pairs_resources(config.NORM_PAIRS, split=split, split_b=split_b)
        out.append({"kernel": "norm_pairs", "num_warps": config.NORM_PAIRS[2], "split": split,
                    "split_b": split_b, **asdict(got)})  # fmt: skip
    return out


def pairs_candidate_rows() -> list[dict]:
    """The pairs norm assembly at each of ``bench_kernel_tiles``' candidates (with the ticket
    finisher, for a split B: the largest footprint), so that a tile run never stops on one
    that cannot launch."""
    from benchmarks.bench_kernel_tiles import NORM_PAIRS_CANDIDATES

    out = []
    for name, blocks in NORM_PAIRS_CANDIDATES.items():
        got = norm_pairs_resources(blocks, split=True, split_b=True)
        out.append({"kernel": "norm_pairs", "candidate": name, **asdict(got)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="every config.BWD_CANDIDATES entry")
    ap.add_argument(
        "--pairs-candidates",
        action="store_true",
        help="only the pairs norm assembly at bench_kernel_tiles' candidates",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    for row in pairs_candidate_rows() if args.pairs_candidates else rows(args.all):
        print(json.dumps(row) if args.json else row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
