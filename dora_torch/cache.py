"""Per-module cache of ‖W‖², the norm and the adapter casts: never read stale (docs/design.md §8).

A cached value is reused only while every tensor it was computed from is the *same object*
(weak reference) with the same storage (``data_ptr``), shape, dtype and version counter, AND
no ``torch.optim.Optimizer`` has stepped since it was computed. The version counter catches
in-place writes through the dispatcher (``copy_``, ``load_state_dict``, merges, foreach
optimizers); the process-wide optimizer-step counter (advanced by torch's global optimizer
step post-hook, which fires for every ``torch.optim.Optimizer`` subclass, fused ones included)
catches optimizers that write parameters without bumping versions (``AdamW(fused=True)``,
the default of ``transformers.Trainer``). Gradient-accumulation micro-batches and inference
calls between two optimizer steps pay for the norm once.

Compiled graphs cannot run these Python checks, so modules in eval mode also keep the norm in
a registered buffer (``DORA_NORM_BUFFER``) that is refreshed eagerly, outside any graph: when
the module enters eval mode, after ``load_state_dict``, after every step of an optimizer that
holds the module's W, A or B (one norm-group replay for a model's layers; the buffers of
other models stay as they are), by ``clear_caches`` and by eager calls that recompute the
norm. A compiled (or CUDA-graphed) eval-mode forward reads that buffer at a
fixed address. Modules attached with ``config.COMPILED_TRAIN_NORM = "buffer"`` keep it in
training mode too, and their compiled training graphs read it instead of computing the norm.

With ``config.COMPILED_BASE_SQ_BUFFER`` on, every module also keeps ‖W‖² in a second buffer
(``DORA_BASE_SQ_BUFFER``), the cache's own tensor, so eager recomputations update it in place;
it is re-pointed at the cache's value at attach time, on train/eval switches and
``dora_torch.Linear.unmerge``, after ``load_state_dict``, by ``clear_caches`` and after every
optimizer step. Compiled training graphs read it instead of
reducing W again (W is frozen); a write to W between two optimizer steps is not seen by a
compiled graph until the next of those events (docs/design.md §8, rule 5).

Parameters created under ``torch.inference_mode`` are inference tensors, without a version
counter: values computed from them are never reused (the norm is computed in every call).

Not detectable (documented limitation): writes that bypass both the version counter and
``torch.optim`` — ``p.data.copy_(...)``, or an optimizer that is not a ``torch.optim.Optimizer``.
After such writes call ``dora_torch.clear_caches(model)``.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import checks, config
from .dispatch import FUSED_DTYPES
from .matmul import as_dtype, compute_dtype
from .norm import base_sq_norm, detached_norm

#: Name of the non-persistent buffer that holds the eval-mode norm on each DoRA module.
DORA_NORM_BUFFER = "dora_norm"
#: Name of the non-persistent buffer that holds ‖W‖² for compiled training graphs.
DORA_BASE_SQ_BUFFER = "dora_base_sq"

_optimizer_steps = 0
#: Every module with a cache (weak: no leak): their buffers follow optimizer steps.
_cached_modules: weakref.WeakSet = weakref.WeakSet()


def optimizer_steps() -> int:
    """Optimizer steps taken in this process by any ``torch.optim.Optimizer``."""
    return _optimizer_steps


def _count_step(optimizer, _args, _kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1
    refresh_buffers(list(_cached_modules), stepped=optimizer)


register_optimizer_step_post_hook(_count_step)


#: Modules attached while ``config.COMPILED_TRAIN_NORM`` was "buffer" carry this attribute.
TRAIN_NORM_BUFFER_ATTR = "_dora_train_norm_buffer"
COMPILED_TRAIN_NORMS = ("graph", "buffer")


def compiled_train_norm_buffer() -> bool:
    """Whether ``config.COMPILED_TRAIN_NORM`` asks modules attached now to keep their norm
    buffer in training mode ("buffer"); ValueError naming the setting for an unknown value."""
    where = config.COMPILED_TRAIN_NORM
    if where not in COMPILED_TRAIN_NORMS:
        raise ValueError(
            f"dora_torch.config.COMPILED_TRAIN_NORM must be one of {COMPILED_TRAIN_NORMS}; "
            f"got {where!r}"
        )
    return where == "buffer"


def keeps_norm_buffer(module: torch.nn.Module) -> bool:
    """Whether compiled graphs of ``module`` read its norm buffer, which must then follow
    every update: in eval mode, and in training mode too for a module attached with
    ``config.COMPILED_TRAIN_NORM = "buffer"`` (otherwise training graphs compute the norm
    themselves)."""
    return not module.training or getattr(module, TRAIN_NORM_BUFFER_ATTR, False)


def refresh_buffers(modules, stepped: torch.optim.Optimizer | None = None) -> None:
    """Bring the norm buffers (of modules that keep one) and ‖W‖² buffers of ``modules`` up to
    date after an update: one ``NormGroup.refresh_buffers`` per group with such a member
    (one replay for all its layers), then module by module what no group covered.

    ``stepped``: the optimizer whose step this follows. Its step changed no other tensors
    than its parameters, so a norm buffer is refreshed only where it holds the module's W, A
    or B (a group's, where it holds one member's): another model in the process (a reference
    or teacher model in eval mode) keeps its buffers, instead of recomputing every norm after
    each step of the model being trained. ‖W‖² is checked for every module either way."""
    held = _Holds(stepped)
    groups, pending = [], []  # pending: (module, its cache, whether its norm buffer follows)
    for module in modules:
        norm_cache = module_cache(module)
        if norm_cache is None:
            continue
        group = norm_cache.group
        listed = group is not None and any(g is group for g in groups)
        follows = keeps_norm_buffer(module) and (listed or held(module))
        if follows and group is not None and not listed:
            groups.append(group)
        pending.append((module, norm_cache, follows))
    done = {id(m) for group in groups for m in group.refresh_buffers()}
    for module, norm_cache, follows in pending:
        if id(module) not in done:
            if follows:
                refresh_norm_buffer(module)
            _refresh_base_sq(module, norm_cache)


class _Holds:
    """Whether an optimizer holds a module's W, A or B (the tensors of the adapter it
    computes), or True for every module when there is none; its parameters are listed on the
    first question only."""

    __slots__ = ("_ids", "_optimizer")

    def __init__(self, optimizer: torch.optim.Optimizer | None):
        self._optimizer, self._ids = optimizer, None

    def __call__(self, module: torch.nn.Module) -> bool:
        if self._optimizer is None:
            return True
        if self._ids is None:
            groups = self._optimizer.param_groups
            self._ids = {id(p) for group in groups for p in group["params"]}
        found = module._dora_tensors(module)
        return found is not None and any(id(t) in self._ids for t in found[:3])


class _Stamp:
    """Identity + version of one tensor at the time a value was computed. An inference tensor
    (created under ``torch.inference_mode``) has no version counter, so an in-place write to
    it could not be seen: its stamp never matches, and values computed from it are never
    reused."""

    __slots__ = ("meta", "ref")

    def __init__(self, t: torch.Tensor):
        self.ref = weakref.ref(t)
        self.meta = None
        if not t.is_inference():
            self.meta = (t.data_ptr(), t._version, t.shape, t.dtype, t.device)

    def matches(self, t: torch.Tensor) -> bool:
        if self.meta is None or self.ref() is not t:
            return False
        return self.meta == (t.data_ptr(), t._version, t.shape, t.dtype, t.device)


class NormCache:
    """Cached ‖W‖² (keyed on W) and the norm n with the adapters cast to the activation dtype
    (keyed on W, A, B, scaling, tier, dtype and the optimizer-step count) of one module."""

    def __init__(self) -> None:
        #: The ``norm_group.NormGroup`` that recomputes this cache's norm together with its
        #: model's other DoRA layers (one CUDA-graph replay), or None.
        self.group = None
        self._module = None  # weak: the module ``attach`` gave this cache to
        self.clear()

    def __getstate__(self) -> dict:
        """Pickled (``torch.save(model)``, ``copy.deepcopy``) without entries: they are keyed
        on the identities of tensors that the copy does not share."""
        return {"group": self.group, "module": None if self._module is None else self._module()}

    def __setstate__(self, state: dict) -> None:
        self.group, module = state["group"], state["module"]
        self._module = None if module is None else weakref.ref(module)
        self.clear()
        if module is not None:  # the copy's buffers follow optimizer steps as the original's
            follow_steps(module)

    def clear(self) -> None:
        self._base: tuple[_Stamp, torch.Tensor] | None = None
        self._state: tuple[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self.norm_computations = 0  # how often the norm was (re)computed; for tests and logs

    def base_sq(self, weight: torch.Tensor) -> torch.Tensor:
        """‖W_i‖² in the compute dtype (see ``norm.base_sq_norm``); W is frozen, so the
        optimizer-step count is not part of this key."""
        if self._base is None or not self._base[0].matches(weight):
            with torch.inference_mode(False):  # see ``state``
                self._set_base(weight, base_sq_norm(weight))
        return self._base[1]

    def cached_base_sq(self, weight: torch.Tensor) -> torch.Tensor | None:
        """‖W_i‖² if it is cached for ``weight`` as it is now, else None (computes nothing)."""
        base = self._base
        return base[1] if base is not None and base[0].matches(weight) else None

    def set_base_sq(self, weight: torch.Tensor, base_sq: torch.Tensor) -> None:
        """Record ‖W_i‖² of the current ``weight`` computed elsewhere (e.g. updated exactly
        after a low-rank write to W, as a ScaLoRA merge does), keyed on W as it is now."""
        self._set_base(weight, base_sq)

    def _set_base(self, weight: torch.Tensor, base_sq: torch.Tensor) -> None:
        # Written into the previous buffer when it fits: a captured norm group (CUDA graph)
        # reads ‖W‖² at that address, so a changed W does not force a new capture.
        old = None if self._base is None else self._base[1]
        if old is not base_sq and fits(old, base_sq):
            old.copy_(base_sq)
            base_sq = old
        self._base = (_Stamp(weight), base_sq)

    def install(self, weight, lora_A, lora_B, scaling: float, impl: str, dtype, value) -> None:
        """Record ``value`` = (n, a, b) as computed now from these tensors (``state``'s key)."""
        key = (scaling, impl, dtype, _optimizer_steps)
        self._state = ((_Stamp(weight), _Stamp(lora_A), _Stamp(lora_B), key), value)
        self.norm_computations += 1

    def state(
        self, weight, lora_A, lora_B, scaling: float, *, impl: str, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(n, a, b): the detached norm [d_out] in the compute dtype and lora_A, lora_B cast to
        ``dtype`` (detached; the same tensors when already in it). Recomputed only when W, A,
        B, scaling, the tier, the dtype or the optimizer-step count changed.

        The casts serve every call until the next parameter update: inference calls and the
        micro-batches of one optimizer step cast the adapters once (the autograd Function
        saves them for backward instead of recasting). Memory: r·(d_in + d_out) elements in
        ``dtype`` per layer while fp32 adapters are used with 16-bit activations (none
        otherwise); a forward holds these casts anyway.
        """
        key = (scaling, impl, dtype, _optimizer_steps)
        if self._state is not None:
            (sw, sa, sb, old_key), value = self._state
            if old_key == key and sa.matches(lora_A) and sb.matches(lora_B) and sw.matches(weight):
                return value
        checks.check_adapter(weight, lora_A, lora_B)  # named errors before any GEMM
        # A value computed under torch.inference_mode() would be an inference tensor, which a
        # later training step could not save for backward (validation between training steps).
        # Autocast off: the entry is keyed on the tensors, not on the caller's context, so it
        # must be the norm of the precision rule (docs/design.md §5) whoever computes it.
        # (Contexts only here, and only those that change something: a hit, every call but
        # one per update, pays for none; entering all three cost ~5 µs per miss.)
        args, device = (weight, lora_A, lora_B, scaling, impl, dtype), weight.device.type
        with torch.no_grad():
            if torch.is_inference_mode_enabled() or torch.is_autocast_enabled(device):
                with torch.inference_mode(False), torch.autocast(device, enabled=False):
                    value, installed = self._compute_entry(*args)
            else:
                value, installed = self._compute_entry(*args)
        if not installed:
            self.install(*args, value)
        return value

    def _compute_entry(self, weight, lora_A, lora_B, scaling, impl, dtype) -> tuple[tuple, bool]:
        """(value, installed) for ``state``: the group's refresh installs what it computes."""
        # Inference tensors are never cached (``_Stamp``), so a group refresh would recompute
        # every member in every layer's call: they compute alone.
        inference = weight.is_inference() or lora_A.is_inference() or lora_B.is_inference()
        if self.group is not None and not inference:
            value = self.group.refresh(self, weight, lora_A, lora_B, scaling, impl, dtype)
            if value is not None:
                return value, True
        value = compute_state(weight, lora_A, lora_B, self.base_sq(weight), scaling, impl, dtype)
        return value, False

    def norm(self, weight, lora_A, lora_B, scaling: float, *, impl: str) -> torch.Tensor:
        """Detached norm [d_out] (shares the entry of ``state`` for W's dtype)."""
        return self.state(weight, lora_A, lora_B, scaling, impl=impl, dtype=weight.dtype)[0]


def detached_cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` detached, in ``dtype`` (the same tensor when already in it): an adapter as the
    products see it."""
    t = t.detach()
    return t if t.dtype == dtype else t.to(dtype)


def compute_state(weight, lora_A, lora_B, base_sq, scaling: float, impl: str, dtype):
    """(n, a, b) of ``NormCache.state``, computed (arguments already checked)."""
    lora_A, lora_B = lora_A.detach(), lora_B.detach()  # once, for the casts and the norm
    a, b = as_dtype(lora_A, dtype), as_dtype(lora_B, dtype)
    n = detached_norm(weight, lora_A, lora_B, base_sq, scaling, impl == "fused", a_cast=a)
    return n, a, b


def module_cache(module: torch.nn.Module) -> NormCache | None:
    """The NormCache a DoRA module (``dora_torch.Linear``, an accelerated PEFT layer) owns."""
    return getattr(module, "_dora_norm_cache", None)


def attach(module: torch.nn.Module, tensors, weight_of) -> NormCache:
    """Give ``module`` a NormCache, an eval-norm buffer and the hooks that keep it fresh.

    ``tensors(module)`` returns ``(weight, lora_A, lora_B, scaling, impl)`` of the adapter
    the module computes, or None when it has none to compute (merged, disabled);
    ``weight_of(module)`` returns its frozen W alone, cheaply (the step hook asks for it per
    layer per step).
    """
    train_buffer = compiled_train_norm_buffer()
    cache = NormCache()
    cache._module = weakref.ref(module)
    setattr(module, TRAIN_NORM_BUFFER_ATTR, train_buffer)  # fixed for the module's life
    module._dora_norm_cache = cache
    module._dora_tensors = tensors
    module._dora_weight = weight_of
    for name in (DORA_NORM_BUFFER, DORA_BASE_SQ_BUFFER):
        if name not in module._buffers:
            module.register_buffer(name, torch.empty(0), persistent=False)
    module._dora_load_hook = module.register_load_state_dict_post_hook(_after_load)
    follow_steps(module)
    track_mode(module)
    return cache


def follow_steps(module: torch.nn.Module) -> None:
    """Have the optimizer-step hook keep ``module``'s buffers fresh (``attach`` does, and
    an unpickled cache for its module)."""
    _cached_modules.add(module)


def _after_load(module: torch.nn.Module, _incompatible_keys) -> None:
    refresh_norm_buffer(module)
    refresh_base_sq_buffer(module)


def detach_cache(module: torch.nn.Module) -> None:
    """Undo ``attach``."""
    _cached_modules.discard(module)
    handle = module.__dict__.pop("_dora_load_hook", None)
    if handle is not None:
        handle.remove()
    module._buffers.pop(DORA_NORM_BUFFER, None)
    module._buffers.pop(DORA_BASE_SQ_BUFFER, None)
    module.__dict__.pop("_dora_norm_cache", None)
    module.__dict__.pop("_dora_tensors", None)
    module.__dict__.pop("_dora_weight", None)
    module.__dict__.pop(TRAIN_NORM_BUFFER_ATTR, None)


def track_mode(module: torch.nn.Module) -> None:
    """Follow ``module.training``: a module that keeps a norm buffer (``keeps_norm_buffer``)
    has it refreshed now (and after every optimizer step); otherwise compiled graphs compute
    the norm themselves."""
    refresh_norm_buffer(module)
    refresh_base_sq_buffer(module)


def refresh_norm_buffer(module: torch.nn.Module) -> None:
    """Recompute (through the cache) the norm into the buffer of a module that keeps one
    (``keeps_norm_buffer``), in place when the shape and dtype allow (a CUDA-graph replay
    keeps reading the same address). Grad mode is left only where something is computed
    (the step hook calls this for every module: a ``no_grad`` context costs ~1 µs)."""
    cache = module_cache(module)
    if cache is None or not keeps_norm_buffer(module):
        return
    found = module._dora_tensors(module)
    if found is None:
        return
    weight, lora_A, lora_B, scaling, impl = found
    if _is_sharded(weight):
        return  # sharded at rest (FSDP2): forwards see whole tensors and refresh it themselves
    with torch.no_grad(), torch.inference_mode(False):
        # The tier a forward would pick (dispatch.resolve_impl without the token count), so
        # the eager forward finds this entry instead of recomputing under another key.
        fused_ok = weight.is_cuda and weight.dtype in FUSED_DTYPES
        tier = "fused" if impl != "eager" and fused_ok else "eager"
        n = cache.norm(weight, lora_A, lora_B, scaling, impl=tier)
        write_norm_buffer(module, n)


def refresh_base_sq_buffer(module: torch.nn.Module) -> None:
    """Point the module's ‖W‖² buffer at the cache's value for W as it is now (recomputed
    only when W changed), when ``config.COMPILED_BASE_SQ_BUFFER`` is on. The buffer is the
    cache's tensor itself, so eager recomputations write it in place and nothing is copied
    per step. Sharded weights (FSDP2 at rest) leave it empty: their graphs reduce W."""
    cache = module_cache(module)
    if cache is not None:
        _refresh_base_sq(module, cache)


def _refresh_base_sq(module: torch.nn.Module, cache: NormCache) -> None:
    """``refresh_base_sq_buffer`` with the module's cache in hand. The step hook runs it for
    every module after every optimizer step: the usual case (W unchanged) returns before any
    context is entered."""
    if not config.COMPILED_BASE_SQ_BUFFER:
        return
    buf = module._buffers.get(DORA_BASE_SQ_BUFFER)
    if buf is not None and cache.cached_base_sq(module._dora_weight(module)) is buf:
        return  # W unchanged and the buffer already its value: skip the adapter lookup
    found = module._dora_tensors(module)
    if found is None or _is_sharded(found[0]):
        return
    with torch.no_grad():
        base_sq = cache.base_sq(found[0])  # leaves inference mode itself when it recomputes
    if module._buffers.get(DORA_BASE_SQ_BUFFER) is not base_sq:
        module._buffers[DORA_BASE_SQ_BUFFER] = base_sq


def compiled_base_sq(module: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """The ‖W‖² a compiled training graph reads (``config.COMPILED_BASE_SQ_BUFFER``), or None
    to reduce W in the graph: never refreshed, or of another shape or dtype than W's."""
    if not config.COMPILED_BASE_SQ_BUFFER:
        return None
    buf = module._buffers.get(DORA_BASE_SQ_BUFFER)
    want = (weight.shape[0],)
    if buf is None or tuple(buf.shape) != want or buf.dtype != compute_dtype(weight.dtype):
        return None
    return buf


def _is_sharded(t: torch.Tensor) -> bool:
    """A DTensor: a parameter FSDP2 or tensor parallelism holds sharded between forwards."""
    if type(t) is torch.nn.Parameter or type(t) is torch.Tensor:
        return False  # the common case, asked per layer per update: skip the import below
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def fits(buf: torch.Tensor | None, value: torch.Tensor) -> bool:
    """Whether ``value`` can be copied into ``buf`` in place (same type, shape, dtype and
    device), which keeps the address a captured graph reads."""
    return (
        buf is not None
        and type(buf) is type(value)
        and buf.shape == value.shape
        and buf.dtype == value.dtype
        and buf.device == value.device
    )


def write_norm_buffer(module: torch.nn.Module, n: torch.Tensor) -> None:
    """Write ``n`` into the module's norm buffer, in place when it fits."""
    buf = module._buffers.get(DORA_NORM_BUFFER)
    if fits(buf, n):
        if buf is not n:
            buf.copy_(n)
    else:
        module._buffers[DORA_NORM_BUFFER] = n.clone()


def clear_caches(model: torch.nn.Module) -> int:
    """Drop every cached norm, ‖W‖² and adapter cast held by dora_torch in ``model``
    (``dora_torch.Linear`` layers and layers accelerated by ``accelerate_peft``) and refresh
    the eval-mode norm buffers.

    Needed only after parameter writes that bypass both version counters and
    ``torch.optim`` (see the module doc). Returns the number of caches cleared.
    """
    count = 0
    for module in model.modules():
        cache = module_cache(module)
        if cache is None:
            continue
        cache.clear()
        refresh_norm_buffer(module)
        refresh_base_sq_buffer(module)
        count += 1
    return count
