"""``benchmarks/hlo_bytes.py``: kernels and bytes read from optimized HLO text."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import hlo_bytes as hb

HLO = """\
HloModule jit_step, entry_computation_layout={(bf16[8,16]{1,0})->f32[8]{0}}

%fused_add (p0: f32[8,16], p1: f32[8,16]) -> f32[8,16] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[8,16]{1,0} parameter(1)
  ROOT %add.1 = f32[8,16]{1,0} add(%p0, %p1)
}

%body (arg: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %arg = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %v = f32[8,16]{1,0} get-tuple-element(%arg), index=1
  %twice = f32[8,16]{1,0} fusion(%v, %v), kind=kLoop, calls=%fused_add
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %twice)
}

%cond (arg.1: (s32[], f32[8,16])) -> pred[] {
  %arg.1 = (s32[], f32[8,16]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(false)
}

ENTRY %main.9 (x: bf16[8,16]) -> f32[8] {
  %x = bf16[8,16]{1,0} parameter(0)
  %up = f32[8,16]{1,0} convert(bf16[8,16]{1,0} %x)
  %gemm = (f32[8,16]{1,0}, s8[64]{0}) custom-call(%up, %up), custom_call_target="__cublas$gemm"
  %g0 = f32[8,16]{1,0} get-tuple-element(%gemm), index=0
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(%zero, %g0)
  %loop = (s32[], f32[8,16]{1,0}) while(%init), condition=%cond, body=%body
  %start = ((f32[8,16]{1,0}), f32[8,16]{1,0}) copy-start(%g0)
  %done = f32[8,16]{1,0} copy-done(%start)
  %out = f32[8,16]{1,0} get-tuple-element(%loop), index=1
  ROOT %red = f32[8]{0} reduce(%out, %zero), dimensions={1}, to_apply=%fused_add
}
"""


def test_shape_bytes():
    assert hb.shape_bytes("bf16[2,3]{1,0}") == 12
    assert hb.shape_bytes("f32[]") == 4
    assert hb.shape_bytes("(f32[8,16]{1,0}, s8[64]{0})") == 8 * 16 * 4 + 64
    with pytest.raises(ValueError, match="element type"):
        hb.shape_bytes("q7[3]")


def test_kernels_of_a_handwritten_program():
    prog = hb.parse_program(HLO)
    assert prog.entry == "main.9"
    ks = {k.name: k for k in hb.kernels(prog)}
    # bookkeeping is free; a while body is counted once; the "-done" half of a pair is free
    assert set(ks) == {"up", "gemm", "twice", "start", "red"}
    f32, bf16 = 8 * 16 * 4, 8 * 16 * 2
    assert ks["up"].bytes == bf16 + f32
    assert ks["gemm"].bytes == (f32 + 64) + 2 * f32
    assert ks["gemm"].kind == "custom-call:__cublas$gemm"
    assert ks["twice"].bytes == 3 * f32 and ks["twice"].computation == "body"
    assert ks["twice"].kind == "fusion:kLoop"
    assert ks["red"].bytes == f32 + 4 + 8 * 4  # to_apply of a reduce is not a kernel
    s = hb.summary(list(ks.values()))
    assert s["kernels"] == 5 and s["by_kind"]["fusion:kLoop"] == 1


def test_an_element_of_a_multi_output_fusion_counts_alone():
    """``%f#1`` reads element 1 of f's tuple, not the whole tuple."""
    text = """\
%fused (p: f32[8,16]) -> (f32[8,16], bf16[8]) {
  %p = f32[8,16]{1,0} parameter(0)
  ROOT %t = (f32[8,16]{1,0}, bf16[8]{0}) tuple(%p, %p)
}

ENTRY %main (x: f32[8,16]) -> bf16[8] {
  %x = f32[8,16]{1,0} parameter(0)
  %two = (f32[8,16]{1,0}, bf16[8]{0}) fusion(%x), kind=kLoop, calls=%fused
  ROOT %neg = bf16[8]{0} negate(%two#1)
}
"""
    ks = {k.name: k for k in hb.kernels(hb.parse_program(text))}
    assert ks["neg"].bytes == 2 * 8 * 2
    assert ks["two"].bytes == 8 * 16 * 4 + (8 * 16 * 4 + 8 * 2)
    assert hb.element_shape("(f32[2]{0}, (s8[3], u8[1]))", 1) == "(s8[3], u8[1])"
    with pytest.raises(ValueError, match="element 1"):
        hb.element_shape("f32[2]", 1)


def test_diff_groups_by_kind_and_shape(capsys, tmp_path):
    """--diff: the second program's extra kernels, by (kind, output shape)."""
    one = hb.Kernel("main", "a", "fusion:kLoop", "f32[8]", 64.0)
    base = [one, hb.Kernel("main", "g", "custom-call:gemm", "f32[8,8]", 5e6)]
    other = [
        *base,
        hb.Kernel("main", "b", "fusion:kLoop", "f32[8]", 64.0),
        hb.Kernel("main", "r", "fusion:kInput", "f32[4]", 3e6),
    ]
    rows = hb.diff(base, other)
    assert rows == [(3e6, "fusion:kInput", "f32[4]", 0, 1), (64.0, "fusion:kLoop", "f32[8]", 1, 2)]
    assert hb.diff(base, base) == []
    head = "ENTRY %m (x: f32[8]) -> f32[8] {\n  %x = f32[8]{0} parameter(0)\n"
    paths = [tmp_path / "a.txt", tmp_path / "b.txt"]
    paths[0].write_text(head + "}\n")
    paths[1].write_text(head + "  ROOT %y = f32[8]{0} negate(%x)\n}\n")
    paths = [str(p) for p in paths]
    assert hb.main(["--diff", *paths]) == 0
    out = capsys.readouterr().out
    assert "+1 kernels" in out and "negate" in out
    with pytest.raises(SystemExit):
        hb.main(["--diff", paths[0]])


def test_a_compiled_program_reads_back(capsys, tmp_path):
    """A CPU-compiled LoRA gradient: its GEMM output is found, and the CLI prints it."""

    def loss(a, b, x, w):
        return jnp.sum((x @ w + (x @ a) @ b) ** 2)

    args = (jnp.ones((128, 4)), jnp.ones((4, 256)), jnp.ones((64, 128)), jnp.ones((128, 256)))
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().as_text()
    ks = hb.kernels(hb.parse_program(text))
    assert any(k.shape == "f32[64,256]" for k in ks)
    assert sum(k.bytes for k in ks) >= 64 * 256 * 4 * 2  # the [T, N] product written and read
    path = tmp_path / "m.after_optimizations.txt"
    path.write_text(text)
    assert hb.main([str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "kernels" in out and "GB touched" in out
