"""A compact Llama-style causal LM in Flax nnx, loadable from a transformers ``LlamaForCausalLM``.

Its job is interop: a Flax twin of a PyTorch Llama, so an adapter trained in one
framework can be checked (logits) in the other. Attribute names mirror
transformers' module tree (``model.layers.0.self_attn.q_proj``, ``mlp.down_proj``,
``lm_head``, ...), so a PEFT module path is also this model's nnx path and the
adapter key map is the identity (see ``dora_jax.interop.adapter_io``).

The numerics follow transformers' eager Llama: RMSNorm in float32, rotary
embeddings from ``inv_freq = θ^(-2i/d)`` with ``rotate_half`` (LlamaRotaryEmbedding,
"default" rope type), grouped-query attention with a causal mask and a float32
softmax, SwiGLU MLP, and an ``lm_head`` tied to the embedding when the config says
so. Only full-sequence forward (no KV cache, no padding mask): enough for logits
parity and training.

Shapes: ``input_ids`` int [batch, seq] → logits [batch, seq, vocab] in the
parameters' dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from ..swiglu import swiglu


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture fields of a transformers ``LlamaConfig`` this model uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings; got {self.head_dim}")

    @classmethod
    def from_hf(cls, hf_config) -> LlamaConfig:
        """From a transformers ``LlamaConfig`` (4.x ``rope_theta`` or 5.x ``rope_parameters``)."""
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        legacy = dict(getattr(hf_config, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported; only 'default'")
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        heads = hf_config.num_attention_heads
        return cls(
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(theta),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        )


class RMSNorm(nnx.Module):
    """``weight · x / sqrt(mean(x²) + eps)``, normalised in float32 (as transformers)."""

    def __init__(self, size: int, *, eps: float, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((size,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * h.astype(x.dtype)


def rotary_cos_sin(positions: jax.Array, head_dim: int, theta: float, dtype):
    """cos, sin [*positions.shape, head_dim] as transformers' LlamaRotaryEmbedding builds them."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions[..., None].astype(jnp.float32) * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def _rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rotary(x, cos, sin):
    """x [batch, seq, heads, head_dim]; cos, sin [batch, seq, head_dim]."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + _rotate_half(x) * sin


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, param_dtype, rngs: nnx.Rngs):
        d, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        kw = dict(use_bias=cfg.attention_bias, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = nnx.Linear(cfg.hidden_size, h * d, **kw)
        self.k_proj = nnx.Linear(cfg.hidden_size, kv * d, **kw)
        self.v_proj = nnx.Linear(cfg.hidden_size, kv * d, **kw)
        self.o_proj = nnx.Linear(h * d, cfg.hidden_size, **kw)
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d

    def __call__(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (self.head_dim**-0.5)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, -1)
        return self.o_proj(out)


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, param_dtype, rngs: nnx.Rngs):
        kw = dict(use_bias=cfg.mlp_bias, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.up_proj = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down_proj = nnx.Linear(cfg.intermediate_size, cfg.hidden_size, **kw)

    def __call__(self, x):
        # silu(gate(x)) · up(x); two DoRA projections share one backward pass (dora_jax.swiglu)
        return self.down_proj(swiglu(self.gate_proj, self.up_proj, x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, param_dtype, rngs: nnx.Rngs):
        self.self_attn = Attention(cfg, param_dtype=param_dtype, rngs=rngs)
        self.mlp = MLP(cfg, param_dtype=param_dtype, rngs=rngs)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=eps, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=eps, param_dtype=param_dtype)

    def __call__(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, param_dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, param_dtype=param_dtype, rngs=rngs
        )
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, param_dtype=param_dtype, rngs=rngs)
                for _ in range(cfg.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta

    def __call__(self, input_ids, positions=None):
        x = self.embed_tokens(input_ids)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nnx.Module):
    """Causal LM: ``model`` (embeddings, decoder layers, final norm) and ``lm_head``.

    ``lm_head`` is None when the embedding is tied (logits = h · embeddingᵀ).
    """

    def __init__(self, cfg: LlamaConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.model = LlamaModel(cfg, param_dtype=param_dtype, rngs=rngs)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nnx.Linear(
                cfg.hidden_size, cfg.vocab_size, use_bias=False, param_dtype=param_dtype, rngs=rngs
            )
        )

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """input_ids int [batch, seq]; positions int [batch, seq] (default 0..seq-1) →
        logits [batch, seq, vocab]."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq]; got shape {input_ids.shape}")
        h = self.model(input_ids, positions)
        if self.lm_head is None:
            return self.model.embed_tokens.attend(h)
        return self.lm_head(h)


def _expected_params(model: LlamaForCausalLM) -> dict[str, tuple[nnx.Variable, bool]]:
    """transformers state-dict key → (this model's Variable, whether it is a transposed kernel)."""
    out: dict[str, tuple[nnx.Variable, bool]] = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Variable) or not isinstance(node, nnx.Param):
            continue
        *mod, leaf = (str(p) for p in path)
        prefix = ".".join(mod)
        if leaf == "kernel":
            out[f"{prefix}.weight"] = (node, True)
        elif leaf == "embedding":
            out[f"{prefix}.weight"] = (node, False)
        else:  # bias, RMSNorm weight
            out[f"{prefix}.{leaf}"] = (node, False)
    return out


def from_torch_state_dict(cfg, state_dict: Mapping[str, object], *, dtype=None) -> LlamaForCausalLM:
    """Build the nnx twin of a transformers ``LlamaForCausalLM`` from its ``state_dict()``.

    cfg: a ``LlamaConfig`` of this module or a transformers ``LlamaConfig``.
    state_dict: tensor-likes (torch tensors, NumPy or JAX arrays) in PyTorch layout;
    linear weights [out, in] become Flax kernels [in, out]. Torch tensors cross via
    DLPack (``dora_jax.interop.dlpack``). dtype: cast every parameter to it; by default
    each keeps its state-dict dtype. Raises ValueError listing every missing,
    unexpected or mis-shaped key.
    """
    from ..interop.dlpack import as_jax

    if not isinstance(cfg, LlamaConfig):
        cfg = LlamaConfig.from_hf(cfg)
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    expected = _expected_params(model)
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    problems = [f"missing key {k!r}" for k in sorted(set(expected) - set(state_dict))]
    problems += [
        f"unexpected key {k!r}"
        for k in sorted(set(state_dict) - set(expected) - ignorable)
        if not k.endswith("rotary_emb.inv_freq")
    ]
    arrays = {}
    for key in sorted(set(expected) & set(state_dict)):
        var, transposed = expected[key]
        a = as_jax(state_dict[key])
        a = a.T if transposed else a
        if a.shape != var.get_value().shape:
            want = var.get_value().shape[::-1] if transposed else var.get_value().shape
            problems.append(
                f"{key}: shape {tuple(a.shape[::-1] if transposed else a.shape)}, "
                f"expected {tuple(want)}"
            )
        arrays[key] = a if dtype is None else a.astype(dtype)
    if problems:
        raise ValueError(
            "state_dict does not match the Llama config:\n  - " + "\n  - ".join(problems)
        )
    device = jax.devices()[0]  # a CPU torch tensor arrives on JAX's CPU device: move it
    for key, a in arrays.items():
        # jnp.array copies: the torch side may later change a buffer shared through DLPack
        expected[key][0].set_value(jax.device_put(jnp.array(a), device))
    return model
