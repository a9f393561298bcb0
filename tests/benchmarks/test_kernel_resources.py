"""Hot streaming kernels compile for sm_90 without spills and below the register ceiling
(``benchmarks/kernel_resources.py``; no GPU needed, Triton's bundled ptxas is).

The backward's scale-and-reduce pass once compiled to 255 registers with spills in recover
mode (an inline recompute for m = 0 columns): two programs per SM, and half of copy
bandwidth. These checks keep such a regression from landing unseen. The kernels compile in a
child process: the suite runs Triton's interpreter, which compiles nothing."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import kernel_resources as kr

pytestmark = pytest.mark.skipif(not kr.tools_present(), reason="needs Triton's ptxas/cuobjdump")

#: The most registers a thread can have: a kernel at this ceiling was constrained by it (the
#: spilling pass sat there), so none may reach it. How many fewer is best is the sweep's
#: question (benchmarks/bench_torch_layer.py), not this test's.
REGISTER_CEILING = 255


def _compiled_rows(*flags: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_resources", "--json", *flags],
        capture_output=True, text=True, env=env, check=False, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def rows():
    return _compiled_rows()


def test_every_flag_set_of_the_default_pass_and_the_compose_is_compiled(rows):
    passes = [r for r in rows if r["kernel"] == "scale_reduce"]
    flags = {(r["recover"], r["dropout"], r["has_dbias"]) for r in passes}
    assert len(passes) == len(flags) == 6 and (True, False, True) not in flags
    assert sum(r["kernel"] == "compose" for r in rows) == 2
    assert sum(r["kernel"] == "lora_gemm_compose" for r in rows) == 16
    assert sum(r["kernel"] == "norm_pairs" for r in rows) == 4


def test_streaming_kernels_neither_spill_nor_reach_the_register_ceiling(rows):
    streaming = [r for r in rows if r["kernel"] in ("scale_reduce", "compose")]
    assert streaming
    for r in streaming:
        assert r["stack_bytes"] == 0, r
        assert r["registers"] < REGISTER_CEILING, r


def test_the_epilogue_gemm_never_spills_in_a_form_its_tile_rule_picks(rows, monkeypatch):
    """``config.lora_gemm_config`` gives the square tile only without a stored
    inner and without dropout, where it must not spill; the narrow tile serves every form.
    The register ceiling is not checked here: a tile at it may still be the fastest (the
    wide tile was, at r = 384 in run 52)."""
    from dora_torch import config

    monkeypatch.setattr(config, "_INTERPRETING", False)
    gemms = [r for r in rows if r["kernel"] == "lora_gemm_compose"]
    picked = 0
    for r in gemms:
        cand = config.LORA_GEMM_CANDIDATES[r["candidate"]]
        flags = {"store_inner": r["store_inner"], "dropout": r["dropout"]}
        if config.lora_gemm_config(1 << 16, 1 << 16, 1 << 10, **flags) == cand or (
            config.lora_gemm_config(64, 64, 16, **flags) == cand
        ):
            picked += 1
            assert r["stack_bytes"] == 0, r
    assert picked == 2 + 8  # square: with and without bias; narrow: all eight forms


def test_the_pairs_norm_assembly_compiles_for_hopper_without_spills(rows):
    """The pairs kernel at ``config.NORM_PAIRS`` lowers for sm_90 (its bf16 dots, atomics and
    barrier, which the interpreter does not compile) with and without the ticket finisher,
    for a bf16 and a split B."""
    pairs = [r for r in rows if r["kernel"] == "norm_pairs"]
    assert sorted((r["split"], r["split_b"]) for r in pairs) == [
        (False, False), (False, True), (True, False), (True, True)
    ]  # fmt: skip
    for r in pairs:
        assert r["stack_bytes"] == 0, r
        assert r["registers"] < REGISTER_CEILING, r
        assert r["shared_bytes"] <= kr.SHARED_LIMIT, r


def test_every_pairs_tile_candidate_can_launch_on_hopper():
    """Each pairs candidate ``bench_kernel_tiles`` times fits sm_90's shared memory (run 204
    stopped on a 128 × 128 × 128-block, 3-stage tile: 360 448 bytes), without spills."""
    from benchmarks.bench_kernel_tiles import NORM_PAIRS_CANDIDATES

    got = _compiled_rows("--pairs-candidates")
    assert [r["candidate"] for r in got] == list(NORM_PAIRS_CANDIDATES)
    for r in got:
        assert r["shared_bytes"] <= kr.SHARED_LIMIT, r
        assert r["stack_bytes"] == 0 and r["registers"] < REGISTER_CEILING, r
