"""Interop for dora_torch: PEFT acceleration in place, injection and PEFT-format adapter files.

accelerate_peft(peft_model) / restore_peft(peft_model)   PEFT DoRA layers on our kernels
inject(model, target_modules=..., r=..., lora_alpha=...)  nn.Linear → dora_torch.Linear
save_adapter(model, path) / load_adapter(model, path)     PEFT's adapter directory format
"""

from .adapter_io import load_adapter, save_adapter
from .inject import dora_layers, inject
from .peft_accel import AccelerationReport, accelerate_peft, restore_peft

__all__ = [
    "AccelerationReport",
    "accelerate_peft",
    "dora_layers",
    "inject",
    "load_adapter",
    "restore_peft",
    "save_adapter",
]
