"""How many kernels a compiled XLA program launches and how many bytes each one touches, read
from its optimized HLO text; for comparing two programs (ours against jnp LoRA) without a
profiler.

Dump the programs on the GPU machine, bring the text back, read it anywhere:

    XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=train" \\
    DORA_BENCH_JAX_LAYERS=1 DORA_BENCH_JAX_RANKS=16 \\
    python3 -m benchmarks.run --skip-tests --only model_jax
    python3 -m benchmarks.hlo_bytes /tmp/hlo/*jit_train*after_optimizations.txt
    python3 -m benchmarks.hlo_bytes --diff LORA.txt OURS.txt   # what ours adds, by kernel

A kernel is every instruction of the entry computation (and, once each, of the bodies of its
while loops and conditionals) that is not bookkeeping (parameters, constants, tuples,
get-tuple-element, bitcasts, the "-done" half of an async pair). Its bytes are the sizes of
its operands (for ``%f#k``, element k of a multi-output fusion) plus its output: exact for
elementwise fusions and library GEMMs, an upper bound for a fusion that reads only a slice
of an operand. Bytes moved at HBM speed give a floor on time; the kernel count, a floor on
launch latency.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass, field

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "token": 0,
}  # fmt: skip
FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "opt-barrier", "partition-id", "replica-id", "add-dependency",
}  # fmt: skip
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_NAME = re.compile(r"%([\w.\-]+(?:#\d+)?)")  # `%f#1`: element 1 of multi-output fusion f


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape: ``bf16[2,3]{1,0}``, a tuple of such, or a scalar ``f32[]``."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}")
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES[dtype]
    return total


def element_shape(shape: str, index: int) -> str:
    """Element ``index`` of a tuple shape ``(a, b, ...)``; an array shape is its own element 0."""
    if not shape.startswith("("):
        if index:
            raise ValueError(f"element {index} of the array shape {shape!r}")
        return shape
    parts = [p.strip() for p in _split_top(shape[1 : _closing(shape, 0)])]
    return parts[index]


def _operand_shape(shapes: dict[str, str], operand: str) -> str:
    name, _, index = operand.partition("#")
    shape = shapes.get(name, "")
    return element_shape(shape, int(index)) if index and shape else shape


def _closing(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced brackets in {text!r}")


@dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str

    @property
    def kind(self) -> str:
        """The opcode, with a fusion's kind or a custom call's target."""
        m = re.search(r"kind=(\w+)", self.attrs) if self.opcode == "fusion" else None
        if m:
            return f"fusion:{m.group(1)}"
        m = re.search(r'custom_call_target="([^"]+)"', self.attrs)
        return f"custom-call:{m.group(1)}" if m else self.opcode


def parse_instruction(line: str) -> Instruction | None:
    """One ``[ROOT] %name = shape opcode(operands), attrs`` line, else None."""
    body = line.strip()
    if body.startswith("ROOT "):
        body = body[5:]
    if "=" not in body or not body.startswith("%"):
        return None
    name, rest = body.split("=", 1)
    rest = rest.strip()
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    paren = rest.find("(")
    if paren <= 0:
        return None
    opcode = rest[:paren].strip()
    close = _closing(rest, paren)
    operands = [
        names[-1] for arg in _split_top(rest[paren + 1 : close]) if (names := _NAME.findall(arg))
    ]
    return Instruction(name.strip().lstrip("%"), shape, opcode, operands, rest[close + 1 :])


def _split_top(args: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in args:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur))
    return out


@dataclass
class Program:
    computations: dict[str, list[Instruction]] = field(default_factory=dict)
    entry: str = ""


def parse_program(text: str) -> Program:
    prog, current = Program(), None
    for line in text.splitlines():
        header = _HEADER.match(line.strip())
        if header:
            current = header.group(2)
            prog.computations[current] = []
            if header.group(1):
                prog.entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        if current is not None and (inst := parse_instruction(line)):
            prog.computations[current].append(inst)
    if not prog.entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return prog


@dataclass(frozen=True)
class Kernel:
    computation: str
    name: str
    kind: str
    shape: str
    bytes: float


_CALLED = re.compile(
    r"(?:body|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
    r"|branch_computations=\{([^}]*)\}"
)


def _called(attrs: str) -> list[str]:
    """The computations a while, conditional or call runs (not its loop condition)."""
    names = []
    for single, group in _CALLED.findall(attrs):
        names += [single] if single else [n.strip().lstrip("%") for n in group.split(",")]
    return names


def kernels(prog: Program) -> list[Kernel]:
    """The entry's kernels, and those of loop and conditional bodies it reaches (once each)."""
    out, seen, todo = [], set(), [prog.entry]
    while todo:
        comp = todo.pop(0)
        if comp in seen or comp not in prog.computations:
            continue
        seen.add(comp)
        insts = prog.computations[comp]
        shapes = {i.name: i.shape for i in insts}
        for inst in insts:
            if inst.opcode in ("while", "conditional", "call"):
                todo += _called(inst.attrs)
                continue
            if inst.opcode in FREE or inst.opcode.endswith(("-done", "-update")):
                continue
            size = shape_bytes(inst.shape) + sum(
                shape_bytes(_operand_shape(shapes, o)) for o in inst.operands
            )
            out.append(Kernel(comp, inst.name, inst.kind, inst.shape.split("{")[0], size))
    return out


def summary(ks: list[Kernel]) -> dict:
    by_kind = Counter()
    for k in ks:
        by_kind[k.kind] += 1
    return {"kernels": len(ks), "gb": sum(k.bytes for k in ks) / 1e9, "by_kind": dict(by_kind)}


def diff(base: list[Kernel], other: list[Kernel], min_bytes: float = 1e6) -> list[tuple]:
    """What ``other`` launches beyond ``base``, grouped by (kind, output shape): rows of
    (bytes added, kind, shape, count in base, count in other), largest change first; groups
    whose bytes move by less than ``min_bytes`` and whose counts agree are left out."""
    groups: dict[tuple, list] = {}
    for i, ks in enumerate((base, other)):
        for k in ks:
            g = groups.setdefault((k.kind, k.shape), [0.0, 0.0, 0, 0])
            g[i] += k.bytes
            g[2 + i] += 1
    rows = [
        (b1 - b0, kind, shape, n0, n1)
        for (kind, shape), (b0, b1, n0, n1) in groups.items()
        if abs(b1 - b0) >= min_bytes or n0 != n1
    ]
    return sorted(rows, key=lambda r: -abs(r[0]))


def _load(path: str) -> list[Kernel]:
    with open(path) as f:
        return kernels(parse_program(f.read()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="optimized HLO text (*after_optimizations.txt)")
    ap.add_argument("--top", type=int, default=15, help="largest kernels listed per file")
    ap.add_argument(
        "--diff", action="store_true", help="two files: what the second launches beyond the first"
    )
    args = ap.parse_args(argv)
    if args.diff:
        if len(args.files) != 2:
            ap.error("--diff takes exactly two files")
        base, other = (_load(p) for p in args.files)
        s0, s1 = summary(base), summary(other)
        print(f"{args.files[1]} over {args.files[0]}: {s1['kernels'] - s0['kernels']:+d} "
              f"kernels, {s1['gb'] - s0['gb']:+.3f} GB")  # fmt: skip
        for added, kind, shape, n0, n1 in diff(base, other):
            print(f"    {added / 1e6:+10.1f} MB  {n0:4d} -> {n1:<4d} {kind:32s} {shape}")
        return 0
    for path in args.files:
        ks = _load(path)
        s = summary(ks)
        print(f"{path}: {s['kernels']} kernels, {s['gb']:.3f} GB touched")
        for kind, n in sorted(s["by_kind"].items(), key=lambda kv: -kv[1]):
            print(f"    {n:5d}  {kind}")
        for k in sorted(ks, key=lambda k: -k.bytes)[: args.top]:
            print(f"    {k.bytes / 1e6:10.2f} MB  {k.kind:32s} {k.shape:36s} {k.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
