"""transformers.Trainer with its DEFAULT optimizer (fused AdamW, which writes parameters
without bumping version counters) on an accelerated PEFT DoRA model logs the same loss as
PEFT's own DoRA, step for step (the stale-norm bug of docs/design.md §8 shows up here)."""

from __future__ import annotations

import torch

import dora_torch

from .models import peft_dora, tiny_llama, token_ids

STEPS = 6


class _Data(torch.utils.data.Dataset):
    def __init__(self, cfg):
        self.ids = token_ids(cfg, batch=STEPS * 2, seq=10, seed=3)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _losses(accelerate: bool, tmp_path) -> list[float]:
    from transformers import Trainer, TrainingArguments

    model = peft_dora(tiny_llama(), target_modules=("q_proj", "v_proj", "up_proj", "down_proj"))
    if accelerate:
        dora_torch.accelerate_peft(model, impl="eager")
    args = TrainingArguments(
        output_dir=str(tmp_path / ("ours" if accelerate else "peft")),
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=5e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    assert "fused" in str(args.optim).lower()  # the default this test is about
    trainer = Trainer(model=model, args=args, train_dataset=_Data(model.config))
    trainer.train()
    if accelerate:
        layers = [m for m in model.modules() if hasattr(m, "_dora_norm_cache")]
        assert layers and all(m.last_impl == "eager" for m in layers)  # our path ran
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_default_optimizer_follows_peft_step_for_step(tmp_path):
    peft = _losses(False, tmp_path)
    ours = _losses(True, tmp_path)
    assert len(peft) == len(ours) == STEPS
    # The loss moves by ~1e-1 per step at this learning rate: a stale norm shows at once.
    assert abs(peft[-1] - peft[0]) > 1e-2
    for step, (a, b) in enumerate(zip(peft, ours)):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (step, a, b)
