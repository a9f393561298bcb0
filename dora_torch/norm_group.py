"""One recomputation of every DoRA layer's norm per parameter update, replayed as a CUDA graph.

After each optimizer step every adapted layer of a model needs its norm again (and, with fp32
adapters, its adapter casts). Per layer that is two GEMMs, one Triton launch and the cache's
Python work: on a host-bound training step (batch 1 × 2048 tokens, Llama-8B shapes) those
per-layer launches cost more host time than the norms cost GPU time (benchmarks/NOTES.md,
session 5). A ``NormGroup`` holds the DoRA layers of one model (``accelerate_peft`` and
``inject`` make one); the first layer whose cache misses refreshes them all:

  1. it lists the members whose adapter is active, on this layer's CUDA device, in its
     dtype and fused tier (others keep the per-layer path); later refreshes reuse that
     list while the requesting layer's tensors are the listed ones (``_relisted``);
  2. their ‖W‖² is brought up to date (each cache keeps it at a fixed address);
  3. the first time a set of tensors is seen, the norms are computed eagerly; the second
     time the same set (same addresses, shapes, dtypes and scalings) is seen, that
     computation is captured in a CUDA graph; from then on one replay recomputes every
     norm and cast from the tensors' current contents;
  4. the outputs are copied out of the graph's static buffers (one copy per output dtype),
     so a later replay never changes a tensor that a pending backward saved;
  5. each member's cache records its entry with the tensors' stamps and the current key
     (``cache.NormCache.install``), exactly as its own computation would have, and members
     that keep a norm buffer (``cache.keeps_norm_buffer``: what compiled graphs read) get
     it written, all with one ``torch._foreach_copy_``.

After each optimizer step the global step hook calls ``refresh_buffers``, which runs the same
recomputation at once (no cache miss needed) when a member keeps a norm buffer, so compiled
graphs read fresh buffers without a per-layer refresh.

A member is never read stale: the group only runs on a cache miss or right after an optimizer
step (which makes every entry stale), recomputes from the tensors as they are at that moment,
and the entries it installs are validated by the same stamps as any other. Nothing is captured
while another CUDA graph is being captured, under ``torch.compile``, on CPU (the group then
computes its members eagerly, one by one), or with ``config.NORM_GROUP_GRAPHS = False``.
"""

from __future__ import annotations

import logging
import weakref

import torch

from . import config
from .cache import (
    DORA_BASE_SQ_BUFFER,
    DORA_NORM_BUFFER,
    _is_sharded,
    compute_state,
    fits,
    keeps_norm_buffer,
    module_cache,
    write_norm_buffer,
)
from .dispatch import FUSED_DTYPES

logger = logging.getLogger("dora_torch")


class NormGroup:
    """The DoRA layers of one model whose norms are recomputed together (module doc)."""

    def __init__(self, modules=()) -> None:
        self._members: list[weakref.ref] = []
        self._graph: torch.cuda.CUDAGraph | None = None
        self._signature: tuple | None = None
        self._seen: tuple | None = None
        self._static: tuple = ()
        self._failed = False  # a capture raised: no further attempts
        self._listed: list[tuple] | None = None  # the last refresh's members (``_relisted``)
        #: Streams a capture spreads the members over (``config.NORM_GROUP_STREAMS`` when
        #: the group is made); the side streams themselves are made at the first capture.
        self.streams = max(1, int(config.NORM_GROUP_STREAMS))
        self._streams: list[torch.cuda.Stream] = []
        self.captures = 0  # for tests and logs
        self.replays = 0
        for module in modules:
            self.add(module)

    def __getstate__(self) -> dict:
        """Pickled as its live members and stream count (a captured graph reads addresses no
        copy shares)."""
        members = [m for m in (ref() for ref in self._members) if m is not None]
        return {"members": members, "streams": self.streams}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        self._members = [weakref.ref(m) for m in state["members"]]
        self.streams = state.get("streams", self.streams)

    def add(self, module: torch.nn.Module) -> None:
        """Make ``module`` (which has a ``cache.attach``-ed NormCache) a member."""
        norm_cache = module_cache(module)
        if norm_cache is None:
            raise ValueError(f"{type(module).__name__} has no dora_torch norm cache to group")
        if norm_cache.group is not None and norm_cache.group is not self:
            norm_cache.group.remove(module)
        norm_cache.group = self
        if all(ref() is not module for ref in self._members):
            self._members.append(weakref.ref(module))
        self._listed = None

    def remove(self, module: torch.nn.Module) -> None:
        self._members = [ref for ref in self._members if ref() not in (None, module)]
        self._listed = None
        norm_cache = module_cache(module)
        if norm_cache is not None and norm_cache.group is self:
            norm_cache.group = None

    def __len__(self) -> int:
        return sum(ref() is not None for ref in self._members)

    # ----------------------------------------------------------------------------- refresh
    def refresh(self, requester, weight, lora_A, lora_B, scaling, impl, dtype):
        """Recompute every eligible member's (n, a, b) and install it in its cache; return
        the requester's, or None when the requester's call is not one the group computes
        (the caller then computes it alone)."""
        if impl != "fused" or dtype != weight.dtype or not self._can_run(weight):
            self._listed = None  # this member may be listed: the next refresh looks again
            return None
        want = (requester, weight, lora_A, lora_B, scaling)
        listed = self._relisted(weight)
        found = None if listed is None else _position(listed[1], want)
        if found is None:  # something changed since the last refresh: look at every member
            listed = self._eligible(weight)
            found = _position(listed[1], want)
            if found is None:
                return None
        modules, members = listed
        values, base = self._compute(members, dtype)
        self._install(modules, members, values, base, impl, dtype)
        self._listed = [
            (weakref.ref(module), c, weakref.ref(w), weakref.ref(a), weakref.ref(b), s)
            for module, (c, w, a, b, s) in zip(modules, members, strict=True)
        ]
        return values[found]

    def refresh_buffers(self) -> list[torch.nn.Module]:
        """Recompute every eligible member now (after an optimizer step), installing the
        entries and writing the buffers as ``refresh`` does; also re-point the members' ‖W‖²
        buffers (``config.COMPILED_BASE_SQ_BUFFER``). Returns the members done, [] when the
        group computes none (the caller refreshes those module by module)."""
        weight = None
        for ref in self._members:
            module = ref()
            found = None if module is None else module._dora_tensors(module)
            if found is not None and found[4] != "eager":
                weight = found[0]
                break
        if weight is None or not (weight.is_cuda and weight.dtype in FUSED_DTYPES):
            return []
        if not self._can_run(weight):
            return []
        modules, members = self._eligible(weight)
        if members:
            values, base = self._compute(members, weight.dtype)
            self._install(modules, members, values, base, "fused", weight.dtype)
        return modules

    @staticmethod
    def _can_run(weight: torch.Tensor) -> bool:
        """Not while tracing, nor inside a CUDA-graph capture."""
        if torch.compiler.is_compiling():
            return False
        # inside someone else's capture: the per-layer path is captured there
        return not (weight.is_cuda and torch.cuda.is_current_stream_capturing())

    def _compute(self, members, dtype) -> tuple[list[tuple], list[torch.Tensor]]:
        """(n, a, b) of every member, one replay once the same tensors were seen twice, and
        each member's ‖W‖² (brought up to date first)."""
        weight = members[0][1]
        graphs = graphs_possible(weight) and not self._failed
        base = [c.base_sq(w) for c, w, *_ in members]
        signature = (
            (weight.device, dtype),
            *(
                (graph_key(w), graph_key(a), graph_key(b), q.data_ptr(), s)
                for (_, w, a, b, s), q in zip(members, base, strict=True)
            ),
        )
        if signature != self._signature and graphs:
            if signature == self._seen:
                self._capture(members, base, dtype, signature)
            else:
                self._graph = None
                self._seen = signature
        if graphs and self._graph is not None and signature == self._signature:
            return self._replay(), base
        values = [
            compute_state(w, a, b, q, s, "fused", dtype)
            for (_, w, a, b, s), q in zip(members, base, strict=True)
        ]
        return values, base

    @staticmethod
    def _install(modules, members, values, base, impl, dtype) -> None:
        """Record each member's entry; write the norm buffers compiled graphs read (one
        foreach copy for those already in place) and re-point the ‖W‖² buffers."""
        dst, src = [], []
        base_buffers = config.COMPILED_BASE_SQ_BUFFER
        for (c, w, a, b, s), value, q, module in zip(members, values, base, modules, strict=True):
            c.install(w, a, b, s, impl, dtype, value)
            if keeps_norm_buffer(module):
                n, buf = value[0], module._buffers.get(DORA_NORM_BUFFER)
                if fits(buf, n):
                    dst.append(buf)
                    src.append(n)
                else:
                    write_norm_buffer(module, n)
            if base_buffers and module._buffers.get(DORA_BASE_SQ_BUFFER) is not q:
                module._buffers[DORA_BASE_SQ_BUFFER] = q
        if dst:
            torch._foreach_copy_(dst, src)

    def _relisted(self, weight: torch.Tensor) -> tuple[list, list[tuple]] | None:
        """The last refresh's members and tensors, without asking each module for its
        adapter (``_eligible``: ~2 µs per member of host time, NOTES session 36); None when
        there was none, a module or tensor is gone, a member's W is no longer its module's,
        a member keeps a norm buffer (eval mode), or a tensor's device or dtype now differs
        from ``weight``'s.

        A member's adapter tensors may no longer be the ones it computes with (another
        adapter set active, the layer disabled or merged): the group then computes a norm
        that member does not read. Never wrong for the entries: an entry holds for the
        tensors it was computed from (their stamps), so that member misses its entry and asks
        for a refresh, whose request no longer matches the list (``refresh`` then looks at
        every member). What a refresh writes outside the entries, compiled graphs read
        unchecked, so it must be the module's own: ‖W‖² (in place, and the buffer compiled
        training graphs read), hence the check of W; the norm buffer of a member that keeps
        one (eval mode, or ``COMPILED_TRAIN_NORM``), hence no list while one does. A member
        that stops asking costs its norm's share of each replay until the next full look
        (``add``, ``remove``, or a request the group cannot serve)."""
        listed = self._listed
        if listed is None:
            return None
        device, dtype = weight.device, weight.dtype
        modules, members = [], []
        for module_ref, c, w_ref, a_ref, b_ref, s in listed:
            module, w, a, b = module_ref(), w_ref(), a_ref(), b_ref()
            if module is None or w is None or a is None or b is None:
                return None
            if keeps_norm_buffer(module) or module._dora_weight(module) is not w:
                return None
            if w.dtype != dtype or w.device != device:
                return None
            modules.append(module)
            members.append((c, w, a, b, s))
        return modules, members

    def _eligible(self, weight: torch.Tensor) -> tuple[list, list[tuple]]:
        """The live members the group computes with ``weight``'s, and (cache, W, A, B, s)
        of each."""
        modules, out, alive = [], [], []
        for ref in self._members:
            module = ref()
            if module is None:
                continue
            alive.append(ref)
            norm_cache = module_cache(module)
            found = module._dora_tensors(module) if norm_cache is not None else None
            if found is None:
                continue
            w, a, b, s, impl = found
            if (
                impl == "eager"
                or w.device != weight.device
                or w.dtype != weight.dtype
                or _is_sharded(w)
            ):
                continue
            modules.append(module)
            out.append((norm_cache, w, a, b, s))
        self._members = alive
        return modules, out

    # ------------------------------------------------------------------------ CUDA graph
    def _capture(self, members, base, dtype, signature) -> None:
        """Capture the members' computation; norms and real casts (adapters in another dtype)
        concatenated into one static buffer each."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                values = _compute_on_streams(members, base, dtype, self._side_streams(members))
                static = static_outputs(members, values, dtype)
        except Exception as e:  # any capture failure: keep the eager path
            logger.warning(
                "dora_torch: capturing the norm group failed (%s); its norms are computed "
                "layer by layer from now on (dora_torch.config.NORM_GROUP_GRAPHS = False "
                "skips the attempt)",
                e,
            )
            self._graph, self._signature, self._failed = None, None, True
            return
        self._graph, self._signature, self._static = graph, signature, static
        self.captures += 1

    def _side_streams(self, members) -> list[torch.cuda.Stream]:
        """``self.streams`` - 1 side streams on the members' device, made once per device (a
        capture forks onto them and joins them again)."""
        want = self.streams - 1
        device = members[0][1].device
        if want and (len(self._streams) != want or self._streams[0].device != device):
            self._streams = [torch.cuda.Stream(device) for _ in range(want)]
        return self._streams[:want]

    def _replay(self) -> list[tuple]:
        self._graph.replay()
        self.replays += 1
        norms, flat_casts, layout = self._static
        casts = None if flat_casts is None else flat_casts.clone()
        return replay_values(norms.clone(), casts, layout)


def _compute_on_streams(members, base, dtype, side) -> list[tuple]:
    """Every member's (n, a, b), member i on stream i mod (1 + len(side)) of the current
    stream and ``side``, each side stream forked from the current one and joined back into
    it. Inside a capture the members become parallel branches of one graph; their kernels and
    results are the one-stream order's (each member's work stays on one stream, in order)."""
    if not side:
        return [
            compute_state(w, a, b, q, s, "fused", dtype)
            for (_, w, a, b, s), q in zip(members, base, strict=True)
        ]
    main = torch.cuda.current_stream(members[0][1].device)
    streams = [main, *side]
    for stream in side:
        stream.wait_stream(main)
    values = []
    for i, ((_, w, a, b, s), q) in enumerate(zip(members, base, strict=True)):
        with torch.cuda.stream(streams[i % len(streams)]):
            values.append(compute_state(w, a, b, q, s, "fused", dtype))
    for stream in side:
        main.wait_stream(stream)
    return values


def static_outputs(members, values, dtype) -> tuple:
    """(norms, flat_casts, layout): the members' norms concatenated, and their real casts
    (adapters not in ``dtype``) flattened and concatenated (None when there are none), as
    one capture writes them; ``layout`` tells ``replay_values`` how to cut copies of the two
    into each member's (n, a, b): its norm rows, and per adapter the (offset, shape) of its
    cast, or the parameter itself where no cast is needed, detached once here. A replay runs
    only while the members' tensors are the ones captured (same addresses, shapes and
    dtypes: the signature), so the detached aliases stay theirs."""
    rows, places, casts, offset = [], [], [], 0
    for (_, _, a, b, _), (n, ca, cb) in zip(members, values, strict=True):
        rows.append(n.shape[0])
        for param, cast in ((a, ca), (b, cb)):
            if param.dtype == dtype:
                places.append(param.detach())
            else:
                places.append((offset, cast.shape))
                casts.append(cast.reshape(-1))
                offset += cast.numel()
    norms = torch.cat([n for n, _, _ in values])
    return norms, torch.cat(casts) if casts else None, (rows, places)


def replay_values(norms: torch.Tensor, flat_casts: torch.Tensor | None, layout) -> list[tuple]:
    """The members' (n, a, b) from fresh copies of a replay's outputs (``static_outputs``):
    views, one split for the norms; a cast is a view of ``flat_casts``."""
    rows, places = layout
    adapters = [
        place
        if isinstance(place, torch.Tensor)
        else flat_casts[place[0] : place[0] + place[1].numel()].view(place[1])
        for place in places
    ]
    return [(n, adapters[2 * i], adapters[2 * i + 1]) for i, n in enumerate(norms.split(rows))]


def _position(members: list[tuple], want: tuple) -> int | None:
    """Where ``want`` = (cache, W, A, B, s) is among ``members``: the same cache with the same
    tensor objects and scaling, else None."""
    c, w, a, b, s = want
    for i, m in enumerate(members):
        if m[0] is c:
            return i if m[1] is w and m[2] is a and m[3] is b and m[4] == s else None
    return None


def graphs_possible(weight: torch.Tensor) -> bool:
    """Whether a group of layers with ``weight``'s device may capture and replay its
    computation (``benchmarks/host_step_cpu`` makes this true on the CPU, with a stand-in
    graph, to time the replay path's host work)."""
    return weight.is_cuda and config.NORM_GROUP_GRAPHS


def graph_key(t: torch.Tensor) -> tuple:
    """What a captured graph depends on: the address, shape, strides and dtype it reads."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype


def group_norms(modules) -> NormGroup:
    """One ``NormGroup`` of ``modules`` (DoRA layers with a norm cache); see the module doc."""
    return NormGroup(modules)
