"""Triton kernels compiled for Hopper (sm_90) on this CPU, down to machine code with the ptxas
that ships in Triton's wheel. The interpreter runs a kernel's math but accepts code the GPU
compiler rejects (scalar/tensor mixes, loop bounds, layouts); this catches those without a
GPU. The suite runs under ``TRITON_INTERPRET=1``, where ``@triton.jit`` builds interpreted
functions, so the compiles run in a child process without it (one for all kernels here).

Kernels written without device time are added here; a compile check is cheap, so they stay."""

from __future__ import annotations

import itertools
import os
import pathlib
import subprocess
import sys

import pytest
import triton

PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.exists(), reason="this Triton ships no ptxas")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def lower(kernel, pointers: dict[str, str], constexprs: dict, *, floats=("s",), warps=4, stages=3):
    """Compile ``kernel`` for sm_90: ``pointers`` maps pointer parameters to element types
    (``"bf16"``, ``"fp32"``); parameters in ``floats`` are fp32, constexprs as given, every
    other parameter i32. Returns the cubin's size in bytes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in (p.name for p in kernel.params):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": warps, "num_stages": stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return len(compiled.asm["cubin"])


def lower_norm_pass() -> list[str]:
    """The one-pass norm (kernels/norm_pass.py), ‖W‖² cached and not, at the configured
    blocks."""
    from dora_torch import config
    from dora_torch.kernels.norm_pass import _norm_pass_kernel

    bm, bd, warps, stages = config.NORM_PASS_BLOCKS
    f32 = ("lb_ptr", "base_sq_ptr", "out_ptr")
    done = []
    for cached in (False, True):
        lower(
            _norm_pass_kernel,
            {"w_ptr": "bf16", "a_ptr": "bf16", **dict.fromkeys(f32, "fp32")},
            dict(
                HAS_BASE_SQ=cached,
                DOT_FP32=False,
                DOT_PRECISION="tf32",
                BG_PRECISION=config.NORM_DOT_PRECISION,
                BLOCK_M=bm,
                BLOCK_D=bd,
                BLOCK_R=16,
            ),
            warps=warps,
            stages=stages,
        )
        done.append(f"_norm_pass_kernel cached={cached}")
    return done


def lower_norm_pairs() -> list[str]:
    """The pairs assembly (kernels/norm.py), with and without its split over column blocks
    (and its finisher), for a bf16 and a split B, at the configured blocks."""
    from dora_torch import config
    from dora_torch.kernels.norm import _norm_pairs_kernel

    bm, br, warps, stages = config.NORM_PAIRS
    f32 = ("base_sq_ptr", "u_ptr", "part_ptr", "out_ptr")
    done = []
    for split, split_b in itertools.product([False, True], repeat=2):
        lower(
            _norm_pairs_kernel,
            {
                "lhs_ptr": "bf16",
                "rhs_ptr": "bf16",
                "lb_ptr": "bf16",
                "tickets_ptr": "i32",
                **dict.fromkeys(f32, "fp32"),
            },
            dict(BLOCK_M=bm, BLOCK_R=br, SPLIT_R=split, SPLIT_B=split_b, DOT_FP32=False),
            warps=warps,
            stages=stages,
        )
        done.append(f"_norm_pairs_kernel split_r={split} split_b={split_b}")
    return done


def test_kernels_lower_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "from tests.torch.test_kernel_lowering import lower_norm_pairs, lower_norm_pass; "
        "print(*lower_norm_pass(), *lower_norm_pairs(), sep='\\n')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.split("\n")
    assert sum(line.startswith("_norm_pass") for line in lines) == 2, done.stdout
    assert sum(line.startswith("_norm_pairs") for line in lines) == 4, done.stdout
