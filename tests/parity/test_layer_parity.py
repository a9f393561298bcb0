"""shared_spec, the dense baselines, PEFT, every dora_torch tier and every dora_jax impl agree
on one layer's output and on every gradient (x, A, B, m, bias)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared_spec.cases import get
from shared_spec.tolerances import assert_close
from tests.parity.layer_backends import JAX_IMPLS, NAMES, TORCH_TIERS, run_all

# The per-backend suites (tests/torch, tests/jax) run every case; here a spread of them.
CASES = ["basic", "odd_shapes", "batched_3d", "rslora", "no_bias", "near_unity_g", "zero_base_row"]
OURS = [f"torch_{t}" for t in TORCH_TIERS] + [f"jax_{i}" for i in JAX_IMPLS]
EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}


def _quantities(result):
    y, grads = result
    return {"y": y, **{f"d{k}": grads[k] for k in NAMES if grads[k] is not None}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case_name", CASES)
def test_all_backends_agree(case_name, dtype):
    # PEFT has no eps: a zero base row gives it 0/0 (NaN); that case checks ours only.
    with_peft = case_name != "zero_base_row"
    out, ref = run_all(get(case_name), dtype, peft=with_peft)
    ref_q = _quantities(ref)
    eps = EPS[dtype]
    for backend in [*OURS, *(["peft"] if with_peft else [])]:
        baseline = "jax_naive" if backend.startswith("jax") else "torch_dense"
        got, base = _quantities(out[backend]), _quantities(out[baseline])
        expected = ref_q.keys() - ({"dbias"} if backend == "peft" else set())
        assert got.keys() == expected, backend
        for q in expected:
            name = f"{case_name}/{dtype}/{backend}/{q}"
            if backend == "peft" and dtype == torch.bfloat16:
                # PEFT in bf16 is a baseline, not the product: ours must be no worse than it.
                for ours in OURS:
                    assert_close(_quantities(out[ours])[q], ref_q[q], got[q], machine_eps=eps,
                                 name=f"{name} vs {ours}")  # fmt: skip
                continue
            assert_close(got[q], ref_q[q], base[q], machine_eps=eps, name=name)
    if dtype == torch.float32:  # fp32: every pair within a few ulps of each other
        names = [*OURS, *(["peft"] if with_peft else [])]
        for q in ref_q.keys() - {"dbias"}:
            vals = [_quantities(out[b])[q] for b in names]
            scale = np.linalg.norm(ref_q[q]) or 1.0
            for b, v in zip(names[1:], vals[1:]):
                diff = np.linalg.norm(v - vals[0]) / scale
                assert diff <= 64 * eps, f"{case_name}/{q}: {b} vs {names[0]} differ by {diff:.3g}"
