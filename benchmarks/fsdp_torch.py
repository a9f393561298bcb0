"""FSDP2 training step on N GPUs (issue 13, item 5): ours vs PEFT LoRA and PEFT DoRA.

Launched by torchrun, one process per GPU (not part of ``make gpu``, which is one process):

    torchrun --nproc-per-node 2 -m benchmarks.fsdp_torch --ranks 16 384
    torchrun --nproc-per-node 1 -m benchmarks.fsdp_torch --ranks 16 384 --batch 4  # 1 GPU
    torchrun --nproc-per-node 2 -m benchmarks.fsdp_torch --tiny            # CPU smoke (gloo)
    torchrun --nproc-per-node 2 -m benchmarks.fsdp_torch --ranks 16 --profile ours peft_lora

Model: ``bench_model_torch``'s 8-layer Llama-8B-shaped model (every rank builds the bf16 base on
its own GPU from the same seed), PEFT LoRA / DoRA
on all seven projections (``lora_alpha = 2r``), bf16 adapters (``autocast_adapter_dtype=False``)
or PEFT's fp32 default (``--adapters fp32``); ours = ``accelerate_peft`` on the PEFT DoRA
model, then ``prepare_fsdp``. FSDP2: ``fully_shard`` on every decoder layer and on the root,
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. Batch ``--batch`` × 2048 per
GPU. A step is ``zero_grad → forward → backward → AdamW.step()`` (lr 1e-4); reported per
provider: the median step time over 10 steps after 3 warm-up steps (max over ranks), tokens
per second over all ranks, the peak memory per GPU (max over ranks) of one step over what was
allocated before it, and the mean loss over the global batch at the first and the last step
(``loss_first``, ``loss_last``). The global batch is drawn from one seed and split over the
ranks, so a 1-GPU run with ``--batch 4`` sees the data of a 2-GPU run with ``--batch 2``: their
losses, and ours against PEFT DoRA's in one run, must agree to bf16 noise. Rank 0 writes
``fsdp_torch_world{N}.csv`` (one row per provider and rank r). NCCL's NVLink multicast stays
off (the lent machines require it): ``NCCL_NVLS_ENABLE=0`` and friends are set if unset.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import time

for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_var, "0" if _var == "NCCL_NVLS_ENABLE" else "1")

#: ``ours_local_norms``: ours with ``config.FSDP_LOCAL_NORMS`` on (every layer's norm from the
#: local shards at each root forward, ``dora_torch/fsdp_norms.py``) instead of each layer's
#: norm from its all-gathered W inside its forward.
PROVIDERS = ("peft_lora", "peft_dora", "ours", "ours_local_norms")
FIELDS = ["date", "commit", "gpu", "world", "provider", "adapters", "rank", "batch_per_gpu",
          "seq", "step_ms", "tokens_per_s", "peak_gib_per_gpu", "loss_first", "loss_last",
          "error"]  # fmt: skip
GIB = 2.0**30


def _base(tiny: bool, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks import bench_model_torch as bm

    if tiny:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).to(device).requires_grad_(False)
    return bm.build_base(8)  # bf16 on the current CUDA device, same seed on every rank


def _sharded(base, provider: str, rank: int, adapters: str, param_dtype):
    import peft
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dora_torch
    from benchmarks import bench_model_torch as bm
    from dora_torch.distributed import prepare_fsdp

    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, use_dora=provider != "peft_lora",
                             lora_dropout=0.0, target_modules=list(bm.TARGET_MODULES))  # fmt: skip
    model = peft.get_peft_model(base, config, autocast_adapter_dtype=adapters == "fp32")
    ours = provider.startswith("ours")
    if ours:
        dora_torch.accelerate_peft(model)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if ours:
        from dora_torch import config as dora_config

        default = dora_config.FSDP_LOCAL_NORMS
        dora_config.FSDP_LOCAL_NORMS = provider == "ours_local_norms"  # read by prepare_fsdp
        try:
            prepare_fsdp(model, param_dtype=param_dtype)
        finally:
            dora_config.FSDP_LOCAL_NORMS = default
    return model


def _profile(step, sync, path: pathlib.Path) -> None:
    """torch.profiler tables of 3 steps (every rank steps; rank 0 writes ``path``)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        sync()
    if dist.get_rank() == 0:
        ka = prof.key_averages()
        sort = "self_cuda_time_total" if len(activities) > 1 else "self_cpu_time_total"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            f.write(ka.table(sort_by=sort, row_limit=30) + "\n")
            f.write(ka.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")


def measure(
    provider, rank, adapters, *, batch, seq, tiny, device, steps=10, profile_dir=None
) -> dict:
    import torch
    import torch.distributed as dist

    param_dtype = torch.bfloat16 if device.type == "cuda" else None
    model = _sharded(_base(tiny, device), provider, rank, adapters, param_dtype)
    vocab = model.base_model.model.config.vocab_size
    world, me = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (world * batch, seq), generator=g)[me * batch : (me + 1) * batch]
    ids = ids.to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach().float())

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()

    for _ in range(3):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - before) / GIB if device.type == "cuda" else 0.0
    stats = torch.tensor([statistics.median(times), peak], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    ends = torch.stack([losses[0], losses[-1]]).double() / world
    dist.all_reduce(ends)  # equal local batches: the mean of the local means
    if profile_dir is not None:  # last: the profiler slows a process, and steps on
        name = f"profile_fsdp_{provider}_r{rank}_world{world}.txt"
        _profile(step, sync, pathlib.Path(profile_dir) / name)
    ms = float(stats[0])
    return {"world": world, "provider": provider, "adapters": adapters, "rank": rank,
            "batch_per_gpu": batch, "seq": seq, "step_ms": round(ms, 2),
            "tokens_per_s": round(world * batch * seq / (ms / 1e3)),
            "peak_gib_per_gpu": round(float(stats[1]), 3), "loss_first": round(float(ends[0]), 5),
            "loss_last": round(float(ends[1]), 5), "error": ""}  # fmt: skip


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    from benchmarks import bench_model_torch as bm
    from benchmarks.measure import free_cuda, write_csv

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 384])
    ap.add_argument("--adapters", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--batch", type=int, default=2, help="sequences per GPU")
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--tiny", action="store_true", help="a small model (CPU smoke run)")
    ap.add_argument("--profile", nargs="*", default=[], choices=PROVIDERS,
                    help="providers to profile after timing (rank 0's tables)")  # fmt: skip
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/bench")
    args = ap.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    seq = 32 if args.tiny else bm.SEQ
    rows = []
    try:
        meta = bm._meta() if cuda else {"date": "", "commit": bm.code_version(), "gpu": "cpu"}
        for rank in args.ranks:
            for provider in args.providers:
                try:
                    prof = args.out if provider in args.profile else None
                    row = measure(provider, rank, args.adapters, batch=args.batch, seq=seq,
                                  tiny=args.tiny, device=device, profile_dir=prof)  # fmt: skip
                except Exception as e:  # one provider failing must not end the others
                    error = f"{type(e).__name__}: {e}"
                    row = {"world": dist.get_world_size(), "provider": provider, "rank": rank,
                           "adapters": args.adapters, "error": error}  # fmt: skip
                rows.append({**meta, **row})
                if dist.get_rank() == 0:
                    print(f"[fsdp_torch] {rows[-1]}", flush=True)
                if cuda:
                    free_cuda()
        if dist.get_rank() == 0:
            path = pathlib.Path(args.out) / f"fsdp_torch_world{dist.get_world_size()}.csv"
            write_csv(path, rows, FIELDS)
            print(f"[fsdp_torch] wrote {path}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
