"""Ticket counters: the workspace of the kernels whose programs elect a finisher.

A kernel that splits one output block over several programs (the token chunks of
``backward._scale_reduce_kernel`` in recover mode) lets each program store its fp32 partial,
then take a ticket: an int32 atomic per output block, acq_rel,
after a CTA barrier, so that every thread's partial store is ordered before it (CUTLASS's
serial split-K semaphore). The program that draws the last ticket adds the partials up in a
fixed order (deterministic: the only atomic is the counter, never a sum) and sets the counter
back to zero.
"""

from __future__ import annotations

import torch
from triton.runtime import driver

#: One buffer per (device, stream) for eager launches (a kernel workspace, like cuBLAS's):
#: every launch leaves the tickets it counted at zero, and launches on one stream run one
#: after the other, so the buffer is zero whenever one starts.
_TICKETS: dict[tuple[torch.device, int], torch.Tensor] = {}


def ticket_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 zeros, one per output block of a finisher-electing kernel. A
    compiled graph or a CUDA-graph capture gets zeros of its own (allocated, and zeroed,
    inside that graph, which may replay on any stream); eager launches share their stream's
    buffer, which costs no allocation or fill launch per call."""
    on_cuda = device.type == "cuda"
    if torch.compiler.is_compiling() or (on_cuda and torch.cuda.is_current_stream_capturing()):
        return torch.zeros(count, dtype=torch.int32, device=device)
    key = (device, driver.active.get_current_stream(device.index) if on_cuda else 0)
    tickets = _TICKETS.get(key)
    if tickets is None or tickets.numel() < count:
        tickets = _TICKETS[key] = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
    return tickets
