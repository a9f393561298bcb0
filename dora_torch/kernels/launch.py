"""``Launcher``: start a ``@triton.jit`` kernel with a fraction of ``JITFunction.run``'s host work.

Every eager DoRA layer call launches two or three Triton kernels. ``kernel[grid](...)`` binds
and specialises every argument in Python before it looks the compiled kernel up; inside a
training step that costs ~100 µs of host time per launch on the H200 machines
(benchmarks/NOTES.md, session 5), several times a cuBLAS call, and batch-1 steps are
host-bound. A ``Launcher`` keeps, per kernel, the compiled kernels Triton returned, keyed on
everything Triton specialises on, and launches a hit through the compiled kernel's own
launcher, the call ``JITFunction.run`` ends with, without launch metadata (no hooks).

The kernel's pointer parameters (named ``*_ptr``) come first. A hit passes them to Triton's
C launcher as the integer addresses the key already read, so that launcher neither calls
each tensor's ``data_ptr()`` nor asks the driver about the address (``cuPointerGetAttribute``,
one driver call per pointer and launch; benchmarks/NOTES.md, session 37).

The key is never coarser than Triton's own specialisation, so a hit always runs the kernel
Triton would have picked:
  - pointers: the tensor's dtype, whether it is on CUDA (a CPU tensor never hits, so Triton's
    own launch raises for it, as it would), and its address modulo 16 (Triton specialises on
    16-byte alignment);
  - every other argument (ints, floats, bools, None, constexprs) by its type and value: finer
    than Triton's classes of ints (== 1, divisible by 16, int32 / int64 range), which would
    cost more to compute, and finer than its one class of floats. The kernels here take floats
    fixed per layer (the scaling, a dtype's largest value); a float that changed in every call
    would miss in every call;
  - the launch options (num_warps, num_stages) and the current CUDA device.
Everything else goes through ``kernel[grid](...)``: the first call of a key (which compiles
and returns the kernel), a pointer argument that is not a tensor (None), a tensor passed for
another parameter (it would enter the key as itself), the Triton interpreter (CPU CI),
Dynamo tracing (Inductor captures the ``kernel[grid]`` call itself), launch hooks set in
``triton.knobs`` (profilers), and ``config.FAST_TRITON_LAUNCH = False``.
"""

from __future__ import annotations

import inspect

import torch
import triton
from triton.runtime import driver

from .. import config


def hooks_set() -> bool:
    """Whether a Triton launch hook is installed (``triton.knobs.runtime``; triton 3.6 keeps an
    empty ``HookChain`` there by default, which counts as none)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return False
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def launch_form(pointers: int, args: tuple, options: tuple) -> tuple[tuple, tuple]:
    """(key, arguments) of one launch: the cache key (see the module docstring) and the
    arguments for Triton's C launcher, the first ``pointers`` of ``args`` (tensors) replaced by
    their addresses. Raises AttributeError when one of those is not a tensor."""
    head, rest = args[:pointers], args[pointers:]
    addresses = [t.data_ptr() for t in head]
    tensors = [(t.dtype, t.is_cuda, p & 15) for t, p in zip(head, addresses)]
    return (options, tuple(map(type, rest)), rest, *tensors), (*addresses, *rest)


#: Distinct launch keys a ``Launcher`` keeps before it starts over (keys hold exact int
#: arguments, so every new token count is a new key; a miss only costs Triton's own path).
MAX_KEYS = 4096


class Launcher:
    """The fast launch path of one ``@triton.jit`` kernel (one per kernel, module-level)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.names = tuple(inspect.signature(kernel.fn).parameters)
        self.pointers = sum(n.endswith("_ptr") for n in self.names)
        if any(not n.endswith("_ptr") for n in self.names[: self.pointers]):
            raise ValueError(
                f"{kernel.__name__}: a Launcher needs the kernel's pointer parameters (named "
                f"*_ptr) first; got {self.names}"
            )
        self._compiled: dict[tuple, object] = {}
        self.broken = False  # set when this Triton's launcher refused our call
        self.fast_launches = 0  # for tests

    def __call__(
        self, grid: tuple, *args, num_warps: int, num_stages: int | None = None, **named
    ) -> None:
        """``kernel[grid](*args, **named, num_warps=..., num_stages=...)``: the leading
        parameters positionally, the rest (constexprs, usually) by name."""
        if named:
            rest = self.names[len(args) :]
            if tuple(named) == rest:  # in the kernel's order (every caller here): no lookups
                args += tuple(named.values())
            elif named.keys() == set(rest):
                args = (*args, *[named[n] for n in rest])
            else:
                raise TypeError(
                    f"{self.kernel.__name__}: parameters after the positional ones must be "
                    f"{rest} by name; got {tuple(named)}"
                )
        if len(args) != len(self.names):
            raise TypeError(
                f"{self.kernel.__name__} takes {len(self.names)} arguments {self.names}; "
                f"got {len(args)}"
            )
        if (
            not config.FAST_TRITON_LAUNCH
            or config.interpreting()
            or torch.compiler.is_compiling()
            or hooks_set()
            or self.broken
        ):
            self.kernel[grid](*args, **_options(num_warps, num_stages))
            return
        device = torch.cuda.current_device()
        try:
            key, call = launch_form(self.pointers, args, (device, num_warps, num_stages))
        except AttributeError:  # a pointer argument that is not a tensor (None)
            self.kernel[grid](*args, **_options(num_warps, num_stages))
            return
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **_options(num_warps, num_stages))
            # What JITFunction.run launches a compiled kernel with (``run`` loads the module).
            launcher = getattr(compiled, "run", None)
            function = getattr(compiled, "function", None)
            complete = launcher is not None and function is not None
            # A tensor among the other arguments would enter the key as itself: never kept.
            plain = not any(isinstance(a, torch.Tensor) for a in args[self.pointers :])
            if complete and plain and hasattr(compiled, "packed_metadata"):
                if len(self._compiled) >= MAX_KEYS:
                    self._compiled.clear()
                self._compiled[key] = (launcher, function, compiled.packed_metadata)
            return
        launcher, function, packed = entry
        g0, g1, g2 = (*grid, 1, 1)[:3]
        stream = driver.active.get_current_stream(device)
        try:
            launcher(g0, g1, g2, stream, function, packed, None, None, None, *call)
        except TypeError:  # a Triton whose launcher takes other arguments: parsed, not launched
            self.broken = True
            self._compiled.clear()
            self.kernel[grid](*args, **_options(num_warps, num_stages))
            return
        self.fast_launches += 1


def _options(num_warps: int, num_stages: int | None) -> dict:
    """The launch options as ``kernel[grid](...)`` takes them (num_stages: Triton's default
    when None)."""
    return {"num_warps": num_warps} | ({} if num_stages is None else {"num_stages": num_stages})
