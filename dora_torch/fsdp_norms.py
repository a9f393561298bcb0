"""Every FSDP2-prepared DoRA layer's norm at once, from each rank's own rows (design §11).

FSDP2 shards W [d_out, d_in], B [d_out, r] and m [d_out] by rows with the same chunks, so the
rows a rank holds of W and B are the rows of the norm it can compute alone:

    n_i² = ‖W_i‖² + 2s·Σ_j B_ij (W_i Aᵀ)_j + s²·Σ_jk B_ij (A Aᵀ)_jk B_ik      (i: local rows)

needs all of A (r rows, sharded too) and nothing else from other ranks. ``LocalNorms`` does
that for all layers of a model at the start of every root forward (a forward pre-hook on the
model ``prepare_fsdp`` was given):

  1. one all-gather of every layer's local A rows (r·d_in per layer), rounded to W's dtype;
  2. per layer, the norm of the local rows (``norm.detached_norm`` on the local shards, cast
     to the dtype the forward computes in, with ‖W_i‖² that ``prepare_fsdp`` kept);
  3. one all-gather of every layer's local norm rows, so each layer has its
     whole [d_out] norm before its own all-gather even starts.

On CUDA, step 2 is captured in a CUDA graph the second time it sees the same tensors and
replayed from then on (``config.NORM_GROUP_GRAPHS``, as for the norm group), so its host
cost is one replay instead of a few launches per layer; the collectives stay outside.

Each layer's forward pre-hook then installs its norm in the layer's cache for the unsharded
tensors of that forward, so the forward reads it instead of computing U = W Aᵀ from the
all-gathered W, layer by layer. No W is gathered for it, and each rank computes 1/world of
the rows.

Ranks never disagree about running the collectives: every rank runs every root forward, and
the computation runs at each one unconditionally (micro-batches of one optimizer step pay for
it each time, as the per-layer path under FSDP2 did). A layer uses the result only while it
is current: the optimizer-step count and the versions of its sharded W, A and B are those
the result was computed from; otherwise (a write since the root forward, or a forward that
did not come through the root module) the layer computes its norm itself, as before.
Layers whose parameters are not sharded on one 1-D mesh by rows (HSDP, other placements),
or whose compute dtype differs from the first layer's, are left to the per-layer path.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from . import cache, config, norm
from .dispatch import FUSED_DTYPES, resolve_impl
from .matmul import compute_dtype
from .norm_group import graph_key

logger = logging.getLogger("dora_torch")


def _row_sharded(t, mesh) -> bool:
    return (
        isinstance(t, DTensor)
        and t.device_mesh == mesh
        and mesh.ndim == 1
        and tuple(t.placements) == (Shard(0),)
    )


def _padded_rows(local: torch.Tensor, rows: int) -> torch.Tensor:
    """``local`` [k, ...] with zero rows appended up to ``rows`` (FSDP2's chunks are
    ⌈n / world⌉ rows; the last ranks may hold fewer, or none)."""
    if local.shape[0] == rows:
        return local
    pad = local.new_zeros((rows - local.shape[0], *local.shape[1:]))
    return torch.cat([local, pad])


def _all_gather(mine: torch.Tensor, world: int, group, out=None) -> torch.Tensor:
    """[world, n]: every rank's 1-D ``mine`` (same n on every rank), one collective, into
    ``out`` (1-D, world·n) if given."""
    flat = mine.new_empty(world * mine.numel()) if out is None else out
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(flat, mine, group=group)
    return flat.view(world, -1)


class LocalNorms:
    """The norms of a model's prepared layers, computed together at each root forward."""

    def __init__(self, members, tensors_of, param_dtype: torch.dtype | None) -> None:
        """``members``: (module, state) pairs, ``state`` the module's ``prepare_fsdp`` record
        (``local_base_sq``, ``versions``, and ``local_norm``, which this writes);
        ``tensors_of(module)``: its (W, A, B, s, impl) as they are at rest (sharded)."""
        self._members = [(weakref.ref(m), s) for m, s in members]
        self._tensors_of = tensors_of
        self.param_dtype = param_dtype
        self.computations = 0  # root forwards that computed the norms (tests and logs)
        self._a_buf: torch.Tensor | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: torch.Tensor | None = None
        self._signature: tuple | None = None
        self._seen: tuple | None = None
        self._failed = False

    def compute(self) -> None:
        """Steps 1-3 of the module doc; every rank must call it at the same point."""
        members = []
        for ref, state in self._members:
            module = ref()
            found = None if module is None else self._tensors_of(module)
            state.local_norm = None
            if found is not None:
                members.append((state, found))
        if not members:
            return
        mesh = members[0][1][0].device_mesh
        dtype = self.param_dtype or members[0][1][0].dtype
        chosen = []
        for state, (W, A, B, s, impl) in members:
            if (
                all(_row_sharded(t, mesh) for t in (W, A, B))
                and (self.param_dtype or W.dtype) == dtype
            ):
                chosen.append((state, W, A, B, s, impl))
        if not chosen:
            return
        group, world = mesh.get_group(), mesh.size()
        # 1. all of every layer's A, in one collective (into a buffer kept across calls: a
        # captured step 2 reads it at a fixed address).
        chunks = [-(-A.shape[0] // world) for _, _, A, *_ in chosen]
        local_a = [
            _padded_rows(A.to_local().detach().to(dtype), c).reshape(-1)
            for (_, _, A, *_), c in zip(chosen, chunks, strict=True)
        ]
        mine = torch.cat(local_a)
        buf = self._a_buf
        if buf is None or (buf.numel(), buf.dtype, buf.device) != (
            world * mine.numel(),
            mine.dtype,
            mine.device,
        ):
            buf = self._a_buf = mine.new_empty(world * mine.numel())
        every = _all_gather(mine, world, group, out=buf)
        # 2. the norm of this rank's rows of each layer.
        plan, start = [], 0
        for (state, W, A, B, s, impl), c, t in zip(chosen, chunks, local_a, strict=True):
            w_raw = W.to_local().detach()
            fused = impl != "eager" and w_raw.is_cuda and dtype in FUSED_DTYPES
            a_rows = (start, start + t.numel(), world * c, A.shape)
            start += t.numel()
            plan.append((w_raw, B.to_local().detach(), state.local_base_sq(w_raw, dtype), s,
                         fused, a_rows, -(-W.shape[0] // world)))  # fmt: skip
        local_n = self._local_rows(plan, every, dtype)
        # 3. every layer's whole norm, in one collective.
        every = _all_gather(local_n, world, group)
        start = 0
        steps = cache.optimizer_steps()
        for (state, W, *_), (*_, rows) in zip(chosen, plan, strict=True):
            full = every[:, start : start + rows].reshape(-1)[: W.shape[0]]
            start += rows
            state.local_norm = (full, dtype, steps, state.versions())
        self.computations += 1

    def _norms_of_rows(self, plan, every, dtype) -> torch.Tensor:
        """Step 2 from the local shards (``plan``) and the gathered A rows: the padded local
        norms of every layer, concatenated."""
        out = []
        for w_raw, b_raw, base_sq, s, fused, (a0, a1, rows_a, shape_a), rows in plan:
            a_full = every[:, a0:a1].reshape(rows_a, shape_a[1])[: shape_a[0]]
            w_loc = w_raw.to(dtype)
            # B as the forward sees it: cast by the mixed-precision policy, else its own
            # dtype (the assembly takes B at fp32; A is rounded to W's dtype either way).
            b_loc = b_raw if self.param_dtype is None else b_raw.to(self.param_dtype)
            if w_loc.shape[0] == 0:  # a rank past the last chunk (FSDP2 pads, d_out < world)
                n = base_sq.new_empty(0)
            else:
                n = norm.detached_norm(w_loc, a_full, b_loc, base_sq, s, fused)
            out.append(_padded_rows(n, rows))
        return torch.cat(out)

    def _can_capture(self, weight: torch.Tensor) -> bool:
        return (
            weight.is_cuda
            and config.NORM_GROUP_GRAPHS
            and not self._failed
            and not torch.cuda.is_current_stream_capturing()
        )

    def _local_rows(self, plan, every, dtype) -> torch.Tensor:
        """``_norms_of_rows``, captured in a CUDA graph the second time the same tensors
        (addresses, shapes, strides, dtypes, scalings) are seen and replayed from then on,
        as ``norm_group.NormGroup`` does; eager on CPU, while another capture runs, with
        ``config.NORM_GROUP_GRAPHS`` off, or after a capture failed."""
        if not self._can_capture(plan[0][0]):
            return self._norms_of_rows(plan, every, dtype)
        signature = (
            graph_key(every),
            dtype,
            *((graph_key(w), graph_key(b), graph_key(q), s, f, a) for w, b, q, s, f, a, _ in plan),
        )
        if signature == self._signature:
            self._graph.replay()
            return self._static.clone()
        if signature != self._seen:
            self._seen, self._graph, self._signature = signature, None, None
            return self._norms_of_rows(plan, every, dtype)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                static = self._norms_of_rows(plan, every, dtype)
        except Exception as e:  # any capture failure: stay eager
            logger.warning(
                "dora_torch: capturing the FSDP2 local norms failed (%s); they are computed "
                "eagerly from now on",
                e,
            )
            self._failed = True
            return self._norms_of_rows(plan, every, dtype)
        self._graph, self._static, self._signature = graph, static, signature
        graph.replay()
        return static.clone()


def install(norm_cache, found, state, x) -> bool:
    """Hand a module's cache the norm ``LocalNorms`` computed, for the unsharded tensors of
    this forward (``found`` = its (W, A, B, s, impl); called from a forward pre-hook after
    FSDP2's unshard). False when there is none that is current for this call."""
    entry = state.local_norm
    if entry is None or not isinstance(x, torch.Tensor) or torch.is_autocast_enabled(x.device.type):
        return False
    n, dtype, steps, versions = entry
    weight, lora_A, lora_B, scaling, impl = found
    if (
        steps != cache.optimizer_steps()
        or versions != state.versions()
        or weight.dtype != dtype
        or n.dtype != compute_dtype(weight.dtype)
        or n.shape[0] != weight.shape[0]
    ):
        return False
    tier = resolve_impl(impl, x, weight.shape[0])
    a, b = cache.detached_cast(lora_A, x.dtype), cache.detached_cast(lora_B, x.dtype)
    norm_cache.install(weight, lora_A, lora_B, scaling, tier, x.dtype, (n, a, b))
    return True
