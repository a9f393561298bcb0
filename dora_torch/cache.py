"""Per-module cache of ‖W‖², the norm and the adapter casts, invalidated by tensor versions.

A cached value is reused only while every tensor it was computed from is the *same object*
(weak reference), with the same storage (``data_ptr``), shape, dtype and version counter
(``_version`` increases on every in-place write: optimizer steps, ``copy_``, merges). So an
optimizer step, ``load_state_dict`` or a replaced weight invalidates it at once, and
gradient-accumulation micro-batches or inference calls pay for the norm once.

Not detectable (documented limitation): writes that bypass the version counter, i.e. through
``tensor.data`` (``p.data.copy_(...)``) or by code outside PyTorch's dispatcher (some fused or
sharded optimizers). After such writes call ``dora_torch.clear_caches(model)`` (e.g. from
``optimizer.register_step_post_hook``).
"""

from __future__ import annotations

import weakref

import torch

from . import checks
from .norm import base_sq_norm, detached_norm


class _Stamp:
    """Identity + version of one tensor at the time a value was computed."""

    __slots__ = ("meta", "ref")

    def __init__(self, t: torch.Tensor):
        self.ref = weakref.ref(t)
        self.meta = (t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device)

    def matches(self, t: torch.Tensor) -> bool:
        return self.ref() is t and self.meta == (
            t.data_ptr(),
            t._version,
            tuple(t.shape),
            t.dtype,
            t.device,
        )


class NormCache:
    """Cached ‖W‖² (keyed on W) and, per module call signature, the norm n with the adapters
    cast to the activation dtype (keyed on W, A, B, scaling, tier, dtype) of one module."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._base: tuple[_Stamp, torch.Tensor] | None = None
        self._state: tuple[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self.norm_computations = 0  # how often the norm was (re)computed; for tests and logs

    def base_sq(self, weight: torch.Tensor) -> torch.Tensor:
        if self._base is None or not self._base[0].matches(weight):
            with torch.inference_mode(False):  # see ``state``
                self._base = (_Stamp(weight), base_sq_norm(weight))
        return self._base[1]

    @torch.no_grad()
    def state(
        self, weight, lora_A, lora_B, scaling: float, *, impl: str, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(n, a, b): the detached fp32 norm [d_out] and lora_A, lora_B cast to ``dtype``
        (detached; the same tensors when already in it). Recomputed only when W, A, B,
        scaling, the tier or the dtype changed.

        The casts serve every call until the next parameter update: inference calls and the
        micro-batches of one optimizer step cast the adapters once (the fused autograd
        Function saves them for backward instead of recasting). Memory: r·(d_in + d_out)
        elements in ``dtype`` per layer while fp32 adapters are used with 16-bit activations
        (none otherwise); a forward holds these casts anyway.
        """
        if self._state is not None:
            (sw, sa, sb, key), value = self._state
            if key == (scaling, impl, dtype) and sa.matches(lora_A) and sb.matches(lora_B):
                if sw.matches(weight):
                    return value
        checks.check_adapter(weight, lora_A, lora_B)  # named errors before any GEMM
        base_sq = self.base_sq(weight)
        # A value computed under torch.inference_mode() would be an inference tensor, which a
        # later training step could not save for backward (validation between training steps).
        with torch.inference_mode(False):
            a, b = lora_A.detach().to(dtype), lora_B.detach().to(dtype)
            # The norm's GEMM casts A to W's dtype on CUDA: reuse the cast when it is that one.
            a_norm = a if dtype == weight.dtype and weight.is_cuda else lora_A.detach()
            n = detached_norm(weight, a_norm, lora_B.detach(), base_sq, scaling, impl == "fused")
        self._state = ((_Stamp(weight), _Stamp(lora_A), _Stamp(lora_B), (scaling, impl, dtype)),
                       (n, a, b))  # fmt: skip
        self.norm_computations += 1
        return n, a, b

    def norm(self, weight, lora_A, lora_B, scaling: float, *, impl: str) -> torch.Tensor:
        """Detached fp32 norm [d_out] (shares the entry of ``state`` for W's dtype)."""
        return self.state(weight, lora_A, lora_B, scaling, impl=impl, dtype=weight.dtype)[0]


def clear_caches(model: torch.nn.Module) -> int:
    """Drop every cached norm, ‖W‖² and adapter cast held by dora_torch in ``model``
    (``dora_torch.Linear`` layers and layers accelerated by ``accelerate_peft``).

    Needed only after parameter writes that bypass version counters (see the module doc).
    Returns the number of caches cleared.
    """
    caches = [v for mod in model.modules() for v in vars(mod).values() if isinstance(v, NormCache)]
    for cache in caches:
        cache.clear()
    return len(caches)
