"""Stacked weights: W and the adapter's A in one buffer, so one GEMM does the work of two.

A DoRA layer's fused tier makes two pairs of GEMMs that share an operand (``ops``): the
forward's base = x Wᵀ and h = x aᵀ both read x, and the backward's dx = dy_g W + s·t a is a
GEMM and a second one over its output. With F = [W; a] ([d_out + r, d_in], W's dtype) each
pair is one GEMM (docs/design.md §4, "stacked weights"):

    x Fᵀ = [base | h],        [dy_g | s·t] F = dx

The backward's is always taken; the forward's only with ``config.STACK_FORWARD`` (off by
default: on the model's step its column-view outputs cost the next ops more than the GEMM
saved, benchmarks/NOTES.md session 33).

``StackedWeights`` re-homes W's Parameter into the first d_out rows of a new buffer (its
values copied once, the Parameter object kept), and lora_A's into the last r rows when A
already has W's dtype; for adapters in another dtype (PEFT's fp32 default) the last r rows
hold A's cast, written when the module's cache makes a new entry (``adapter_rows``).

Nothing here holds the buffer: W's (and A's) storage is the buffer's, and a stack keeps only
a weak reference to that storage. When ``module.to()``, ``load_state_dict(assign=True)`` or
sharding give W new storage, the old buffer is freed with the old W, and ``holds`` turns
False: calls take the two-GEMM path until something re-stacks (``dora_torch.Linear`` does
after ``_apply`` and loads). ``buffer`` views F from W on each call.

The Parameters view the buffer through aliases with version counters of their own
(``Tensor.data``), so an optimizer step on A is no write to W for the caches. The rows that
hold a cast are written through one alias, which pending backwards keep (they save it as
their a): a cast written while such a backward is pending bumps that alias's version, and
autograd refuses the backward, whose a would no longer be its forward's.
"""

from __future__ import annotations

import weakref

import torch


class StackedWeights:
    """F = [W; a] for one layer (module doc)."""

    __slots__ = ("_rows", "_source", "_storage", "_tail", "owns_a")

    @torch.no_grad()
    def __init__(self, weight: torch.nn.Parameter, lora_A: torch.nn.Parameter) -> None:
        d_out, d_in = weight.shape
        r = lora_A.shape[0]
        buffer = torch.empty(d_out + r, d_in, dtype=weight.dtype, device=weight.device)
        buffer[:d_out].copy_(weight)
        self.owns_a = lora_A.dtype == weight.dtype and lora_A.device == weight.device
        if self.owns_a:
            buffer[d_out:].copy_(lora_A)
        # From here on nothing can fail: the Parameters move into the buffer.
        weight.data = buffer.data[:d_out]
        if self.owns_a:
            lora_A.data = buffer.data[d_out:]
        self._storage = weakref.ref(buffer.untyped_storage())
        self._rows = (d_out, r, d_in)
        self._tail = None  # weak: the alias the last r rows are written through
        self._source = None  # the cache entry whose cast those rows hold

    def __getstate__(self) -> dict:
        """Pickled holding nothing: a copy's W has storage of its own (``dora_torch.Linear``
        re-stacks after unpickling)."""
        return {"rows": self._rows, "owns_a": self.owns_a}

    def __setstate__(self, state: dict) -> None:
        self._rows, self.owns_a = state["rows"], state["owns_a"]
        self._storage, self._tail, self._source = _no_storage, None, None

    def holds(self, weight: torch.Tensor, lora_A: torch.Tensor) -> bool:
        """Whether W (and A, when the buffer holds it) still are the buffer's rows."""
        storage, (d_out, r, d_in) = self._storage(), self._rows
        if storage is None or weight.untyped_storage() is not storage:
            return False
        if weight.storage_offset() != 0 or weight.shape != (d_out, d_in):
            return False
        if weight.stride() != (d_in, 1):
            return False
        if not self.owns_a:
            return True
        return (
            lora_A.untyped_storage() is storage
            and lora_A.storage_offset() == d_out * d_in
            and lora_A.shape == (r, d_in)
        )

    def buffer(self, weight: torch.Tensor) -> torch.Tensor:
        """F [d_out + r, d_in], viewed from W (which ``holds``)."""
        d_out, r, d_in = self._rows
        return weight.data.as_strided((d_out + r, d_in), (d_in, 1), 0)

    def adapter_rows(self, entry: tuple, weight: torch.Tensor) -> torch.Tensor:
        """The a that F's last r rows hold for ``entry`` (the cache's (n, a, b), a in W's
        dtype): ``entry``'s own a when F holds A itself; else the rows, with that cast copied
        in when the entry is new (by identity: every recomputation makes a new tuple)."""
        if self.owns_a:
            return entry[1]
        tail = None if self._tail is None else self._tail()
        if tail is None:  # no pending backward keeps the alias: a new one
            d_out, r, d_in = self._rows
            tail = weight.data.as_strided((r, d_in), (d_in, 1), d_out * d_in)
            self._tail = weakref.ref(tail)
        if entry is not self._source:
            tail.copy_(entry[1])
            self._source = entry
        return tail


def _no_storage() -> None:
    """The weak reference of a stack restored from a pickle: dead."""
    return None
