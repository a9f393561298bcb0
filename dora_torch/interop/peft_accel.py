"""Run a Hugging Face PEFT DoRA model on dora_torch's kernels, in place.

``accelerate_peft(peft_model)`` gives every eligible PEFT ``lora.Linear`` layer an
instance-level ``forward`` that calls ``dora_torch.functional.dora_linear`` on the
layer's own Parameters (``base_layer.weight/bias``, ``lora_A[a].weight``,
``lora_B[a].weight``, ``lora_magnitude_vector[a].weight``, ``scaling[a]``). Nothing
else changes: the same Parameter objects are trained, so optimizer state,
``state_dict``, ``save_pretrained`` and ``PeftModel.from_pretrained`` keep working,
and ``restore_peft`` deletes the instance attribute to undo it.

Per call, the accelerated forward handles the common case — one active adapter,
which is a DoRA adapter on this layer; adapters enabled and not merged; no extra
forward arguments (``adapter_names`` mixed batches etc.); x in the base weight's
dtype (not autocast); frozen base weight; dropout off or ``nn.Dropout`` — and
otherwise calls PEFT's own ``forward``, so no state is ever computed wrongly.

Layers that cannot be accelerated at all are left untouched and listed with the
reason in the returned model's ``dora_acceleration_report`` (and a warning):
non-Linear LoRA layers (Conv, Embedding, ...), ``lora.Linear`` subclasses and
quantized or non-``nn.Linear`` bases (bitsandbytes, torchao, GPT-2 Conv1D), LoRA
bias, layers with no DoRA adapter.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import cache
from ..checks import FLOAT_DTYPES, check_impl, check_module_selection, selected_modules
from ..functional import module_dora_linear
from ..norm_group import group_norms
from ..stacking import StackedWeights

REPORT_ATTR = "dora_acceleration_report"
IMPL_ATTR = "_dora_impl"  # the tier accelerate_peft was asked for ("auto" | "fused" | "eager")
RECOMPUTE_ATTR = "_dora_recompute_inner"  # selected by accelerate_peft's recompute_modules
STACK_ATTR = "_dora_stack"  # a StackedWeights (accelerate_peft's stack_modules) or None


@dataclass
class AccelerationReport:
    """Which PEFT layers run on dora_torch (``accelerated``; ``recomputed`` and ``stacked``:
    those of them ``recompute_modules`` and ``stack_modules`` selected) and which stay on
    PEFT's path (``skipped``: module name → reason). Names are
    ``peft_model.named_modules()``'s."""

    accelerated: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    recomputed: list[str] = field(default_factory=list)
    stacked: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{len(self.accelerated)} DoRA layer(s) accelerated, {len(self.skipped)} skipped"]
        if self.recomputed:
            lines[0] += f", {len(self.recomputed)} recomputing their product in backward"
        if self.stacked:
            lines[0] += f", {len(self.stacked)} with stacked weights"
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


_PEFT_CLASSES: tuple | None = None  # peft is optional: imported on first use, then kept


def _peft_classes():
    """(LoraLayer, LoraLinear, DoraLinearVariant); the hot path asks on every call."""
    global _PEFT_CLASSES
    if _PEFT_CLASSES is None:
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.lora.layer import LoraLayer
        from peft.tuners.lora.variants import DoraLinearVariant

        _PEFT_CLASSES = (LoraLayer, LoraLinear, DoraLinearVariant)
    return _PEFT_CLASSES


def _why_not(module, LoraLinear, DoraLinearVariant) -> str | None:
    """Why a LoRA layer cannot be accelerated at all, or None if it can."""
    if type(module) is not LoraLinear:
        return f"{type(module).__name__} is not a plain PEFT lora.Linear (only Linear is supported)"
    base = module.get_base_layer()
    if not isinstance(base, nn.Linear):
        return f"base layer {type(base).__name__} is not nn.Linear"
    if (
        type(base.weight) not in (nn.Parameter, torch.Tensor)
        or base.weight.dtype not in FLOAT_DTYPES
    ):
        return f"base weight is {type(base.weight).__name__} {base.weight.dtype} (quantized?)"
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out (transposed base weight)"
    dora = [
        a
        for a in module.lora_magnitude_vector
        if type(module.lora_variant.get(a)) is DoraLinearVariant
    ]
    if not dora:
        return "no DoRA adapter on this layer (plain LoRA)"
    if any(module.lora_B[a].bias is not None for a in dora):
        return "lora_bias=True (a bias on lora_B) is not supported"
    return None


def _active_dora_adapter(module, base, x, args, kwargs) -> str | None:
    """The adapter the fast path computes for this call on ``base`` (the module's base
    layer), or None to use PEFT's path."""
    if args or kwargs or module.disable_adapters or module.merged:
        return None
    lora_A = module._modules["lora_A"]._modules
    active = [a for a in module.active_adapters if a in lora_A]
    if len(active) != 1:
        return None
    a = active[0]
    if type(module.lora_variant.get(a)) is not _peft_classes()[2]:
        return None
    weight = _param(base, "weight")
    if x.dtype != weight.dtype or weight.requires_grad:
        return None
    if not isinstance(_adapter_module(module, "lora_dropout", a), (nn.Identity, nn.Dropout)):
        return None
    return a


def _base_layer(module) -> nn.Module:
    """``module.get_base_layer()`` of an accelerated layer: its registered ``base_layer``
    submodule, read directly (PEFT's walk asks ``hasattr`` of the nn.Linear it ends on, which
    raises and catches an AttributeError per call, ~3 of them per layer and step); a nested
    tuner layer takes PEFT's walk."""
    base = module._modules["base_layer"]
    return base if "base_layer" not in base._modules else module.get_base_layer()


def _base_weight(module) -> torch.Tensor:
    return _param(_base_layer(module), "weight")


def _param(module: nn.Module, name: str):
    """``module.<name>``: a registered parameter (or None) read from ``_parameters``, as
    nn.Module's ``__getattr__`` would find it, without that Python call (the fast path reads
    six per layer call); anything else (a parametrization, a property) through getattr."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name)


def _adapter_module(module, name: str, a: str) -> nn.Module:
    """``module.<name>[a]`` read from the submodule dicts (``ModuleDict.__getitem__`` and
    ``__getattr__`` are Python calls)."""
    return module._modules[name]._modules[a]


def _adapter_weight(module, name: str, a: str) -> torch.Tensor:
    """``module.<name>[a].weight``."""
    return _param(_adapter_module(module, name, a), "weight")


def _adapter_tensors(module):
    """(W, A, B, s, impl) of the adapter the fast path computes for ``module`` in its current
    state (for the norm cache's eval buffer), or None."""
    base = _base_layer(module)
    weight = _param(base, "weight")
    a = _active_dora_adapter(module, base, weight, (), {})
    if a is None:
        return None
    return (
        weight,
        _adapter_weight(module, "lora_A", a),
        _adapter_weight(module, "lora_B", a),
        float(module.scaling[a]),
        module._dora_impl,
    )


def _accelerated_forward(self, x, *args, **kwargs):
    """PEFT lora.Linear.forward on dora_torch for the common case; PEFT's own otherwise.
    ``self.last_impl`` records which ran: "fused" / "eager" (ours) or "peft"."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    base = _base_layer(self)
    a = _active_dora_adapter(self, base, x, args, kwargs)
    state = self.__dict__  # plain attributes: skip nn.Module's __setattr__ bookkeeping
    if a is None:
        if not torch.compiler.is_compiling():
            state["last_impl"] = "peft"
        return type(self).forward(self, x, *args, **kwargs)
    drop = _adapter_module(self, "lora_dropout", a)
    y, tier = module_dora_linear(
        state["_dora_norm_cache"],
        self,
        x,
        _param(base, "weight"),
        _adapter_weight(self, "lora_A", a),
        _adapter_weight(self, "lora_B", a),
        _adapter_weight(self, "lora_magnitude_vector", a),
        float(self.scaling[a]),
        _param(base, "bias"),
        dropout_p=drop.p if isinstance(drop, nn.Dropout) else 0.0,
        training=self.training,
        impl=state[IMPL_ATTR],
        recompute_inner=state[RECOMPUTE_ATTR],
        stack=state[STACK_ATTR],
    )
    if not torch.compiler.is_compiling():
        state["last_impl"] = tier
    return y


#: PEFT layer methods after which an accelerated layer refreshes the buffers compiled graphs
#: read (``cache.track_mode``): ``train`` (eval mode keeps a norm buffer), ``set_adapter``
#: (also what ``enable_adapters(True)`` and ``delete_adapter`` of an active adapter call: the
#: module keeps one norm buffer, and a graph guarded on the new adapter would read the norm
#: of the one before) and ``unmerge`` (W is written back, not bit for bit).
REFRESHING_METHODS = ("train", "set_adapter", "unmerge")


def _refreshing(self, name: str, *args, **kwargs):
    """PEFT's method ``name`` on ``self``, then its buffers refreshed (``REFRESHING_METHODS``)."""
    out = getattr(type(self), name)(self, *args, **kwargs)
    cache.track_mode(self)
    return out


def _is_accelerated(module) -> bool:
    fwd = module.__dict__.get("forward")
    return getattr(fwd, "func", None) is _accelerated_forward


def _stack_for(module) -> StackedWeights:
    """The layer's stack for its first active DoRA adapter (its first DoRA adapter when none
    is active): the one it has while that still holds W and A, else a new one."""
    dora = [a for a in module.lora_magnitude_vector if a in module._modules["lora_A"]._modules]
    a = next((a for a in module.active_adapters if a in dora), dora[0])
    weight, lora_A = _base_weight(module), _adapter_weight(module, "lora_A", a)
    stack = module.__dict__.get(STACK_ATTR)
    return (
        stack
        if stack is not None and stack.holds(weight, lora_A)
        else StackedWeights(weight, lora_A)
    )


def accelerate_peft(
    peft_model: nn.Module, *, impl: str = "auto", recompute_modules=None, stack_modules=None
) -> nn.Module:
    """Make every eligible PEFT DoRA ``lora.Linear`` of ``peft_model`` compute with dora_torch.

    In place; returns ``peft_model`` with an ``AccelerationReport`` attached as
    ``peft_model.dora_acceleration_report``. Layers left on PEFT's path are listed
    there and in a warning. Each accelerated layer records the tier of its last eager call
    in ``last_impl`` ("fused", "eager", or "peft" when that call fell back to PEFT's path).
    ``impl`` ("auto" | "fused" | "eager") forces a tier, as ``dora_torch.Linear``'s does.
    ``recompute_modules`` (None, or PEFT's ``target_modules`` forms: module names or a regex)
    selects the layers that run with ``recompute_inner`` (``dora_torch.Linear``): their
    backward recomputes the layer's product instead of keeping a [tokens, out_features]
    tensor, for layers whose output the next op does not keep (README, "Memory (torch)").
    ``stack_modules`` (the same forms; experimental) selects the layers whose base weight
    and active DoRA adapter's A move into one buffer (``dora_torch.stacking``): their eager
    fused calls form dx as one GEMM (and x Wᵀ with x Aᵀ under ``config.STACK_FORWARD``;
    README, "Stacked weights").
    Their base weights keep their Parameter objects and values. After ``model.to()`` they
    take the two-GEMM path until ``accelerate_peft`` is called again, which re-stacks.
    Calling it again is harmless (it updates ``impl`` and the selections). Raises ValueError
    if the model has no PEFT LoRA layer at all, or if ``recompute_modules`` or
    ``stack_modules`` selects no layer that is accelerated; nothing is changed then.
    """
    check_impl(impl)
    cache.compiled_train_norm_buffer()  # an unknown setting raises before anything changes
    recompute_modules = check_module_selection(recompute_modules, "recompute_modules")
    stack_modules = check_module_selection(stack_modules, "stack_modules")
    LoraLayer, LoraLinear, DoraLinearVariant = _peft_classes()
    report = AccelerationReport()
    eligible = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        why = _why_not(module, LoraLinear, DoraLinearVariant)
        if why is None:
            eligible[name] = module
        else:
            report.skipped[name] = why
    recompute, stacked = (
        selected_modules(selection, eligible, arg, "layers accelerate_peft accelerates")
        for selection, arg in ((recompute_modules, "recompute_modules"),
                               (stack_modules, "stack_modules"))
    )  # fmt: skip
    # The stacks first: building one may fail (memory), and re-homing W changes no value.
    stacks = {name: _stack_for(eligible[name]) for name in stacked}
    for name, module in eligible.items():
        setattr(module, IMPL_ATTR, impl)
        setattr(module, RECOMPUTE_ATTR, name in recompute)
        module.__dict__[STACK_ATTR] = stacks.get(name)
        if name in recompute:
            report.recomputed.append(name)
        if name in stacks:
            report.stacked.append(name)
        if not _is_accelerated(module):
            module.last_impl = None
            # partials, not bound methods: they pickle (``torch.save(model)``), a bound method
            # of a module-level function does not
            module.forward = functools.partial(_accelerated_forward, module)
            for method in REFRESHING_METHODS:
                setattr(module, method, functools.partial(_refreshing, module, method))
            cache.attach(module, _adapter_tensors, _base_weight)
        report.accelerated.append(name)
    if report.accelerated:  # one norm recomputation per parameter update for all of them
        accelerated = set(report.accelerated)
        group_norms(m for n, m in peft_model.named_modules() if n in accelerated)
    if not report.accelerated and not report.skipped:
        raise ValueError("peft_model has no PEFT LoRA layer; is it a PeftModel with use_dora=True?")
    if report.skipped:
        warnings.warn(
            f"accelerate_peft: layers left on PEFT's path:\n{report}", RuntimeWarning, stacklevel=2
        )
    setattr(peft_model, REPORT_ATTR, report)
    return peft_model


def restore_peft(peft_model: nn.Module) -> nn.Module:
    """Undo ``accelerate_peft``: every layer computes with PEFT's own forward again."""
    for module in peft_model.modules():
        if _is_accelerated(module):
            del module.forward
            for method in REFRESHING_METHODS:  # some absent on layers pickled before them
                module.__dict__.pop(method, None)
            cache.detach_cache(module)
            for attr in (IMPL_ATTR, RECOMPUTE_ATTR, STACK_ATTR, "last_impl"):
                module.__dict__.pop(attr, None)
    if REPORT_ATTR in peft_model.__dict__:
        delattr(peft_model, REPORT_ATTR)
    return peft_model
