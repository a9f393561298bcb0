"""`make demo`: what DoRA's factored norm and stable composition buy, on the NumPy spec.

Runs on the CPU in seconds. (The end-to-end fine-tuning demo replaces this once
the backends land; this one exercises the shared spec that both backends test
against.)
"""

from __future__ import annotations

import numpy as np

import shared_spec as S
from shared_spec.precision import round_to_bfloat16
from shared_spec.tolerances import relative_error


def main() -> int:
    rng = np.random.default_rng(0)
    d_out, d_in, r, T = 1024, 1024, 64, 256
    s = S.scaling_for(r, 2 * r)
    W = rng.standard_normal((d_out, d_in)) / np.sqrt(d_in)
    A = rng.standard_normal((r, d_in)) / np.sqrt(d_in)
    B = rng.standard_normal((d_out, r)) / (s * np.sqrt(r))
    x = rng.standard_normal((T, d_in))
    rows = []

    dense = S.dense_norm(W, A, B, s)
    fact = S.factored_norm(W, A, B, s, chunk=256)
    dense_bytes = d_out * d_in * 4  # the [d_out, d_in] B·A an fp32 implementation builds
    fact_bytes = (d_out * r + r * r + d_out) * 4  # U, G, ||W||² in fp32
    rows.append(("factored vs dense norm, max rel diff", f"{np.max(np.abs(fact / dense - 1)):.2e}"))
    rows.append(("norm transient, dense B·A (fp32)", f"{dense_bytes / 2**20:.2f} MiB"))
    rows.append(("norm transient, factored (fp32)", f"{fact_bytes / 2**20:.3f} MiB"))

    m = dense * (1.0 + 3e-3)  # a trained magnitude 0.3% above the norm
    y = S.dora_linear(x, W, A, B, m, s)
    base, lora = x @ W.T, (x @ A.T) @ B.T
    stable = S.compose(base, lora, m, dense, s, round_fn=round_to_bfloat16)
    naive = round_to_bfloat16(
        round_to_bfloat16(base)
        + S.compose_naive(base, lora, m, dense, s, round_fn=round_to_bfloat16)
    )
    unscaled = base + s * lora
    rows.append(("bf16 stable compose, rel err", f"{relative_error(stable, y):.2e}"))
    rows.append(("bf16 naive compose, rel err", f"{relative_error(naive, y):.2e}"))
    rows.append(("error if g were ignored entirely", f"{relative_error(unscaled, y):.2e}"))

    dy = rng.standard_normal(y.shape)
    det = S.dora_linear_vjp(x, W, A, B, m, s, dy)
    ex = S.dora_linear_vjp(x, W, A, B, m, s, dy, exact_norm_grad=True)
    rel = np.linalg.norm(ex.dB - det.dB) / np.linalg.norm(det.dB)
    rows.append(("exact vs detached norm grad, |ΔdB|/|dB|", f"{rel:.2e}"))

    Wm = S.merge(W, A, B, m, s)
    back = S.unmerge(Wm, A, B, m, s, dense)
    rows.append(("merge → unmerge, max abs err", f"{np.max(np.abs(back - W)):.2e}"))

    width = max(len(k) for k, _ in rows)
    print(f"DoRA spec demo: layer {d_out}x{d_in}, r={r}, {T} tokens, float64 spec")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    ok = np.max(np.abs(fact / dense - 1)) < 1e-10 and np.max(np.abs(back - W)) < 1e-10
    print("all checks passed" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
