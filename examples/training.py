"""Build the demo's model, wrap it with PEFT's DoRA or ours, and fine-tune it step by step.

Both providers start from the same base weights and the same adapter initialisation (PEFT's),
see the same batches and use the same optimizer, so their per-step losses differ only by how
DoRA is computed. "Ours" comes in two forms (``OURS``): PEFT's model accelerated in place by
``dora_torch.interop.accelerate_peft``, or ``dora_torch.Linear`` layers injected into the plain
model (no PEFT at run time).
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .configs import TARGET_MODULES, RunConfig, llama_config
from .memory import PeakMemory

# Steps left out of the median step time: the first ones pay for allocator growth, lazy
# initialisation (optimizer state, kernels' first compile/autotune) and caches warming up.
WARMUP_STEPS = 5


def build_base_model(cfg: RunConfig, *, vocab_size: int, seed: int):
    """A randomly initialised transformers ``LlamaForCausalLM`` (fp32, CPU), frozen-to-be base.

    The same ``seed`` gives the same weights on any machine; move/cast it with ``.to(...)``.
    """
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(cfg, vocab_size=vocab_size))
    return model.eval()


def peft_dora(base, cfg: RunConfig, *, seed: int, autocast_adapter_dtype: bool = True):
    """PEFT's DoRA on all seven projections of a deep copy of ``base``.

    ``seed`` fixes the adapters' random init (PEFT draws lora_A from torch's global RNG).
    ``autocast_adapter_dtype=True`` is PEFT's default: adapters in fp32 over a bf16 base.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        use_dora=True,
        lora_dropout=0.0,
        target_modules=list(TARGET_MODULES),
    )
    torch.manual_seed(seed)
    return get_peft_model(
        copy.deepcopy(base), config, autocast_adapter_dtype=autocast_adapter_dtype
    )


class OursAccelerate:
    """Ours as a PEFT user gets it: ``accelerate_peft`` on (a copy of) the PEFT model.

    Saving is PEFT's own ``save_pretrained``; reloading is PEFT's ``from_pretrained`` + ours.
    """

    name = "accelerate_peft"

    def from_peft(self, peft_model, work_base):
        from dora_torch.interop import accelerate_peft

        return accelerate_peft(copy.deepcopy(peft_model))  # same adapter init, bit for bit

    def save(self, model, path) -> None:
        model.save_pretrained(str(path))

    def load(self, base, path):
        from peft import PeftModel

        from dora_torch.interop import accelerate_peft

        return accelerate_peft(PeftModel.from_pretrained(copy.deepcopy(base), str(path)))


class OursInject:
    """Ours without PEFT at run time: ``dora_torch.Linear`` layers in the plain transformers model.

    The starting point is PEFT's freshly initialised adapter, written by PEFT and read by
    ``dora_torch.interop.load_adapter`` (which injects the layers the file names), so both runs
    start from the same values; saving is ``dora_torch.interop.save_adapter`` (PEFT's format).
    """

    name = "inject"

    def from_peft(self, peft_model, work_base):
        with tempfile.TemporaryDirectory() as tmp:
            peft_model.save_pretrained(tmp)
            return self.load(work_base, tmp)

    def save(self, model, path) -> None:
        from dora_torch.interop import save_adapter

        save_adapter(model, str(path))

    def load(self, base, path):
        from dora_torch.interop import load_adapter

        return load_adapter(copy.deepcopy(base), str(path))


OURS = {"inject": OursInject(), "accelerate": OursAccelerate()}


@dataclass
class TrainResult:
    """Per-step losses and wall times (ms) of one run; peak memory over the run's start."""

    losses: list[float]
    step_ms: list[float]
    peak_bytes: int
    memory_kind: str

    @property
    def median_step_ms(self) -> float:
        times = self.step_ms[WARMUP_STEPS:] or self.step_ms
        return float(np.median(times))


def progress(iterable: Iterable, *, total: int, desc: str) -> Iterator:
    """A tqdm bar when tqdm is installed, else a counter printed every ~10%."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(iterable, total=total, desc=desc, leave=True)
        return
    every = max(1, total // 10)
    for i, item in enumerate(iterable):
        if i % every == 0 or i == total - 1:
            print(f"{desc}: step {i + 1}/{total}", flush=True)
        yield item


def train(model, batches: np.ndarray, *, lr: float, device, desc: str = "train") -> TrainResult:
    """Fine-tune the trainable parameters of ``model`` on ``batches`` with AdamW.

    batches: int64 [steps, batch, seq_len + 1] token windows (``corpus.sample_batches``); each
    window is passed as both ``input_ids`` and ``labels`` (the model shifts internally).
    Weight decay is 0 so only the gradients move the parameters. Returns a ``TrainResult``.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters (requires_grad=True): nothing to train")
    batches = np.asarray(batches)
    if batches.ndim != 3:
        raise ValueError(f"batches must be [steps, batch, seq_len + 1]; got shape {batches.shape}")
    device = torch.device(device)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    losses, step_ms = [], []
    with PeakMemory(device) as mem:
        for i in progress(range(len(batches)), total=len(batches), desc=desc):
            t0 = time.perf_counter()
            ids = torch.as_tensor(batches[i], device=device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())  # .item() waits for the device: the time is the step's
            step_ms.append((time.perf_counter() - t0) * 1e3)
    model.eval()
    return TrainResult(losses, step_ms, mem.peak_bytes, mem.kind)


@torch.no_grad()
def torch_logits(model, ids: np.ndarray, *, device) -> np.ndarray:
    """Logits of ``model`` (eval mode) for int ids [batch, seq] as float64 [batch, seq, vocab]."""
    model.eval()
    out = model(input_ids=torch.as_tensor(ids, device=torch.device(device))).logits
    return out.double().cpu().numpy()
