"""DoRA beyond one device (docs/design.md §11): FSDP2, tensor parallelism, adapter saving.

FSDP2 (``torch.distributed.fsdp.fully_shard``) trains ``dora_torch.Linear`` layers and PEFT
layers under ``accelerate_peft`` correctly as it is: the forward sees whole, all-gathered
tensors. Three things go wrong around the per-module caches (docs/design.md §8), and
``prepare_fsdp`` (call it after ``fully_shard``, on every rank) fixes them:

1. ‖W‖² of the frozen base is recomputed on every forward. FSDP2 all-gathers into the same
   unsharded Parameter objects each time but re-allocates their storage, so the cache's
   stamps (identity, storage, version) miss. ``prepare_fsdp`` computes ‖W_i‖² once from the
   rows each rank holds (FSDP2 shards W by rows, dim 0, so a row's squared norm is local),
   gathers the [d_out] vector, and a forward pre-hook (it runs after FSDP2's, which
   unshards) hands it to the module's cache for the W of every forward
   (``NormCache.set_base_sq``). With ``config.FSDP_LOCAL_NORMS`` on, the layers' norms
   themselves come from the local shards, all layers at once at each root forward
   (``dora_torch/fsdp_norms.py``), and no forward computes U = W Aᵀ from its gathered W.
2. Writes to the sharded parameters without an optimizer step (``load_state_dict``,
   ``set_model_state_dict``, ``copy_``) are invisible to the stamps of the unsharded tensors
   whenever the allocator hands the all-gather the same storage again (FSDP2 preserves their
   version counters): the cache would serve a stale norm. The pre-hook stamps the persistent
   sharded parameters instead (DTensor identity and version, which every in-place write
   moves) and clears the module's cache when one of W, A, B was written; a written W also
   gets its ‖W‖² recomputed once. Without ``prepare_fsdp``, call
   ``dora_torch.clear_caches(model)`` after such writes.
3. Eval mode breaks: ``model.eval()``, and later ``load_state_dict`` and optimizer steps in
   eval mode, refresh each module's eval-norm buffer from its parameters, which are sharded
   DTensors at that point, and the next eager eval forward fails copying its plain norm into
   that DTensor buffer. ``prepare_fsdp`` makes those refreshes skip sharded parameters
   (forwards see whole tensors and refresh the buffer themselves).

Tensor parallelism: torch's ``ColwiseParallel`` / ``RowwiseParallel`` accept only
``nn.Linear`` and ``nn.Embedding`` and raise ``NotImplementedError`` on a
``dora_torch.Linear``. ``parallelize_dora(module, mesh, plan)`` takes the same plan, shards a
DoRA layer's W, bias, A, B and m consistently and gives it a forward that computes the norm
of the whole layer (docs/design.md §2 sums):

- column parallel (d_out sharded): W, bias, B, m by rows, A replicated. Each rank holds whole
  rows, so its norm is local; dA and dx are summed over the ranks in backward.
- row parallel (d_in sharded): W and A by columns, B, m and bias replicated. ‖W_i‖², the cross
  term Σ_j B_ij (W_loc A_locᵀ)_ij and the Gram A_loc A_locᵀ are partial sums over the local
  slice of d_in: one all-reduce of 2·d_out + r² values (d_out + r² once ‖W‖² is cached)
  before the square root. The output g ⊙ (x_loc W_locᵀ + s·(x_loc A_locᵀ) Bᵀ) is a partial
  sum too: one all-reduce of [T, d_out], as for a plain row-parallel linear; the bias is added
  after it. dB and dm are summed over the ranks in backward.

``save_adapter`` gathers the adapters of a sharded model (FSDP2 or tensor parallel) and writes
the PEFT adapter directory from one rank.
"""

from __future__ import annotations

import fnmatch
import functools
import types
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from . import cache, config, fsdp_norms
from . import norm as _norm
from .dispatch import resolve_impl
from .functional import dora_linear
from .interop.adapter_io import save_adapter as _save_adapter
from .interop.inject import dora_layers
from .layer import Linear

__all__ = ["parallelize_dora", "prepare_fsdp", "save_adapter"]


# ------------------------------------------------------------------------------------ FSDP2
class _ParamStamp:
    """Identity + version counter of a persistent parameter (a DTensor wrapper included: its
    version moves with every in-place write through it, its local tensor's does not)."""

    __slots__ = ("ref", "version")

    def __init__(self, t: torch.Tensor):
        self.ref = weakref.ref(t)
        self.version = t._version

    def matches(self, t: torch.Tensor) -> bool:
        return self.ref() is t and t._version == self.version

    def current(self) -> bool:
        t = self.ref()
        return t is not None and t._version == self.version


@dataclass
class _Sharded:
    """What ``prepare_fsdp`` keeps on a module: stamps of its sharded W, A, B, ‖W_i‖² per
    dtype of the W its forward sees (whole, and of this rank's rows), and the norm
    ``fsdp_norms.LocalNorms`` computed for it."""

    weight: _ParamStamp
    adapters: tuple[_ParamStamp, ...]
    base_sq: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    local_sq: dict[torch.dtype, tuple[tuple | None, torch.Tensor]] = field(default_factory=dict)
    local_norm: tuple | None = None  # written by LocalNorms.compute
    hits: int = 0  # forwards that reused ‖W‖² (for tests and logs)
    local_hits: int = 0  # forwards that read the norm LocalNorms computed

    def sharded(self) -> tuple:
        return (self.weight.ref(), *(s.ref() for s in self.adapters))

    def versions(self) -> tuple | None:
        """(identity, version) of the sharded W, A, B as they are now."""
        found = self.sharded()
        if any(t is None for t in found):
            return None
        return tuple((id(t), t._version) for t in found)

    def local_base_sq(self, w_local: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """‖W_i‖² of this rank's rows with W rounded to ``dtype`` (the forward's), ``w_local``
        its local shard; recomputed once after a write to the sharded W."""
        W = self.weight.ref()
        version = None if W is None else (id(W), W._version)
        kept = self.local_sq.get(dtype)
        if kept is None or kept[0] != version or kept[1].shape[0] != w_local.shape[0]:
            kept = (version, _norm.base_sq_norm(w_local.to(dtype)))
            self.local_sq[dtype] = kept
        return kept[1]


_STATE, _HOOK, _ANY = "_dora_fsdp", "_dora_fsdp_hook", "_dora_tensors_any"
_GROUP, _ROOT_HOOK = "_dora_fsdp_norms", "_dora_fsdp_root_hook"


def _tensors(module: nn.Module):
    """(W, A, B, s, impl) of a DoRA module as ``cache.attach`` defined them, or None."""
    return module.__dict__.get(_ANY, module._dora_tensors)(module)


def _whole_only(original, module: nn.Module):
    """The module's tensors for the eval-norm refreshes, None while they are sharded."""
    found = original(module)
    return None if found is None or isinstance(found[0], DTensor) else found


def _reshard(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _vector_placement(p, name: str):
    """Placement of ‖W_i‖² [d_out] given one placement of W [d_out, d_in]."""
    if isinstance(p, Replicate):
        return p
    if isinstance(p, Shard) and p.dim == 0:
        return Shard(0)
    if isinstance(p, Shard) and p.dim in (1, -1):
        return Partial()  # rows split over d_in: partial row sums
    raise ValueError(f"{name}: cannot compute ‖W‖² of a weight placed as {p!r}")


@torch.no_grad()
def _gathered_base_sq(weight: torch.Tensor, dtype: torch.dtype, name: str):
    """‖W_i‖² [d_out] of ``weight`` rounded to ``dtype``, from this rank's shard + one gather;
    and that of this rank's rows (None when ``weight`` is not sharded)."""
    if not isinstance(weight, DTensor):
        return _norm.base_sq_norm(weight.to(dtype)), None
    part = _norm.base_sq_norm(weight.to_local().to(dtype))
    placements = [_vector_placement(p, name) for p in weight.placements]
    shape, stride = (weight.shape[0],), (1,)
    full = DTensor.from_local(
        part, weight.device_mesh, placements, run_check=False, shape=shape, stride=stride
    )
    return full.full_tensor(), part


def prepare_fsdp(model: nn.Module, *, param_dtype: torch.dtype | None = None) -> int:
    """Make the DoRA modules of an FSDP2-sharded ``model`` cache soundly (see the module doc):
    ‖W_i‖² computed once from the local shards, caches cleared on writes to the sharded
    parameters, eval-norm buffers kept off sharded tensors.

    Call it after ``fully_shard`` and after ``accelerate_peft``, on every rank (it gathers
    one [d_out] vector per layer). ``param_dtype``: the dtype of the W the forward sees,
    ``MixedPrecisionPolicy.param_dtype`` if one is set (default: W's own dtype); a forward
    that sees another dtype computes ‖W‖² once from its unsharded W and keeps it. Covers
    ``dora_torch.Linear`` and PEFT layers under ``accelerate_peft``; harmless on modules
    FSDP2 does not shard. Calling it again replaces the hooks; call it again after replacing
    sharded Parameters (``load_state_dict(assign=True)``). With ``config.FSDP_LOCAL_NORMS``
    it also gives ``model`` a forward pre-hook that computes every layer's norm from the
    local shards with two collectives (``dora_torch/fsdp_norms.py``): every rank calls
    ``model``, as FSDP2 requires anyway. Returns the number of modules.
    """
    _reshard(model)  # the modules hold their sharded (persistent) parameters now
    count, members = 0, []
    for name, module in model.named_modules():
        norm_cache = cache.module_cache(module)
        if norm_cache is None:
            continue
        if norm_cache.group is not None:
            # A norm group recomputes every member on one layer's miss; under FSDP2 the other
            # layers' W exists only inside their own all-gather window: each layer alone.
            norm_cache.group.remove(module)
        if _ANY not in module.__dict__:
            module.__dict__[_ANY] = module._dora_tensors
            module._dora_tensors = functools.partial(_whole_only, module._dora_tensors)
        buf = module._buffers.get(cache.DORA_NORM_BUFFER)
        if isinstance(buf, DTensor):  # written by an eval() before this call
            module._buffers[cache.DORA_NORM_BUFFER] = torch.empty(0, device=buf.device)
        base_buf = module._buffers.get(cache.DORA_BASE_SQ_BUFFER)
        if base_buf is not None and base_buf.numel():  # its graphs reduce W per all-gather
            module._buffers[cache.DORA_BASE_SQ_BUFFER] = torch.empty(0, device=base_buf.device)
        found = _tensors(module)
        if found is None:
            continue
        weight, lora_A, lora_B = found[:3]
        dtype = param_dtype or weight.dtype
        state = _Sharded(_ParamStamp(weight), (_ParamStamp(lora_A), _ParamStamp(lora_B)))
        state.base_sq[dtype], part = _gathered_base_sq(weight, dtype, name)
        if part is not None:
            state.local_sq[dtype] = ((id(weight), weight._version), part)
        old = module.__dict__.pop(_HOOK, None)
        if old is not None:
            old.remove()
        module.__dict__[_STATE] = state
        module.__dict__[_HOOK] = module.register_forward_pre_hook(_before_forward)
        members.append((module, state))
        count += 1
    old = model.__dict__.pop(_ROOT_HOOK, None)
    if old is not None:
        old.remove()
    model.__dict__.pop(_GROUP, None)
    if members and config.FSDP_LOCAL_NORMS:
        model.__dict__[_GROUP] = fsdp_norms.LocalNorms(members, _tensors, param_dtype)
        model.__dict__[_ROOT_HOOK] = model.register_forward_pre_hook(_before_root_forward)
    return count


def _before_root_forward(model: nn.Module, _args) -> None:
    """Forward pre-hook of the model ``prepare_fsdp`` was given: every layer's norm from the
    local shards, on every rank (``fsdp_norms``)."""
    if torch.compiler.is_compiling():
        return
    group = model.__dict__.get(_GROUP)
    if group is not None:
        group.compute()


def _before_forward(module: nn.Module, _args) -> None:
    """Forward pre-hook (runs after FSDP2's, which unshards): drop what a write to the sharded
    parameters made stale, then feed the module's cache the norm ``fsdp_norms.LocalNorms``
    computed at this root forward, or else the kept ‖W‖² (the forward then computes the
    norm from the unsharded tensors)."""
    if torch.compiler.is_compiling():
        return  # compiled graphs compute the norm themselves (docs/design.md §8)
    state: _Sharded | None = module.__dict__.get(_STATE)
    found = _tensors(module)
    if state is None or found is None or isinstance(found[0], DTensor):
        return
    weight, norm_cache = found[0], cache.module_cache(module)
    if norm_cache is None:  # restore_peft took the module off dora_torch
        return
    if not (state.weight.current() and all(s.current() for s in state.adapters)):
        norm_cache.clear()  # a sharded W, A or B was written since the last forward
        state.adapters = tuple(_ParamStamp(s.ref()) for s in state.adapters if s.ref() is not None)
        if not state.weight.current():
            state.base_sq.clear()
            target = state.weight.ref()
            if target is None:
                return
            state.weight = _ParamStamp(target)
    if _args and fsdp_norms.install(norm_cache, found, state, _args[0]):
        state.local_hits += 1
        return
    value = state.base_sq.get(weight.dtype)
    if value is None or value.shape[0] != weight.shape[0]:
        state.base_sq[weight.dtype] = norm_cache.base_sq(weight)  # once, from the unsharded W
        return
    state.hits += 1
    norm_cache.set_base_sq(weight, value)


# ------------------------------------------------------------------------- tensor parallel
_COLWISE, _ROWWISE = "colwise", "rowwise"


@dataclass
class _TPLayout:
    kind: str  # _COLWISE | _ROWWISE
    input_layout: object
    output_layout: object
    use_local_output: bool


def _style_name(style) -> str:
    return type(style).__name__


def _layout(name: str, style, layouts, what: str, allowed) -> object:
    (placement,) = layouts
    if not any(placement == p for p in allowed):
        ok = " or ".join(repr(p) for p in allowed)
        raise ValueError(
            f"parallelize_dora: layer {name!r}: {_style_name(style)} {what}={placement!r} is not "
            f"supported on a dora_torch.Linear (supported: {ok})"
        )
    return placement


def _tp_layout(name: str, layer: Linear, style) -> _TPLayout:
    """The supported layouts of ``style`` on a DoRA layer, or an error naming layer and
    placement."""
    if isinstance(layer.weight, DTensor):
        raise ValueError(f"parallelize_dora: layer {name!r} is already parallelized")
    if layer.merged:
        raise ValueError(f"parallelize_dora: layer {name!r} is merged; unmerge it first")
    if layer.exact_norm_grad:
        raise ValueError(
            f"parallelize_dora: layer {name!r} uses exact_norm_grad=True, which has no "
            "tensor-parallel form yet"
        )
    if type(style) is ColwiseParallel:
        return _TPLayout(
            _COLWISE,
            _layout(name, style, style.input_layouts, "input_layouts", [Replicate()]),
            _layout(name, style, style.output_layouts, "output_layouts", [Shard(-1), Replicate()]),
            style.use_local_output,
        )
    if type(style) is RowwiseParallel:
        return _TPLayout(
            _ROWWISE,
            _layout(name, style, style.input_layouts, "input_layouts", [Shard(-1), Replicate()]),
            _layout(name, style, style.output_layouts, "output_layouts", [Replicate()]),
            style.use_local_output,
        )
    layouts = ", ".join(f"{k}={v!r}" for k, v in vars(style).items())
    raise ValueError(
        f"parallelize_dora: layer {name!r}: {_style_name(style)}({layouts}) is not supported "
        "on a dora_torch.Linear (use ColwiseParallel or RowwiseParallel)"
    )


def _matches(name: str, pattern: str) -> bool:
    """torch's plan-key rule: dotted atoms matched one by one, each with fnmatch."""
    if pattern == "":
        return name == ""
    atoms, want = name.split("."), pattern.split(".")
    return len(atoms) == len(want) and all(fnmatch.fnmatchcase(a, w) for a, w in zip(atoms, want))


def parallelize_dora(
    module: nn.Module,
    device_mesh: DeviceMesh,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle],
) -> nn.Module:
    """``torch.distributed.tensor.parallel.parallelize_module`` that also accepts
    ``dora_torch.Linear`` layers; in place, returns ``module``.

    ``parallelize_plan`` is a style (for ``module`` itself) or a dict from module paths (torch's
    rule: ``*`` wildcards per dotted atom) to styles. On a ``dora_torch.Linear``:
    ``ColwiseParallel`` (input Replicate; output Shard(-1) or Replicate) and
    ``RowwiseParallel`` (input Shard(-1) or Replicate; output Replicate), with
    ``use_local_output`` honoured. Anything else on a DoRA layer (sequence-parallel layouts,
    other styles, ``exact_norm_grad=True``) raises ValueError naming the layer and the
    placement, before anything is changed. Other modules go to ``parallelize_module``
    unchanged. ``device_mesh`` must be 1-D (the tensor-parallel mesh).

    Parameters become DTensors (W, bias, B, m sharded by rows and A replicated for column
    parallel; W and A by columns and B, m, bias replicated for row parallel), distributed from
    rank 0's values. A PEFT layer (under ``accelerate_peft`` or not) is refused: convert the
    model with ``dora_torch.inject`` / ``load_adapter``. Adapter dropout draws its mask on each
    rank: column-parallel layers match one rank only when the ranks' RNGs agree (same seed).
    """
    if device_mesh.ndim != 1:
        raise ValueError(f"parallelize_dora needs a 1-D mesh; got {device_mesh.ndim}-D")
    plan = parallelize_plan if isinstance(parallelize_plan, dict) else {"": parallelize_plan}
    dora, other = [], []
    for pattern, style in plan.items():
        found = [(n, m) for n, m in module.named_modules() if _matches(n, pattern)]
        if not found:
            raise ValueError(f"parallelize_dora: plan key {pattern!r} matches no module")
        for name, sub in found:
            if isinstance(sub, Linear):
                dora.append((name, sub, _tp_layout(name, sub, style)))
            elif cache.module_cache(sub) is not None or hasattr(sub, "lora_magnitude_vector"):
                raise ValueError(
                    f"parallelize_dora: layer {name!r} is a PEFT layer "
                    f"({type(sub).__name__}); only dora_torch.Linear layers can be "
                    "parallelized (dora_torch.inject / load_adapter build them)"
                )
            else:
                other.append((sub, style))
    for name, layer, layout in dora:  # everything validated: from here on nothing raises
        _shard_layer(name, layer, device_mesh, layout)
    for sub, style in other:
        parallelize_module(sub, device_mesh, style)
    return module


#: Placement of each parameter of a DoRA layer under each plan.
_PLACEMENTS = {
    _COLWISE: {
        "weight": Shard(0),
        "bias": Shard(0),
        "lora_A": Replicate(),
        "lora_B": Shard(0),
        "lora_magnitude_vector": Shard(0),
    },
    _ROWWISE: {
        "weight": Shard(1),
        "bias": Replicate(),
        "lora_A": Shard(1),
        "lora_B": Replicate(),
        "lora_magnitude_vector": Replicate(),
    },
}


@dataclass
class _TPState:
    name: str
    mesh: DeviceMesh
    layout: _TPLayout
    norm_cache: _TPNormCache


class _TPNormCache:
    """The norm cache of a tensor-parallel DoRA layer (the role ``cache.NormCache`` plays on
    one device), keyed on the layer's DTensor parameters (identity and version) and the
    optimizer-step count. Every hit or miss is decided alike on all ranks, as a row-parallel
    miss all-reduces. ``clear_caches`` clears it (it is the module's norm cache).

    Toward ``dora_torch.cache``'s step hook it answers as a ``NormCache`` that no norm group
    holds and that keeps no ‖W‖² buffer: the layer refreshes nothing outside its forward
    (the hook runs no collectives)."""

    #: Not in a ``norm_group.NormGroup``: each rank computes its own rows alone.
    group = None

    def __init__(self, row_parallel: bool, process_group) -> None:
        self.row_parallel, self.process_group = row_parallel, process_group
        self.clear()

    def cached_base_sq(self, _weight: torch.Tensor) -> None:
        """None: a tensor-parallel layer keeps no ‖W‖² buffer for compiled graphs."""
        return None

    def clear(self) -> None:
        self._base: tuple[_ParamStamp, torch.Tensor] | None = None
        self._norm: tuple[tuple, torch.Tensor] | None = None
        self.norm_computations = 0
        self.base_sq_computations = 0

    @torch.no_grad()
    def norm(self, layer: Linear, tier: str) -> torch.Tensor:
        """The detached norm of the rows this rank computes (column parallel: its rows; row
        parallel: all rows), in the compute dtype."""
        params = (layer.weight, layer.lora_A, layer.lora_B)
        key = (layer.scaling, tier, cache.optimizer_steps())
        if self._norm is not None:
            (stamps, old_key), n = self._norm
            if old_key == key and all(s.matches(p) for s, p in zip(stamps, params)):
                return n
        W, A, B = (p.to_local() for p in params)
        base = self._base[1] if self._base and self._base[0].matches(layer.weight) else None
        if self.row_parallel:
            n, base = self._row_parallel_norm(W, A, B, base, layer.scaling)
        else:
            if base is None:
                base = _norm.base_sq_norm(W)
                self.base_sq_computations += 1
            n = _norm.detached_norm(W, A, B, base, layer.scaling, tier == "fused")
        self._base = (_ParamStamp(layer.weight), base)
        self._norm = ((tuple(_ParamStamp(p) for p in params), key), n)
        self.norm_computations += 1
        return n

    def _row_parallel_norm(self, W, A, B, base, s: float):
        """n² = ‖W_i‖² + 2s·Σ_j B_ij U_ij + s²·Σ (B G)_i·B_i from partial sums over this rank's
        slice of d_in (U = W_loc A_locᵀ, G = A_loc A_locᵀ): one all-reduce of d_out + r²
        values, plus d_out when ‖W‖² is not cached yet."""
        d_out, r = B.shape
        U, G = _norm.cross_terms(W, A), _norm.gram(A, W)
        b = B.detach().to(U.dtype)
        parts = [(b * U).sum(1), G.reshape(-1)]
        if base is None:
            parts.append(_norm.base_sq_norm(W))
            self.base_sq_computations += 1
        total = torch.cat(parts)
        dist.all_reduce(total, group=self.process_group)
        cross, G = total[:d_out], total[d_out : d_out + r * r].view(r, r)
        if base is None:
            base = total[d_out + r * r :].clone()
        sq = base + 2.0 * s * cross + s * s * ((b @ G) * b).sum(1)
        return sq.clamp_min(0.0).sqrt(), base


def _sum_grad(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``t`` (replicated on every rank); in backward its gradient is summed over the ranks."""
    rep = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    return rep.to_local(grad_placements=[Partial()])


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _shard_layer(name: str, layer: Linear, mesh: DeviceMesh, layout: _TPLayout) -> None:
    for attr, placement in _PLACEMENTS[layout.kind].items():
        p = getattr(layer, attr)
        if p is None:
            continue
        dt = distribute_tensor(p.detach(), mesh, [placement])
        layer.register_parameter(attr, nn.Parameter(dt, requires_grad=p.requires_grad))
    norm_cache = _TPNormCache(layout.kind == _ROWWISE, mesh.get_group())
    layer._dora_tp = _TPState(name, mesh, layout, norm_cache)
    layer._dora_norm_cache = norm_cache  # what clear_caches clears
    layer._dora_tensors = _no_tensors  # no eval-buffer refresh from hooks (no collectives there)
    layer.forward = types.MethodType(_tp_forward, layer)
    layer.norm = types.MethodType(_tp_norm, layer)
    layer.merge = types.MethodType(_tp_no_merge, layer)
    layer.unmerge = types.MethodType(_tp_no_merge, layer)


def _no_tensors(_layer):
    return None


def _local_input(x: torch.Tensor, st: _TPState) -> torch.Tensor:
    """This rank's part of x in the layout the plan computes with: all of x (column parallel;
    dx is summed over the ranks in backward) or its slice of d_in (row parallel)."""
    colwise = st.layout.kind == _COLWISE
    want = Replicate() if colwise else Shard(x.dim() - 1)
    if not isinstance(x, DTensor):
        given = st.layout.input_layout
        given = Shard(x.dim() - 1) if isinstance(given, Shard) else given
        x = DTensor.from_local(x, st.mesh, [given], run_check=False)
    if x.placements != (want,):
        x = x.redistribute(st.mesh, [want])
    return x.to_local(grad_placements=[Partial()]) if colwise else x.to_local()


def _tp_forward(self: Linear, x: torch.Tensor) -> torch.Tensor:
    st: _TPState = self._dora_tp
    mesh, layout = st.mesh, st.layout
    x = _local_input(x, st)
    W = self.weight.to_local()
    if x.shape[-1] != W.shape[1]:
        raise ValueError(
            f"layer {st.name!r} ({layout.kind} parallel): this rank's input has "
            f"{x.shape[-1]} features, its shard of W {W.shape[1]} (input_layouts="
            f"{layout.input_layout})"
        )
    A, B, m = (p.to_local() for p in (self.lora_A, self.lora_B, self.lora_magnitude_vector))
    bias = None if self.bias is None else self.bias.to_local()
    tier = resolve_impl(self.impl, x, W.shape[0])
    n = st.norm_cache.norm(self, tier)
    kw = {"dropout_p": self.lora_dropout, "training": self.training, "impl": tier, "norm": n}
    if layout.kind == _COLWISE:
        y = dora_linear(x, W, _sum_grad(A, mesh), B, m, self.scaling, bias, **kw)
        shape = (*y.shape[:-1], self.out_features)
        out = DTensor.from_local(
            y, mesh, [Shard(y.dim() - 1)], run_check=False, shape=shape,
            stride=_contiguous_stride(shape),
        )  # fmt: skip
        if layout.output_layout == Replicate():
            out = out.redistribute(mesh, [Replicate()])
        return out.to_local() if layout.use_local_output else out
    y = dora_linear(x, W, A, _sum_grad(B, mesh), _sum_grad(m, mesh), self.scaling, None, **kw)
    y = DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()])
    y = y.to_local()
    if bias is not None:
        y = y + bias  # after the sum, as the bias is never scaled by g
    if layout.use_local_output:
        return y
    return DTensor.from_local(y, mesh, [Replicate()], run_check=False)


def _tp_norm(self: Linear, *, impl: str = "auto") -> torch.Tensor:
    """The detached norm this rank computes (column parallel: its rows; row parallel: all
    rows, collective)."""
    w = self.weight.to_local()
    tier = "fused" if impl != "eager" and w.is_cuda else "eager"
    return self._dora_tp.norm_cache.norm(self, tier)


def _tp_no_merge(self: Linear) -> None:
    raise NotImplementedError(
        f"layer {self._dora_tp.name!r}: merge/unmerge of a tensor-parallel DoRA layer is not "
        "supported; save the adapter (dora_torch.distributed.save_adapter) and merge a "
        "one-device copy"
    )


# ----------------------------------------------------------------------------- adapters
_ADAPTER_ATTRS = ("lora_A", "lora_B", "lora_magnitude_vector")


def save_adapter(model: nn.Module, path, *, rank: int = 0) -> None:
    """``dora_torch.save_adapter`` for a model whose ``dora_torch.Linear`` layers are sharded
    (FSDP2, ``parallelize_dora``) or replicated: collective, call it on every rank.

    Each adapter tensor is gathered whole (one all-gather per sharded tensor); ``rank``
    writes the PEFT adapter directory, the others wait for it. PEFT models have their own
    path: ``peft_model.save_pretrained(path, state_dict=...)`` with the full state dict of
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict``.
    """
    _reshard(model)
    layers = dora_layers(model)
    full = {}
    with torch.no_grad():
        for p, layer in layers.items():
            for attr in _ADAPTER_ATTRS:
                t = getattr(layer, attr)
                full[p, attr] = t.full_tensor() if isinstance(t, DTensor) else t.detach()
    if dist.get_rank() == rank:
        saved = {
            (p, a): layer._parameters[a] for p, layer in layers.items() for a in _ADAPTER_ATTRS
        }
        try:  # the whole tensors stand in for the shards while the file is written
            for (p, attr), t in full.items():
                layers[p]._parameters[attr] = nn.Parameter(t, requires_grad=False)
            _save_adapter(model, path)
        finally:
            for (p, attr), t in saved.items():
                layers[p]._parameters[attr] = t
    dist.barrier()
