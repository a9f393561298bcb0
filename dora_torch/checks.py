"""Argument checks of the public functions: errors name the argument and show the shapes."""

from __future__ import annotations

import torch

from shared_spec.peft_format import matches_target

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor; got dtype {t.dtype}")
    return t


def check_adapter(weight, lora_A, lora_B, magnitude=None, bias=None) -> tuple[int, int, int]:
    """weight [d_out, d_in], lora_A [r, d_in], lora_B [d_out, r], magnitude/bias [d_out];
    all on one device. Returns (d_out, d_in, r)."""
    _tensor("weight", weight)
    _tensor("lora_A", lora_A)
    _tensor("lora_B", lora_B)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [d_out, d_in]; got shape {tuple(weight.shape)}")
    d_out, d_in = weight.shape
    if lora_A.dim() != 2 or lora_A.shape[1] != d_in:
        raise ValueError(
            f"lora_A must have shape [r, d_in] with d_in={d_in} to match weight "
            f"{tuple(weight.shape)}; got {tuple(lora_A.shape)}"
        )
    r = lora_A.shape[0]
    if r < 1:
        raise ValueError(f"lora_A must have rank r >= 1; got shape {tuple(lora_A.shape)}")
    if lora_B.dim() != 2 or tuple(lora_B.shape) != (d_out, r):
        raise ValueError(
            f"lora_B must have shape [d_out, r] = ({d_out}, {r}) to match weight "
            f"{tuple(weight.shape)} and lora_A {tuple(lora_A.shape)}; got {tuple(lora_B.shape)}"
        )
    for name, v in (("magnitude", magnitude), ("bias", bias)):
        if v is None:
            continue
        _tensor(name, v)
        if tuple(v.shape) != (d_out,):
            raise ValueError(
                f"{name} must have shape [d_out] = ({d_out},) to match weight "
                f"{tuple(weight.shape)}; got {tuple(v.shape)}"
            )
    named = [("weight", weight), ("lora_A", lora_A), ("lora_B", lora_B)]
    named += [(n, v) for n, v in (("magnitude", magnitude), ("bias", bias)) if v is not None]
    for name, v in named[1:]:
        if v.device != weight.device:
            raise ValueError(f"{name} is on {v.device} but weight is on {weight.device}")
    return d_out, d_in, r


def check_input(x, weight) -> None:
    """x [..., d_in] on weight's device, in weight's dtype (the base GEMM needs both) unless
    autocast is on for that device (the layer then casts both to the autocast dtype)."""
    _tensor("x", x)
    d_in = weight.shape[1]
    if x.dim() < 1 or x.shape[-1] != d_in:
        raise ValueError(
            f"x must have shape [..., d_in] with d_in={d_in} to match weight "
            f"{tuple(weight.shape)}; got {tuple(x.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"x has dtype {x.dtype} but weight has {weight.dtype}; cast one of them "
            "(the frozen base product runs in the activation dtype)"
        )


def _finite_real(name: str, value) -> float:
    """A finite real Python number (not a bool, a string or a tensor), as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be a Python number (int or float); got {type(value).__name__} {value!r}"
        )
    v = float(value)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite; got {value!r}")
    return v


def check_scaling(scaling) -> float:
    return _finite_real("scaling", scaling)


def check_lora_alpha(lora_alpha) -> float:
    """PEFT's lora_alpha: a finite real number (the file format stores it as a number)."""
    return _finite_real("lora_alpha", lora_alpha)


def check_dropout(p, name: str = "lora_dropout") -> float:
    """A dropout probability in [0, 1)."""
    v = _finite_real(name, p)
    if not 0.0 <= v < 1.0:
        raise ValueError(f"{name} must be in [0, 1); got {p!r}")
    return v


def check_adapter_dtype(dtype, name: str = "adapter_dtype") -> torch.dtype | None:
    """None (PEFT's rule, see ``adapter_dtype_for``) or a floating-point torch.dtype."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be None or one of {FLOAT_DTYPES}; got {dtype!r}")
    return dtype


def adapter_dtype_for(base_dtype: torch.dtype, adapter_dtype: torch.dtype | None) -> torch.dtype:
    """PEFT's adapter dtype rule: the base layer's dtype, except fp32 on fp16/bf16 bases;
    an explicit ``adapter_dtype`` wins."""
    if adapter_dtype is not None:
        return adapter_dtype
    return torch.float32 if base_dtype in (torch.float16, torch.bfloat16) else base_dtype


def check_chunk(chunk_size) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None; got {chunk_size!r}")
    return chunk_size


def check_bool(value, name: str) -> bool:
    """A real bool (not 0/1 or a string, which would silently mean something else)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return value


def check_module_selection(selection, name: str):
    """None, a regex string, or a sequence of module-name strings (PEFT's ``target_modules``
    forms, matched by ``shared_spec.peft_format.matches_target``)."""
    if selection is None or isinstance(selection, str):
        return selection
    try:
        names = list(selection)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"{name} must be None, a regex string or a sequence of module names; got {selection!r}"
        )
    return names


def selected_modules(selection, names, name: str, what: str) -> set[str]:
    """The names among ``names`` that ``selection`` (as ``check_module_selection`` returns
    it) selects; none for None. ValueError naming the argument when it selects none of them
    (``what``: the layers they are, e.g. "layers inject adapts")."""
    if selection is None:
        return set()
    chosen = {n for n in names if matches_target(selection, n)}
    if not chosen:
        names = list(names)
        raise ValueError(
            f"{name}={selection!r} selects none of the {len(names)} {what} (first: {names[:4]})"
        )
    return chosen


IMPLS = ("auto", "fused", "eager")


def check_impl(impl) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    return impl
