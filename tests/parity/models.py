"""Tiny transformers Llama models and PEFT DoRA wrappers shared by the parity tests.

Everything is random-initialised from a config: nothing is downloaded.
"""

from __future__ import annotations

import torch

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama_config(**overrides):
    """A transformers LlamaConfig small enough for CPU tests (GQA: 4 heads, 2 kv heads)."""
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_llama(seed: int = 0, **overrides):
    """A random transformers LlamaForCausalLM in eval mode, fp32, with non-trivial norms."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).eval()
    with torch.no_grad():  # RMSNorm weights start at 1; make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1.0 + 0.2 * torch.randn_like(p))
    return model


def token_ids(cfg, *, batch: int = 2, seq: int = 12, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


def randomize_dora(peft_model, seed: int = 0, *, scale: float = 0.3) -> None:
    """Give every PEFT DoRA adapter non-trivial B and magnitude (PEFT starts at B = 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif "lora_magnitude_vector" in name:
                p.mul_(1.0 + 0.2 * torch.randn(p.shape, generator=g))


def peft_dora(model, *, target_modules=("q_proj", "v_proj"), r=4, lora_alpha=8, seed=0, **kw):
    """Wrap ``model`` with a PEFT DoRA adapter (randomised so it changes the output)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=r, lora_alpha=lora_alpha, use_dora=True, target_modules=list(target_modules), **kw
    )
    pm = get_peft_model(model, cfg)
    randomize_dora(pm, seed)
    return pm.eval()
