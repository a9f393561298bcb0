"""dora_jax.swiglu and its Mosaic kernel on the CPU: the kernel under Pallas' GPU interpreter
against float64, lowered for CUDA, and the fused pair's value and gradients against the
unfused expression under the shared tolerance rule. Compiled runs: ``test_gpu.py``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dora_jax
import shared_spec as S
from benchmarks.bench_jax_passes import xla_swiglu
from dora_jax import mosaic
from dora_jax.config import MosaicConfig, resolve_impl
from dora_jax.dense import DoraDense
from shared_spec.tolerances import assert_close

BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)


def kernel_operands(tokens, d_out, dtype=jnp.bfloat16, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    d_act = jax.random.normal(k[0], (tokens, d_out)).astype(dtype)
    inner_g = (2 * jax.random.normal(k[1], (tokens, d_out))).astype(dtype)
    inner_u = jax.random.normal(k[2], (tokens, d_out)).astype(dtype)
    g_g = 1 + 0.1 * jax.random.normal(k[3], (d_out,))
    g_u = 1 + 0.1 * jax.random.normal(k[4], (d_out,))
    return d_act, inner_g, inner_u, g_g, g_u


def float64_pass(d_act, inner_g, inner_u, g_g, g_u, dtype):
    """The kernel's math in float64 from the same inputs (y rounded to dtype, as the forward
    rounds it; nothing else rounded)."""
    f = functools.partial(np.asarray, dtype=np.float64)
    da, ig, iu = (f(jnp.asarray(v, jnp.float32)) for v in (d_act, inner_g, inner_u))
    gg, gu = f(g_g), f(g_u)
    yg = f(jnp.asarray(jnp.asarray(gg * ig, jnp.float32).astype(dtype), jnp.float32))
    yu = f(jnp.asarray(jnp.asarray(gu * iu, jnp.float32).astype(dtype), jnp.float32))
    sig = 1 / (1 + np.exp(-yg))
    dyg = da * yu * sig * (1 + yg * (1 - sig))
    dyu = da * yg * sig
    return gg * dyg, gu * dyu, (dyg * ig).sum(0), (dyu * iu).sum(0)


#: The same pass as the unfused layers run it: autodiff of silu·mul in the activation dtype,
#: then each layer's ``xla_ops.scale_reduce`` (the baseline of the tolerance rule here, and of
#: the kernel's timing in ``benchmarks/bench_jax_passes``).
xla_pass = xla_swiglu


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(
    ("tokens", "d_out", "config"),
    [
        (64, 32, MosaicConfig()),
        (192, 96, MosaicConfig()),
        (256, 64, MosaicConfig()),
        (256, 64, MosaicConfig(swiglu_chunk_m=64)),  # four 64-row slabs of one 256-row tile
    ],
)
def test_kernel_matches_float64_within_the_xla_error(tokens, d_out, config, dtype):
    ops = kernel_operands(tokens, d_out, dtype)
    got = mosaic.swiglu_backward(*ops, config=config, interpret=True)
    ref = float64_pass(*ops, dtype)
    base = xla_pass(*ops)
    eps = float(jnp.finfo(dtype).eps)
    for name, a, r, b in zip(("dy_g gate", "dy_g up", "col gate", "col up"), got, ref, base):
        assert a.dtype == (dtype if name.startswith("dy_g") else jnp.float32)
        assert_close(a, r, b, machine_eps=eps, name=name)


def check_saturation(backward, tokens=64, d_out=32):
    """``backward`` (swiglu_backward's signature) saturates g ⊙ dy of a zero-norm f16 column
    (inner zero, g = m / eps) at the dtype's max instead of overflowing to inf."""
    d_act, inner_g, inner_u, g_g, g_u = kernel_operands(tokens, d_out, jnp.float16)
    inner_g, g_g = inner_g.at[:, 3].set(0), g_g.at[3].set(1e30)
    dyg, dyu, col_g, col_u = backward(d_act, inner_g, inner_u, g_g, g_u)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in (dyg, dyu, col_g, col_u))
    assert float(jnp.max(jnp.abs(dyg[:, 3]))) == float(jnp.finfo(jnp.float16).max)


def test_kernel_saturates_instead_of_overflowing():
    check_saturation(functools.partial(mosaic.swiglu_backward, interpret=True))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(
    "config",
    [
        MosaicConfig(),
        MosaicConfig(swiglu_tile_m=128, swiglu_tile_n=64),
        MosaicConfig(swiglu_tile_m=64),
        MosaicConfig(swiglu_chunk_m=64),
    ],
)
def test_kernel_lowers_for_cuda(config, dtype):
    ops = kernel_operands(512, 256, dtype)
    fn = jax.jit(functools.partial(mosaic.swiglu_backward, config=config))
    assert "mosaic_gpu" in fn.trace(*ops).lower(lowering_platforms=("cuda",)).as_text()


def test_kernel_refuses_what_it_cannot_tile():
    assert mosaic.swiglu_supported(192, 64, jnp.bfloat16)  # 192 rows: tiles of 64
    for tokens, d_out, dtype in [(100, 64, "bfloat16"), (64, 48, "bfloat16"), (0, 64, "bfloat16"),
                                 (64, 64, "float32")]:  # fmt: skip
        assert not mosaic.swiglu_supported(tokens, d_out, dtype)
    d_act, inner_g, inner_u, g_g, g_u = kernel_operands(64, 32)
    with pytest.raises(ValueError, match="T % 64 == 0"):
        mosaic.swiglu_backward(d_act[:60], inner_g[:60], inner_u[:60], g_g, g_u)
    with pytest.raises(ValueError, match="must match"):
        mosaic.swiglu_backward(d_act, inner_g.astype(jnp.float16), inner_u, g_g, g_u)
    with pytest.raises(ValueError, match="one shape"):
        mosaic.swiglu_backward(d_act, inner_g, inner_u[:, :16], g_g, g_u)
    with pytest.raises(ValueError, match=r"g_up must have shape \(32,\)"):
        mosaic.swiglu_backward(d_act, inner_g, inner_u, g_g, g_u[:16])


def test_swiglu_tiles_are_checked():
    with pytest.raises(ValueError, match="swiglu_tile_m"):
        MosaicConfig(swiglu_tile_m=96)
    with pytest.raises(ValueError, match="swiglu_tile_n"):
        MosaicConfig(swiglu_tile_n=8)


def _pair(d_in, d_out, r, *, impl, seed=0, **kw):
    rngs = nnx.Rngs(seed)
    up_bias = kw.pop("use_bias", False)  # on the up layer only
    layers = []
    for i in range(2):
        lin = nnx.Linear(d_in, d_out, use_bias=up_bias and i == 1, param_dtype=jnp.bfloat16,
                         rngs=rngs)  # fmt: skip
        layer = DoraDense.from_linear(lin, r=r, lora_alpha=2 * r, rngs=rngs, impl=impl, **kw)
        b = 0.05 * jax.random.normal(jax.random.key(seed + 10 + i), layer.lora_b.get_value().shape)
        layer.lora_b.set_value(b.astype(layer.lora_b.get_value().dtype))
        layers.append(layer)
    return layers


def _loss_and_grads(gate, up, x, w):
    def loss(gate, up, x):
        return jnp.sum(dora_jax.swiglu(gate, up, x).astype(w.dtype) * w)

    params = (nnx.DiffState(0, nnx.Param), nnx.DiffState(1, nnx.Param), 2)
    (gg, gu, gx) = nnx.grad(loss, argnums=params)(gate, up, x)
    return loss(gate, up, x), (gg, gu, gx)


def _flat(grads):
    gg, gu, gx = grads
    leaves = {f"gate/{'/'.join(map(str, p))}": v for p, v in nnx.to_flat_state(gg)}
    leaves |= {f"up/{'/'.join(map(str, p))}": v for p, v in nnx.to_flat_state(gu)}
    leaves["x"] = gx

    def f64(v):
        v = v.get_value() if isinstance(v, nnx.Variable) else v
        return np.asarray(jnp.asarray(v, jnp.float32), np.float64)

    return {k: f64(v) for k, v in leaves.items()}


def spec_pair(gate, up, x, w):
    """shared_spec's float64 loss Σ w · silu(y_gate) · y_up and its gradients, keyed as
    ``_flat``: each layer's detached-norm VJP (``dora_linear_vjp``) fed the SwiGLU derivative,
    and the frozen kernel's gradient (g ⊙ dy)ᵀ·x, in Flax layout."""
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64).reshape(-1, x.shape[-1])
    w64 = np.asarray(w, np.float64).reshape(x64.shape[0], -1)
    spec = {}
    for name, layer in (("gate", gate), ("up", up)):
        k, a, b, m = (
            np.asarray(jnp.asarray(v.get_value(), jnp.float32), np.float64)
            for v in (layer.kernel, layer.lora_a, layer.lora_b, layer.magnitude)
        )
        W, A, B = S.from_flax_layout(k, a, b)
        s = float(layer.scaling)
        g = S.magnitude_scale(m, S.dense_norm(W, A, B, s))
        spec[name] = (S.dora_linear(x64, W, A, B, m, s), (W, A, B, m, s), g)
    yg, yu = spec["gate"][0], spec["up"][0]
    sig = 1 / (1 + np.exp(-yg))
    loss = float(np.sum(w64 * yg * sig * yu))
    dys = {"gate": w64 * yu * sig * (1 + yg * (1 - sig)), "up": w64 * yg * sig}
    grads = {"x": 0.0}
    for name, (_, args, g) in spec.items():
        ref = S.dora_linear_vjp(x64, *args, dys[name])
        grads["x"] = grads["x"] + ref.dx
        grads[f"{name}/kernel"] = x64.T @ (dys[name] * g)
        grads[f"{name}/lora_a"], grads[f"{name}/lora_b"] = ref.dA.T, ref.dB.T
        grads[f"{name}/magnitude"] = ref.dm
    grads["x"] = grads["x"].reshape(x.shape)
    return loss, grads


def check_fused_pair(d_in, d_out, r, tokens):
    """The fused pair's loss and every gradient against shared_spec in float64, within the
    unfused bf16 pair's error. On a GPU the kernel runs compiled."""
    x = jax.random.normal(jax.random.key(1), (2, tokens // 2, d_in)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (2, tokens // 2, d_out))
    gate, up = _pair(d_in, d_out, r, impl="mosaic")
    fused = _loss_and_grads(gate, up, x, w)
    unfused = _loss_and_grads(*_pair(d_in, d_out, r, impl="xla"), x, w)
    ref_loss, want = spec_pair(gate, up, x, w)
    got, base = _flat(fused[1]), _flat(unfused[1])
    assert set(got) == set(want) and len(got) == 9  # kernel, a, b, m of each layer, and x
    for name in want:
        assert_close(got[name], want[name], base[name], machine_eps=BF16_EPS, name=name)
    assert_close(float(fused[0]), ref_loss, float(unfused[0]), machine_eps=BF16_EPS, name="loss")


def test_fused_pair_matches_the_spec_within_the_unfused_error():
    check_fused_pair(48, 64, 8, 128)


def _fuses(gate, up, x):
    # deterministic: no dropout key is drawn, which make_jaxpr's trace could not mutate
    jaxpr = str(jax.make_jaxpr(lambda x: dora_jax.swiglu(gate, up, x, deterministic=True))(x))
    return "swiglu_core" in jaxpr or "mosaic_gpu" in jaxpr or "mpmd" in jaxpr


def test_swiglu_fuses_only_where_the_kernel_applies():
    x = jnp.ones((128, 48), jnp.bfloat16)
    assert _fuses(*_pair(48, 64, 4, impl="mosaic"), x)
    assert not _fuses(*_pair(48, 64, 4, impl="xla"), x)
    assert not _fuses(*_pair(48, 64, 4, impl="mosaic"), x[:100])  # no tile of 64 rows
    assert not _fuses(*_pair(48, 40, 4, impl="mosaic"), x)  # d_out not a multiple of 32
    assert not _fuses(*_pair(48, 64, 4, impl="mosaic"), x.astype(jnp.float32))
    assert not _fuses(*_pair(48, 64, 4, impl="mosaic", use_bias=True), x)
    assert not _fuses(*_pair(48, 64, 4, impl="mosaic", lora_dropout=0.1), x)
    assert not _fuses(*_pair(48, 64, 4, impl="mosaic", exact_norm_grad=True), x)
    gate, up = _pair(48, 64, 4, impl="mosaic")
    gate.freeze_norm()
    assert not _fuses(gate, up, x)


def check_fallback(impl, tokens):
    """Where the kernel cannot tile the tokens (0, 1, not a multiple of 64) ``swiglu`` is
    exactly the unfused expression."""
    gate, up = _pair(48, 64, 4, impl=impl)
    x = jax.random.normal(jax.random.key(tokens), (tokens, 48)).astype(jnp.bfloat16)
    want = jax.nn.silu(gate(x)) * up(x)
    np.testing.assert_array_equal(np.asarray(dora_jax.swiglu(gate, up, x)), np.asarray(want))


@pytest.mark.parametrize("tokens", [0, 1, 100])
def test_swiglu_falls_back_where_the_kernel_cannot_tile(tokens):
    check_fallback("mosaic", tokens)


def test_swiglu_of_plain_layers_is_the_plain_expression():
    rngs = nnx.Rngs(0)
    gate, up = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(8, 16, rngs=rngs)
    x = jax.random.normal(jax.random.key(0), (4, 8))
    want = jax.nn.silu(gate(x)) * up(x)
    np.testing.assert_array_equal(np.asarray(dora_jax.swiglu(gate, up, x)), np.asarray(want))


def test_swiglu_op_resolves_like_the_compose():
    shape = (256, 48, 64, 8)
    assert (
        resolve_impl("mosaic", "swiglu", platform="gpu", shape=shape, dtype="bfloat16") == "mosaic"
    )
    assert resolve_impl("mosaic", "swiglu", platform="gpu", shape=(100, 48, 64, 8),
                        dtype="bfloat16") == "xla"  # fmt: skip
    assert resolve_impl("auto", "swiglu", platform="cpu", shape=shape, dtype="bfloat16") == "xla"


def twin_fuses(impl: str) -> bool:
    """Whether the llama twin's MLP, with DoRA on gate/up/down at ``impl``, traces the fused
    pair (bf16, 128 tokens)."""
    from dora_jax.models import llama

    cfg = llama.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=32)  # fmt: skip
    model = llama.LlamaForCausalLM(cfg, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    dora_jax.inject(model, target_modules=["gate_proj", "up_proj", "down_proj"], r=4,
                    lora_alpha=8, rngs=nnx.Rngs(1), impl=impl)  # fmt: skip
    ids = jax.random.randint(jax.random.key(0), (1, 128), 0, 64)
    return "swiglu_core" in str(jax.make_jaxpr(lambda ids: model(ids))(ids))


def test_the_llama_twin_fuses_its_mlp_pair():
    assert twin_fuses("mosaic")
    assert not twin_fuses("xla")
    assert not twin_fuses("auto")  # on the CPU
