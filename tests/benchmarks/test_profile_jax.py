"""profile_jax on the CPU: the HLO op table, the per-op sums over a profile, a tiny run."""

from __future__ import annotations

import os

import pytest
from jax.profiler import ProfileData

from benchmarks import profile_jax as pj

HLO = """HloModule jit_train, entry_computation_layout={()}

ENTRY %main {
  %p0 = bf16[2048,4096]{1,0} parameter(0)
  %loop_fusion.3 = bf16[2048,4096]{1,0} fusion(%p0), kind=kLoop, calls=%fused_computation.3
  %custom-call.7 = (bf16[2048,16]{1,0}, s8[0]{0}) custom-call(%p0, %p0), \
custom_call_target="__cublas$gemm", metadata={op_name="jit(train)/jvp(dora_norm)/dot_general"}
  %fusion.4 = bf16[2048]{0} fusion(%p0), kind=kInput, calls=%f.4, \
metadata={op_name="jit(train)/transpose(jvp())/dora_grads/reduce_sum"}
  ROOT %tuple.9 = (bf16[2048,4096]{1,0}) tuple(%loop_fusion.3)
}
"""


def test_hlo_op_table_reads_opcode_kind_and_shape():
    table = pj.hlo_op_table(HLO)
    assert table["loop_fusion.3"] == dict(
        opcode="fusion", kind="kLoop", shape="bf16[2048,4096]{1,0}", scope=""
    )
    assert table["custom-call.7"]["kind"] == "__cublas$gemm"
    assert table["custom-call.7"]["opcode"] == "custom-call"
    # dora_jax's name scopes, inside a transform or as a path component; none elsewhere
    assert table["custom-call.7"]["scope"] == "dora_norm"
    assert table["fusion.4"]["scope"] == "dora_grads"
    assert table["loop_fusion.3"]["scope"] == ""
    assert table["tuple.9"]["opcode"] == "tuple"
    assert table["p0"]["opcode"] == "parameter"


def _event(meta, offset, dur_ps, op=None, module=None):
    stats = ""
    if op is not None:
        stats += f'stats {{ metadata_id: 10 str_value: "{op}" }} '
    if module is not None:
        stats += f'stats {{ metadata_id: 11 str_value: "{module}" }} '
    return f"events {{ metadata_id: {meta} offset_ps: {offset} duration_ps: {dur_ps} {stats}}}"


def _profile(events, plane="/device:GPU:0"):
    return ProfileData.from_text_proto(f"""
planes {{ id: 1 name: "{plane}"
  lines {{ id: 1 name: "Stream #13" {" ".join(events)} }}
  event_metadata {{ key: 1 value {{ id: 1 name: "kernel_a" }} }}
  event_metadata {{ key: 2 value {{ id: 2 name: "memcpy" }} }}
  stat_metadata {{ key: 10 value {{ id: 10 name: "hlo_op" }} }}
  stat_metadata {{ key: 11 value {{ id: 11 name: "hlo_module" }} }}
}}""")


def test_device_op_times_sum_per_op_and_filter_the_module():
    profile = _profile([
        _event(1, 0, 5_000_000, "fusion.1", "jit_train"),
        _event(1, 6_000_000, 3_000_000, "fusion.1", "jit_train"),
        _event(1, 9_000_000, 2_000_000, "fusion.2", "jit_other"),
        _event(2, 12_000_000, 1_000_000),
    ])  # fmt: skip
    times = pj.device_op_times(profile, module="jit_train")
    assert times == {"fusion.1": (2, 8000.0), "untagged:memcpy": (1, 1000.0)}
    assert pj.device_op_times(profile, module=None)["fusion.2"] == (1, 2000.0)
    # host planes: untagged events are Python frames, not device work
    host = _profile([_event(2, 0, 1_000_000), _event(1, 0, 4_000, "thunk.1")], plane="/host:CPU")
    assert pj.device_op_times(host, module=None, device_prefix="/host:CPU") == {"thunk.1": (1, 4.0)}
    assert pj.device_op_times(host, module=None) == {}


def test_idle_before_each_op_is_the_gap_since_the_latest_end():
    profile = _profile([
        _event(1, 0, 5_000_000, "fusion.1", "jit_train"),            # 0-5 µs
        _event(1, 2_000_000, 1_000_000, "fusion.3", "jit_train"),    # inside fusion.1: no gap
        _event(1, 8_000_000, 2_000_000, "fusion.2", "jit_train"),    # 3 µs after 5
        _event(1, 9_000_000, 1_000_000, "fusion.9", "jit_other"),    # another module: skipped
        _event(2, 10_500_000, 1_000_000),                            # untagged: skipped
        _event(1, 14_000_000, 1_000_000, "fusion.1", "jit_train"),   # 4 µs after 10
    ])  # fmt: skip
    assert pj.idle_before(profile, module="jit_train") == {"fusion.2": 3000.0, "fusion.1": 4000.0}
    assert pj.idle_before(profile, module="jit_train", device_prefix="/host:") == {}


def test_report_differences_are_per_opcode_and_kind():
    rows = [
        dict(provider="a", rank=4, step_ms=1.0, op="x", opcode="fusion", kind="kLoop", shape="",
             kernels_per_step=1.0, us_per_step=10.0),
        dict(provider="b", rank=4, step_ms=1.0, op="y", opcode="fusion", kind="kLoop", shape="",
             kernels_per_step=2.0, us_per_step=25.0),
        dict(provider="b", rank=4, step_ms=1.0, op="z", opcode="dot", kind="", shape="",
             kernels_per_step=1.0, us_per_step=4.0),
    ]  # fmt: skip
    assert pj.by_kind(rows[1:]) == {("fusion", "kLoop"): 25.0, ("dot", ""): 4.0}
    text = pj.report(rows)
    assert "+15.0  fusion kLoop" in text and "+4.0  dot" in text


def test_the_tiny_run_profiles_every_provider(tmp_path):
    rows = pj.main(["--tiny", "--steps", "2", "--layers", "1", "--ranks", "4",
                    "--providers", "jnp_lora", "ours_bf16", "--out", str(tmp_path)])  # fmt: skip
    assert {r["provider"] for r in rows} == {"jnp_lora", "ours_bf16"}
    # every profiled op is an instruction of the step's optimized HLO, run once per step
    assert all(r["opcode"] != "?" for r in rows)
    assert all(float(r["kernels_per_step"]).is_integer() for r in rows)
    assert (tmp_path / "profile_jax.csv").exists()
    assert (tmp_path / "profile_jax_ours_bf16_r4.hlo.txt").read_text().startswith("HloModule")


def test_unknown_providers_are_named():
    with pytest.raises(SystemExit):
        pj.main(["--tiny", "--providers", "nope"])


def test_command_buffers_are_switched_off_once_and_other_flags_kept(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    pj.disable_command_buffers()
    pj.disable_command_buffers()
    flags = os.environ["XLA_FLAGS"].split()
    assert flags == ["--xla_dump_to=/tmp/x", pj.NO_COMMAND_BUFFERS]


def test_by_scope_sums_device_time_and_kernels_per_part():
    rows = [dict(scope="dora_norm", us_per_step=2.0, kernels_per_step=1.0),
            dict(scope="", us_per_step=5.0, kernels_per_step=2.0),
            dict(scope="dora_norm", us_per_step=4.0, kernels_per_step=3.0)]  # fmt: skip
    assert pj.by_scope(rows) == {"dora_norm": (6.0, 4.0), "": (5.0, 2.0)}


def test_the_grad_program_is_profiled_beside_the_training_step(tmp_path):
    rows = pj.main(["--tiny", "--steps", "2", "--layers", "1", "--ranks", "4",
                    "--providers", "ours_bf16", "--programs", "grad", "train",
                    "--out", str(tmp_path)])  # fmt: skip
    assert [p for p in dict.fromkeys(r["program"] for r in rows)] == ["grad", "train"]
    grad = {r["op"] for r in rows if r["program"] == "grad"}
    train = {r["op"] for r in rows if r["program"] == "train"}
    assert grad and train and grad != train  # two programs, each profiled from its own HLO
    assert (tmp_path / "profile_jax_ours_bf16_r4_grad.hlo.txt").exists()
    assert (tmp_path / "profile_jax_ours_bf16_r4.hlo.txt").exists()
    text = pj.report(rows)
    assert "ours_bf16 (grad)" in text and "ours_bf16 - ours_bf16 (grad)" in text
    assert all(r["idle_before_us_per_step"] >= 0 for r in rows)
    assert "idle before" in text
    # every part of the layer owns kernels of both programs
    parts = {"dora_norm", "dora_compose", "dora_scale_reduce", "dora_grads"}
    for program in ("grad", "train"):
        assert parts <= {r["scope"] for r in rows if r["program"] == program}
    assert "by dora_jax part" in text
