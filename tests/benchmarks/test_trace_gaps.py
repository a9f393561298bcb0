"""``benchmarks/trace_gaps``: GPU idle time inside a profiled step, charged to the host op
that launched the kernel ending each gap (a synthetic Chrome trace with known answers)."""

from __future__ import annotations

import gzip
import json

from benchmarks.trace_gaps import analyse, load


def _trace() -> list[dict]:
    def x(name, cat, ts, dur, tid, **args):
        event = {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "tid": tid}
        if args:
            event["args"] = args
        return event

    return [
        x("train_step", "user_annotation", 0, 1000, 1),
        x("train_step", "gpu_user_annotation", 0, 1000, 7),  # the GPU-side copy: not a step
        x("outer", "cpu_op", 10, 900, 1),
        x("inner", "cpu_op", 500, 20, 1),
        x("cudaLaunchKernel", "cuda_runtime", 20, 5, 1, correlation=1),
        x("cudaLaunchKernel", "cuda_runtime", 505, 5, 1, correlation=2),
        x("cudaLaunchKernel", "cuda_runtime", 1500, 5, 1, correlation=3),  # after the step
        x("k1", "kernel", 30, 100, 7, correlation=1),
        x("k2", "kernel", 515, 100, 7, correlation=2),
        x("k3", "kernel", 1510, 100, 7, correlation=3),
    ]


def test_idle_time_is_charged_to_the_launching_host_op(tmp_path):
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    (step,) = analyse(load(str(path)))
    assert step["kernels"] == 2  # k3 was launched after the step
    assert step["gpu_busy_ms"] == 0.2
    assert step["gpu_span_ms"] == 0.585
    assert step["gpu_idle_ms"] == 0.385  # k1 ends at 130, k2 starts at 515
    assert step["idle_by_inner"] == {"inner": 385}
    assert step["idle_by_outer"] == {"outer": 385}
    assert step["lead_in_ms"] == 0.03  # the step starts at 0, k1 at 30
    assert step["tail_ms"] == 0.385  # k2 ends at 615, the step at 1000


def test_kernel_families():
    from benchmarks.trace_gaps import kernel_family

    assert kernel_family("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "cuBLAS GEMMs"
    assert kernel_family("triton_poi_fused__to_copy_mul_2") == "Inductor pointwise"
    assert kernel_family("triton_red_fused_add_mean_11") == "Inductor reductions"
    assert kernel_family("_lora_gemm_compose_kernel_7") == "_lora_gemm_compose_kernel"  # ours
    assert kernel_family("_scale_reduce_kernel") == "_scale_reduce_kernel"
