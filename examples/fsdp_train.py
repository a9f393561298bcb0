"""Train PEFT DoRA adapters of a tiny Llama with FSDP2 on 2 processes; save from rank 0.

    torchrun --nproc-per-node 2 examples/fsdp_train.py                  # 10 AdamW steps
    torchrun --nproc-per-node 2 examples/fsdp_train.py --steps 5 --check --out out/fsdp

The model is a transformers ``LlamaForCausalLM`` built from a small config (random weights,
the same seed on every rank; nothing is downloaded). PEFT puts DoRA on all seven projections
(``LoraConfig(use_dora=True)``) and ``dora_torch.accelerate_peft`` runs those layers on
dora_torch; it comes before ``fully_shard``, which is applied to every decoder layer and then
to the root. ``dora_torch.distributed.prepare_fsdp`` then computes ‖W‖² of every frozen base
weight once from the local shards (FSDP2 shards rows; otherwise it would be recomputed on
every forward) and keeps the norm caches sound under sharding. Each rank trains on its share
of every batch of the byte-tokenised corpus in ``examples/data``; AdamW updates the adapters.

With CUDA GPUs (one per process) it runs NCCL with bf16 parameters and fp32 gradient
reduction (``MixedPrecisionPolicy``); without, gloo on the CPU in fp32 (``--bf16`` forces
bf16 there too). At the end the full state dict is gathered to rank 0
(``get_model_state_dict(full_state_dict=True, cpu_offload=True)``) and written as a PEFT
adapter (``save_pretrained(state_dict=...)``) in ``--out``/adapter. ``--check`` then loads it
on rank 0 into a fresh, unsharded base model with ``dora_torch.load_adapter`` and compares its
logits on one batch with the sharded model's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file by torchrun

import dora_torch
from dora_torch.distributed import prepare_fsdp
from examples.corpus import TRAIN_FILE, ByteTokenizer, load_text, sample_batches

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step, all ranks")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bf16", action="store_true", help="bf16 parameters on the CPU too")
    p.add_argument("--out", default="out/fsdp_train")
    p.add_argument("--check", action="store_true", help="reload the adapter and compare")
    return p.parse_args(argv)


def base_model(vocab_size: int):
    """A tiny randomly initialised Llama (fp32), the same on every rank (fixed seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def sharded_dora_model(vocab_size: int, device: torch.device, param_dtype):
    """PEFT DoRA on the base model, accelerated by dora_torch, then sharded by FSDP2."""
    import peft
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    config = peft.LoraConfig(r=8, lora_alpha=16, use_dora=True, target_modules=TARGET_MODULES)
    model = peft.get_peft_model(base_model(vocab_size), config).to(device)
    dora_torch.accelerate_peft(model)  # before fully_shard: it checks the layers' classes
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    prepare_fsdp(model, param_dtype=param_dtype)
    return model


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must divide over {world} ranks")
    param_dtype = torch.bfloat16 if cuda or args.bf16 else None

    tok = ByteTokenizer()
    tokens = tok.encode(load_text(TRAIN_FILE))
    batches = sample_batches(
        tokens, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps, seed=0
    )
    batches = torch.from_numpy(batches).chunk(world, dim=1)[rank]  # this rank's sequences
    model = sharded_dora_model(tok.vocab_size, device, param_dtype)
    report = model.dora_acceleration_report
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr)
    if rank == 0:
        print(
            f"{world} ranks on {device.type} ({dist.get_backend()}), params "
            f"{param_dtype or torch.float32}; {len(report.accelerated)} DoRA layers on "
            f"dora_torch, {len(report.skipped)} on PEFT's path"
        )
    for step, batch in enumerate(batches):
        t0 = time.perf_counter()
        batch = batch.to(device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG if cuda else dist.ReduceOp.SUM)
        loss = loss.item() if cuda else loss.item() / world  # gloo has no AVG
        if rank == 0:
            print(f"step {step:3d}  loss {loss:.4f}  {time.perf_counter() - t0:.2f} s")

    if rank == 0:
        tiers = [
            getattr(model.get_submodule(name), "last_impl", None) for name in report.accelerated
        ]
        print(f"last step: {sum(t != 'peft' for t in tiers)}/{len(tiers)} layers ran on dora_torch")

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # collective; whole tensors on rank 0
    adapter_dir = Path(args.out) / "adapter"
    if rank == 0:
        model.save_pretrained(adapter_dir, state_dict=state)
        print(f"adapter saved in {adapter_dir}")
    dist.barrier()

    status = 0
    if args.check:
        batch = batches[0].to(device)
        with torch.no_grad():
            sharded = model(input_ids=batch).logits.float().cpu()
        if rank == 0:
            fresh = base_model(tok.vocab_size)
            dora_torch.load_adapter(fresh, adapter_dir)
            with torch.no_grad():
                reloaded = fresh(input_ids=batch.cpu()).logits
                untrained = base_model(tok.vocab_size)(input_ids=batch.cpu()).logits
            diff = (reloaded - sharded).abs().max().item()
            moved = (untrained - sharded).abs().max().item()
            tol = 5e-2 if param_dtype is not None else 1e-4
            print(
                f"reloaded adapter vs sharded model: max |Δlogit| {diff:.2e} (tol {tol:g}; "
                f"the base model without the adapter: {moved:.2e})"
            )
            status = 0 if diff <= tol else 1
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
