"""DoRA on a device mesh (docs/design.md §11): adapter specs that follow the kernel, placing an
nnx model on a mesh, and the factored norm under ``shard_map``.

What needs nothing from this module. ``DoraDense`` and ``inject``-ed models run under
``jax.jit`` with ``NamedSharding`` inputs as they are: the XLA path (every ``impl="auto"``
choice off the GPU) is plain XLA, and XLA's sharding propagation partitions it, the norm's
GEMMs included (an all-reduce when d_in is sharded, nothing when d_out is). The adapters'
nnx metadata already follows the kernel's (``DoraDense`` reads the kernel's ``out_sharding``):

    kernel P(i, o)  →  lora_a P(i, None),  lora_b P(None, o),  magnitude P(o)

so a column-parallel kernel P(None, "model") gives lora_b P(None, "model"), magnitude
P("model") and a replicated lora_a; a row-parallel kernel P("model", None) gives
lora_a P("model", None) and replicated lora_b and magnitude.

What this module adds:

    adapter_specs(kernel_spec)            the three adapter specs above, as PartitionSpecs
    annotate(model, rules)                set kernel (and adapter) sharding metadata by
                                          module name, for models built without it (the
                                          nnx Llama twin); LLAMA_TP_RULES is Megatron's split
    place(model, mesh)                    device_put every Variable by its metadata
    NormSharding, sharded_norm_parts,     the factored norm as a shard_map: partial ‖K‖²,
    sharded_factored_norm, layer_norm     U = aᵀK and G = aᵀa per shard, psum over the axes
                                          that shard d_in, local assembly

The shard_map states the norm's communication instead of leaving it to XLA's partitioner.
Column-parallel (d_out sharded) needs no communication; row-parallel (d_in sharded) one psum
of U [r, d_out], G [r, r] and ‖K‖² [d_out] before the assembly (``xla_ops``), which then runs
on whole columns. The result equals ``factored_norm`` up to the order of the d_in sums.

Wiring the sharded norm into ``DoraDense``'s training step needs a core hook (the custom_vjp
computes its norm itself; ``norm=`` is refused while the adapters are differentiated). For
inference with a fixed adapter it works today: ``layer.frozen_norm = DoraCache(layer_norm(
layer, mesh))``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .checks import check_adapter, check_chunk_size, check_scaling, check_vector
from .config import check_impl
from .norm import assemble_parts, base_sq_norm, norm_gemms

P = PartitionSpec

#: Megatron-style tensor parallelism for the nnx Llama twin (``dora_jax.models.llama``), by
#: PEFT module name: q/k/v/gate/up column-parallel (d_out on "model"), o/down row-parallel
#: (d_in on "model"). Each attention head and each MLP unit then lives on one shard.
LLAMA_TP_RULES: tuple[tuple[str, tuple], ...] = (
    (r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj)", (None, "model")),
    (r".*\.(o_proj|down_proj)", ("model", None)),
)


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry names: None → (), "a" → ("a",), ("a", "b")."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple | list) and all(isinstance(a, str) for a in entry):
        return tuple(entry)
    raise ValueError(f"a partition spec entry must be None, an axis name or a tuple; got {entry!r}")


def _entry(axes: tuple[str, ...]):
    """The PartitionSpec entry for these axes (the inverse of ``_axes``)."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _kernel_spec(kernel_spec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(axes sharding d_in, axes sharding d_out) of a [d_in, d_out] kernel spec."""
    spec = tuple(kernel_spec)
    if len(spec) != 2:
        raise ValueError(f"a kernel spec has two entries (d_in, d_out); got {kernel_spec!r}")
    in_axes, out_axes = _axes(spec[0]), _axes(spec[1])
    if set(in_axes) & set(out_axes):
        raise ValueError(f"a mesh axis shards both d_in and d_out in {kernel_spec!r}")
    return in_axes, out_axes


def adapter_specs(kernel_spec) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
    """(lora_a, lora_b, magnitude) specs for a kernel [d_in, d_out] with spec P(i, o):
    P(i, None), P(None, o), P(o), the rule ``DoraDense`` applies to its nnx metadata."""
    in_axes, out_axes = _kernel_spec(kernel_spec)
    i, o = _entry(in_axes), _entry(out_axes)
    return P(i, None), P(None, o), P(o)


# --------------------------------------------------------------------------------------------
# metadata and placement
# --------------------------------------------------------------------------------------------


def annotate(model: nnx.Module, rules: Sequence[tuple[str, tuple]] = LLAMA_TP_RULES) -> list[str]:
    """Give the kernels of ``model``'s ``nnx.Linear`` and ``DoraDense`` layers sharding metadata.

    ``rules`` is a sequence of (regex, kernel spec) pairs; the first regex that matches the
    whole PEFT-style module name (``model.layers.0.self_attn.q_proj``, as ``inject``) sets
    that layer's kernel ``out_sharding`` (a [d_in, d_out] spec, e.g. ``(None, "model")``).
    For a ``DoraDense`` the adapters get ``adapter_specs`` of it (as its constructor would
    have given them). Call it before or after ``inject``: a layer injected later inherits the
    annotation from its kernel. Only metadata changes; ``place`` moves the values. Returns
    the names of the layers annotated, in graph order.
    """
    from .dense import DoraDense  # dense imports nothing from here; keep the import one-way
    from .inject import module_name

    compiled = [(re.compile(pattern), tuple(spec)) for pattern, spec in rules]
    for _, spec in compiled:
        _kernel_spec(spec)
    done = []
    for path, module in nnx.iter_graph(model):
        if not path or not isinstance(module, nnx.Linear | DoraDense):
            continue
        name = module_name(path)
        spec = next((s for rx, s in compiled if rx.fullmatch(name)), None)
        if spec is None:
            continue
        module.kernel.set_metadata(out_sharding=spec)
        if isinstance(module, DoraDense):
            a_spec, b_spec, m_spec = adapter_specs(spec)
            module.lora_a.set_metadata(out_sharding=tuple(a_spec))
            module.lora_b.set_metadata(out_sharding=tuple(b_spec))
            module.magnitude.set_metadata(out_sharding=tuple(m_spec))
        done.append(name)
    return done


def place(model: nnx.Module, mesh: Mesh) -> None:
    """Move every Variable of ``model`` onto ``mesh`` as its ``out_sharding`` metadata says
    (``nnx.get_named_sharding``; no metadata: replicated); in place."""
    state = nnx.state(model)
    shardings = nnx.get_named_sharding(state, mesh)
    nnx.update(model, jax.device_put(state, shardings))


# --------------------------------------------------------------------------------------------
# the factored norm under shard_map
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormSharding:
    """How the kernel [d_in, d_out] lies on ``mesh`` (hashable, so it can be static config).

    ``mesh`` may be None: ``shard_map`` then takes the mesh of the context (``jax.set_mesh``).
    """

    kernel_spec: tuple
    mesh: Mesh | None = None

    def __post_init__(self):
        object.__setattr__(self, "kernel_spec", tuple(self.kernel_spec))
        _kernel_spec(self.kernel_spec)

    @property
    def in_axes(self) -> tuple[str, ...]:
        """Mesh axes that shard d_in: the norm's partial sums are psum-ed over them."""
        return _kernel_spec(self.kernel_spec)[0]

    @property
    def out_axes(self) -> tuple[str, ...]:
        """Mesh axes that shard d_out: the norm stays sharded over them (no communication)."""
        return _kernel_spec(self.kernel_spec)[1]


def sharded_norm_parts(
    kernel,
    lora_a,
    lora_b,
    base_sq,
    *,
    sharding: NormSharding,
    scaling: float,
    impl: str = "xla",
    chunk_size: int | None = None,
    grad_parts: bool = False,
):
    """``norm.norm_parts`` as a ``shard_map`` over ``sharding.mesh``: (n [d_out], w or None).

    Per shard: ‖K_:j‖² (unless ``base_sq`` is given), U = aᵀK [r, d_out_local] and
    G = aᵀa [r, r] on the local slice of d_in, in promote(f32, kernel dtype); then one psum
    of the three over ``sharding.in_axes`` (none when only d_out is sharded), and the
    assembly on the local columns (``xla_ops``; ``impl`` is checked, and every impl assembles
    the norm in XLA), with w = s·U + s²·G·b when ``grad_parts``.
    Arguments are the global arrays; shard_map moves them to kernel P(i, o), lora_a P(i, None),
    lora_b P(None, o), base_sq P(o) (free when they already lie so). n comes back P(o) and w
    P(None, o). The precision rule is ``norm_parts``'s (a rounded to the kernel's dtype for
    both GEMMs, b never rounded below f32). Differentiable.
    """
    check_impl(impl)
    in_axes, out_axes = sharding.in_axes, sharding.out_axes
    a_spec, b_spec, n_spec = adapter_specs(sharding.kernel_spec)
    k_spec = P(_entry(in_axes), _entry(out_axes))
    has_base_sq = base_sq is not None

    def local(kernel, lora_a, lora_b, *rest):
        u, gram = norm_gemms(kernel, lora_a, chunk_size=chunk_size)
        if has_base_sq:
            sq = rest[0]
            if in_axes:
                u, gram = jax.lax.psum((u, gram), in_axes)
        else:
            sq = base_sq_norm(kernel, chunk_size=chunk_size)
            if in_axes:
                u, gram, sq = jax.lax.psum((u, gram, sq), in_axes)
        n, w = assemble_parts(
            u, gram, lora_b, sq, kernel_dtype=kernel.dtype, scaling=scaling, grad_parts=grad_parts
        )
        return n if w is None else (n, w)

    in_specs = (k_spec, a_spec, b_spec) + ((n_spec,) if has_base_sq else ())
    args = (kernel, lora_a, lora_b) + ((base_sq,) if has_base_sq else ())
    out_specs = (n_spec, b_spec) if grad_parts else n_spec
    kw = {} if sharding.mesh is None else {"mesh": sharding.mesh}
    mapped = jax.shard_map(local, in_specs=in_specs, out_specs=out_specs, **kw)
    out = mapped(*args)
    return out if grad_parts else (out, None)


def sharded_factored_norm(
    kernel,
    lora_a,
    lora_b,
    scaling,
    *,
    kernel_spec,
    mesh: Mesh | None = None,
    base_sq=None,
    chunk_size=None,
    impl: str = "auto",
):
    """``factored_norm`` of a kernel that lies on ``mesh`` as ``kernel_spec`` ([d_in, d_out]
    entries, e.g. ``(None, "model")`` column- or ``("model", None)`` row-parallel), as a
    ``shard_map`` (``sharded_norm_parts``). Same arguments and result as ``factored_norm``;
    n comes back sharded like d_out. ``mesh`` None: the mesh of the context
    (``jax.set_mesh``)."""
    _, d_out, _ = check_adapter(kernel, lora_a, lora_b)
    s = check_scaling(scaling)
    check_vector("base_sq", base_sq, d_out)
    n, _ = sharded_norm_parts(
        kernel,
        lora_a,
        lora_b,
        base_sq,
        sharding=NormSharding(kernel_spec, mesh),
        scaling=s,
        impl=impl,
        chunk_size=check_chunk_size(chunk_size),
    )
    return n


def kernel_spec_of(layer) -> PartitionSpec:
    """The [d_in, d_out] PartitionSpec of a ``DoraDense``/``nnx.Linear`` kernel from its nnx
    metadata (logical axis rules applied, as ``nnx.get_partition_spec``); P() without any."""
    spec = nnx.spmd.get_var_pspec(layer.kernel)
    return P(None, None) if spec is None or len(spec) == 0 else spec


def layer_norm(layer, mesh: Mesh | None = None, *, impl: str | None = None, dtype=None):
    """``DoraDense.norm()`` as a ``shard_map`` over ``mesh``, with the kernel's spec from its
    metadata (``kernel_spec_of``); impl defaults to the layer's. For inference with a fixed
    adapter: ``layer.frozen_norm = DoraCache(layer_norm(layer, mesh))``."""
    if layer.merged:
        raise ValueError("layer_norm() needs the unmerged kernel; call unmerge() first")
    kernel = layer.kernel.get_value()
    cd = (layer.dtype or kernel.dtype) if dtype is None else dtype
    return sharded_factored_norm(
        kernel.astype(cd),
        layer.lora_a.get_value(),
        layer.lora_b.get_value(),
        layer.scaling,
        kernel_spec=kernel_spec_of(layer),
        mesh=mesh,
        base_sq=None if layer.base_sq is None else layer.base_sq.get_value(),
        impl=layer.impl if impl is None else impl,
    )


def named(mesh: Mesh, *entries) -> NamedSharding:
    """``NamedSharding(mesh, P(*entries))``, a shorthand for examples and tests."""
    return NamedSharding(mesh, P(*entries))
