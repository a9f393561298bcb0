"""``Launcher``: start a ``@triton.jit`` kernel with a fraction of ``JITFunction.run``'s host work.

Every eager DoRA layer call launches two or three Triton kernels. ``kernel[grid](...)`` binds
and specialises every argument in Python before it looks the compiled kernel up; inside a
training step that costs ~100 µs of host time per launch on the H200 machines
(benchmarks/NOTES.md, session 5), several times a cuBLAS call, and batch-1 steps are
host-bound. A ``Launcher`` keeps, per kernel, the compiled kernels Triton returned, keyed on
everything Triton specialises on, and launches a hit through the compiled kernel's own
launcher, the call ``JITFunction.run`` ends with, without launch metadata (no hooks).

The key is never coarser than Triton's own specialisation, so a hit always runs the kernel
Triton would have picked:
  - tensors: dtype, and whether the data pointer is 16-byte aligned;
  - non-constexpr ints (and bools, None): their values, which is finer than Triton's
    classes (== 1, divisible by 16, int32 / int64 / uint64 range) and cheaper to compute;
  - non-constexpr floats: their type only (always passed as fp32);
  - constexprs and launch options (num_warps, num_stages): their values;
  - the current CUDA device.
Everything else goes through ``kernel[grid](...)``: the first call of a key (which compiles
and returns the kernel), the Triton interpreter (CPU CI), Dynamo tracing (Inductor captures
the ``kernel[grid]`` call itself), launch hooks set in ``triton.knobs`` (profilers), and
``config.FAST_TRITON_LAUNCH = False``.
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


def specialization_key(constexpr: tuple[bool, ...], args: tuple, options: tuple) -> tuple:
    """The cache key of one launch: ``args`` in the kernel's parameter order, ``constexpr``
    flags per parameter, ``options`` the launch options. See the module docstring.

    Finer than Triton's own key where that is cheaper to build: non-constexpr ints (and
    bools, None, strings) enter by value, so the key holds more than Triton's classes of
    them (== 1, divisible by 16, width); a tensor enters as (dtype, 16-byte aligned) and a
    non-constexpr float as its type only. One comprehension, no per-kind branching for the
    ints that make up most of a launch (~half the host time of a branch per argument)."""
    key = [
        a
        if c or type(a) is int
        else ((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else
              ("f" if type(a) is float else ("v", a)))
        for c, a in zip(constexpr, args, strict=True)
    ]  # fmt: skip
    return (options, *key)


#: Distinct launch keys a ``Launcher`` keeps before it starts over (keys hold exact int
#: arguments, so every new token count is a new key; a miss only costs Triton's own path).
MAX_KEYS = 4096


class Launcher:
    """The fast launch path of one ``@triton.jit`` kernel (one per kernel, module-level)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.names = tuple(inspect.signature(kernel.fn).parameters)
        # The interpreter's InterpretedFunction has no ``params``; it never takes the fast path.
        params = getattr(kernel, "params", None) or ()
        self.constexpr = tuple(bool(p.is_constexpr) for p in params)
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
        key = (device, specialization_key(self.constexpr, args, (num_warps, num_stages)))
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **_options(num_warps, num_stages))
            # What JITFunction.run launches a compiled kernel with (``run`` loads the module).
            launcher = getattr(compiled, "run", None)
            function = getattr(compiled, "function", None)
            packed = getattr(compiled, "packed_metadata", None)
            complete = launcher is not None and function is not None
            if complete and hasattr(compiled, "packed_metadata"):
                if len(self._compiled) >= MAX_KEYS:
                    self._compiled.clear()
                self._compiled[key] = (launcher, function, packed)
            return
        launcher, function, packed = entry
        g0, g1, g2 = (*grid, 1, 1)[:3]
        stream = driver.active.get_current_stream(device)
        try:
            launcher(g0, g1, g2, stream, function, packed, None, None, None, *args)
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
