"""Stacked weights: W and the adapter's A in one buffer, so one GEMM does the work of two.

A DoRA layer's fused tier makes two pairs of GEMMs that share an operand (``ops``): the
forward's base = x Wᵀ and h = x aᵀ both read x, and the backward's dx = dy_g W + s·t a is a
GEMM and a second one over its output. With F = [W; a] ([d_out + r, d_in], W's dtype) each
pair is one GEMM (docs/design.md §4, "stacked weights"):

    x Fᵀ = [base | h],        [dy_g | s·t] F = dx

``StackedWeights`` owns F. W's Parameter is re-homed into its first d_out rows (its values
copied once, its Parameter object kept), and so is lora_A's when A already has W's dtype; for
adapters in another dtype (PEFT's fp32 default) the last r rows hold A's cast, written when
the module's cache recomputes its entry (``sync``). The Parameters view F through aliases
with version counters of their own (``Tensor.data``), so an optimizer step on A does not look
like a write to W to the caches, and a cast written into the last rows while a backward that
saved them is pending is refused by autograd (that backward's a would no longer be the one
its forward used).

``holds`` tells whether the Parameters still live in F: ``module.to()``, ``load_state_dict(
assign=True)`` and sharding give them new storage. The layer then takes the two-GEMM path
and re-stacks (``dora_torch.Linear`` does after ``_apply``); a forward never allocates F.
"""

from __future__ import annotations

import torch


class StackedWeights:
    """F = [W; a] for one layer (module doc). ``buffer`` is F; ``tail`` its last r rows."""

    __slots__ = ("_shape", "_source", "buffer", "owns_a", "tail")

    @torch.no_grad()
    def __init__(self, weight: torch.nn.Parameter, lora_A: torch.nn.Parameter) -> None:
        d_out, d_in = weight.shape
        r = lora_A.shape[0]
        buffer = torch.empty(d_out + r, d_in, dtype=weight.dtype, device=weight.device)
        buffer[:d_out].copy_(weight)
        self.owns_a = lora_A.dtype == weight.dtype and lora_A.device == weight.device
        if self.owns_a:
            buffer[d_out:].copy_(lora_A)
        # From here on nothing can fail: the Parameters move into F.
        weight.data = buffer.data[:d_out]
        if self.owns_a:
            lora_A.data = buffer.data[d_out:]
        self.buffer = buffer
        self.tail = buffer.data[d_out:]  # written by ``sync`` (A in another dtype)
        self._source = None  # the cache entry whose cast ``tail`` holds
        self._shape = (d_out, r, d_in)

    def holds(self, weight: torch.Tensor, lora_A: torch.Tensor) -> bool:
        """Whether W (and A, when F holds it) still are F's rows, as built."""
        buffer, (d_out, r, d_in) = self.buffer, self._shape
        if weight.data_ptr() != buffer.data_ptr() or weight.shape != (d_out, d_in):
            return False
        if weight.dtype != buffer.dtype or weight.stride() != (d_in, 1):
            return False
        if self.owns_a:
            return lora_A.data_ptr() == self.tail.data_ptr() and lora_A.shape == (r, d_in)
        return lora_A.shape == (r, d_in)

    def sync(self, entry: tuple) -> torch.Tensor:
        """The a that F's last r rows hold for ``entry`` (the cache's (n, a, b), a in W's
        dtype): ``entry``'s own a when F holds A itself, else ``tail`` with that cast copied
        in when the entry is new (by identity: every recomputation makes a new tuple)."""
        if self.owns_a:
            return entry[1]
        if entry is not self._source:
            self.tail.copy_(entry[1])
            self._source = entry
        return self.tail
