"""Peak memory of a block of work, over what was allocated when it started.

CUDA: exact, from the caching allocator (``max_memory_allocated`` minus ``memory_allocated``
at entry). CPU: torch's CPU allocator keeps no statistics, so we sample the process's resident
set size (RSS) from a background thread. It is approximate (sampling interval, allocator
caching) — good for "about this much", not for small differences. Freed heap memory is handed
back to the OS first (glibc ``malloc_trim``) so an earlier run's leftovers do not hide this
run's peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading

import torch


def _malloc_trim() -> None:
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class PeakMemory:
    """Context manager; after exit ``peak_bytes`` holds the peak over the entry level.

    ``device``: a torch device (``"cpu"``, ``"cuda"``, ``"cuda:1"``). ``kind`` names the method.
    """

    def __init__(self, device, *, interval_s: float = 0.005):
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.kind = "cuda max_memory_allocated" if self._cuda else "cpu peak RSS (sampled)"

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def __enter__(self) -> PeakMemory:
        gc.collect()
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        _malloc_trim()
        self._base = _rss_bytes()
        self._max = self._base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._max = max(self._max, _rss_bytes())

    def __exit__(self, *exc) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        self._stop.set()
        self._thread.join()
        self._max = max(self._max, _rss_bytes())
        self.peak_bytes = self._max - self._base
