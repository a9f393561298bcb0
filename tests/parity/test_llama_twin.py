"""The Flax nnx Llama twin reproduces transformers' LlamaForCausalLM logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dora_jax.models import llama
from tests.parity.models import tiny_llama, token_ids


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True, "num_key_value_heads": 4},
        {"attention_bias": True, "mlp_bias": True, "rope_theta": 500.0, "head_dim": 16},
    ],
    ids=["gqa", "tied_mha", "bias_theta_headdim"],
)
def test_logits_match_transformers(overrides):
    hf = tiny_llama(seed=1, **overrides)
    ids = token_ids(hf.config, seq=16)
    with torch.no_grad():
        want = hf(ids).logits.numpy()
    jm = llama.from_torch_state_dict(hf.config, hf.state_dict())
    got = np.asarray(jm(jnp.asarray(ids.numpy())))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # The tied case must really read the embedding (there is no lm_head).
    assert (jm.lm_head is None) == hf.config.tie_word_embeddings


def test_state_dict_errors_list_every_problem():
    hf = tiny_llama()
    sd = dict(hf.state_dict())
    del sd["model.norm.weight"]
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:, :8]
    sd["extra.weight"] = torch.zeros(3)
    with pytest.raises(ValueError) as e:
        llama.from_torch_state_dict(hf.config, sd)
    msg = str(e.value)
    assert "missing key 'model.norm.weight'" in msg
    assert "unexpected key 'extra.weight'" in msg
    assert "model.layers.0.mlp.up_proj.weight: shape (48, 8), expected (48, 32)" in msg


def test_unsupported_rope_is_rejected():
    hf_cfg = tiny_llama().config
    hf_cfg.rope_parameters = {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match="rope type 'linear'"):
        llama.LlamaConfig.from_hf(hf_cfg)
