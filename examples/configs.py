"""Named sizes for the demo and the convergence benchmark: a Llama-style model and its run.

``tiny`` is the CPU default (a few minutes on 2 cores for the whole demo); ``small`` and
``base`` are for a GPU; ``micro`` is for tests. Models are built from these with random
weights (fixed seed); nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

# The seven projections of a Llama block: DoRA goes on all of them (as in the paper's runs).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class RunConfig:
    """One model size and its fine-tuning run.

    Model: ``hidden`` (d_model), ``intermediate`` (MLP width), ``layers``, ``heads``,
    ``kv_heads`` (grouped-query attention). Run: ``seq_len`` tokens per sequence,
    ``batch_size`` sequences per step, ``steps`` optimizer steps (AdamW, ``lr``). Adapter:
    DoRA rank ``rank`` and ``alpha`` (scaling = alpha / rank) on ``TARGET_MODULES``.

    Learning rates stay below the point where training turns chaotic: there, two runs that
    differ only by rounding drift apart exponentially (``tiny`` at lr 3e-3 did after ~160
    steps, on PEFT vs ours and regardless of which is right), and the per-step loss comparison
    would measure the dynamics instead of the implementations.
    """

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    seq_len: int
    batch_size: int
    steps: int
    rank: int
    alpha: float
    lr: float


CONFIGS: dict[str, RunConfig] = {
    c.name: c
    for c in [
        # name, hidden, intermediate, layers, heads, kv_heads, seq_len, batch_size
        RunConfig("micro", 32, 64, 2, 4, 2, 32, 2, steps=4, rank=4, alpha=8, lr=3e-3),
        RunConfig("tiny", 128, 352, 4, 4, 2, 128, 8, steps=200, rank=8, alpha=16, lr=1e-3),
        RunConfig("small", 512, 1408, 8, 8, 4, 256, 16, steps=2000, rank=16, alpha=32, lr=5e-4),
        RunConfig("base", 1024, 2816, 12, 16, 4, 512, 16, steps=1000, rank=64, alpha=128, lr=2e-4),
    ]
}


def get_config(name: str) -> RunConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; choose one of {sorted(CONFIGS)}")
    return CONFIGS[name]


def llama_config(cfg: RunConfig, *, vocab_size: int):
    """The transformers ``LlamaConfig`` for ``cfg`` (untied embeddings, no attention dropout)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=max(2 * cfg.seq_len, 256),
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
