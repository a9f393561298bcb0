"""Per-module cache of ‖W‖² and of the detached norm, invalidated by tensor versions.

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

from .norm import base_sq_norm, factored_norm


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
    """Cached ‖W‖² (keyed on W) and norm n (keyed on W, A, B, scaling, tier) of one module."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._casts: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._base: tuple[_Stamp, torch.Tensor] | None = None
        self._norm: tuple[tuple, torch.Tensor] | None = None
        self.norm_computations = 0  # how often the norm was (re)computed; for tests and logs

    def base_sq(self, weight: torch.Tensor) -> torch.Tensor:
        if self._base is None or not self._base[0].matches(weight):
            with torch.inference_mode(False):  # see ``norm``
                self._base = (_Stamp(weight), base_sq_norm(weight))
        return self._base[1]

    @torch.no_grad()
    def norm(self, weight, lora_A, lora_B, scaling: float, *, impl: str) -> torch.Tensor:
        """Detached fp32 norm [d_out]; recomputed only when W, A, B, scaling or impl changed."""
        base_sq = self.base_sq(weight)
        if self._norm is not None:
            (sw, sa, sb, s, tier), n = self._norm
            if sw.matches(weight) and sa.matches(lora_A) and sb.matches(lora_B):
                if s == scaling and tier == impl:
                    return n
        # A value computed under torch.inference_mode() would be an inference tensor, which a
        # later training step could not save for backward (validation between training steps).
        with torch.inference_mode(False):
            n = factored_norm(weight, lora_A, lora_B, scaling, base_sq=base_sq, impl=impl)
        self._norm = ((_Stamp(weight), _Stamp(lora_A), _Stamp(lora_B), scaling, impl), n)
        self.norm_computations += 1
        return n

    @torch.no_grad()
    def adapters_in(self, lora_A, lora_B, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """lora_A, lora_B cast to the activation dtype, reused while both are unchanged.

        For calls without gradients only (inference): the casts are detached. Saves two
        cast kernels per call, which matters when small layers are bound by host overhead.
        """
        if lora_A.dtype == dtype and lora_B.dtype == dtype:
            return lora_A, lora_B
        if self._casts is not None:
            (sa, sb, dt), casts = self._casts
            if dt == dtype and sa.matches(lora_A) and sb.matches(lora_B):
                return casts
        with torch.inference_mode(False):
            casts = (lora_A.detach().to(dtype), lora_B.detach().to(dtype))
        self._casts = ((_Stamp(lora_A), _Stamp(lora_B), dtype), casts)
        return casts


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
