"""Train DoRA adapters of the nnx Llama twin on a 2×2 (data × model) device mesh.

    python -m examples.jax_sharded_train                 # 20 adamw steps, ~15 s on 2 CPU cores
    python -m examples.jax_sharded_train --steps 5 --check

The model is ``dora_jax.models.llama`` with random weights (fixed seed); DoRA goes on all seven
projections (``inject``). Tensor parallelism is Megatron's (``dora_jax.sharding.LLAMA_TP_RULES``):
q/k/v/gate/up column-parallel (kernel d_out on "model"), o/down row-parallel (d_in on
"model"); the adapters follow their kernels (lora_b and magnitude with d_out, lora_a with
d_in). Batches of the byte-tokenised corpus in ``examples/data`` are split over "data".
Everything else (embeddings, norms, lm_head) is replicated. The step is one ``nnx.jit`` of
forward, backward and ``optax.adamw`` on the adapters only (``wrt=nnx.LoRAParam``); XLA's
sharding propagation inserts the collectives.

Without 4 accelerators the mesh is made of 4 host CPU devices: this file sets
``--xla_force_host_platform_device_count=4`` in XLA_FLAGS before jax is imported (it has no
effect on GPUs, and none if jax was imported first). ``--check`` trains an unsharded copy on
one device on the same batches and prints the largest differences (losses, adapters).
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

import argparse
import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dora_jax import inject
from dora_jax.models.llama import LlamaConfig, LlamaForCausalLM
from dora_jax.sharding import LLAMA_TP_RULES, annotate, named, place

try:
    from examples.corpus import TRAIN_FILE, ByteTokenizer, load_text, sample_batches
except ImportError:  # run as a file: examples/ itself is on sys.path
    from corpus import TRAIN_FILE, ByteTokenizer, load_text, sample_batches  # type: ignore

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MESH_SHAPE = (2, 2)
MESH_AXES = ("data", "model")


def model_config(vocab_size: int, layers: int = 2) -> LlamaConfig:
    """A small Llama: heads (4) and kv heads (2) divide over the model axis (2)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )


def pick_devices(n: int):
    """(n devices, default-device context): the default backend's if it has n, else n host
    CPU devices with the CPU as default device (so ``impl="auto"`` resolves for the CPU)."""
    devices = jax.devices()
    if len(devices) >= n:
        return devices[:n], contextlib.nullcontext()
    cpus = jax.devices("cpu")
    if len(cpus) < n:
        raise SystemExit(
            f"need {n} devices; found {len(devices)} {jax.default_backend()} and {len(cpus)} CPU "
            f"ones. Start with XLA_FLAGS=--xla_force_host_platform_device_count={n}"
        )
    return cpus[:n], jax.default_device(cpus[0])


def build(cfg: LlamaConfig, *, r: int, lora_alpha: float, annotate_for_mesh: bool):
    """The base model with fixed-seed weights, annotated (kernels) and DoRA-injected."""
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    if annotate_for_mesh:
        annotate(model, LLAMA_TP_RULES)  # the injected adapters inherit it from the kernels
    inject(model, target_modules=TARGET_MODULES, r=r, lora_alpha=lora_alpha, rngs=nnx.Rngs(1))
    return model


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    targets = batch[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets
    ).mean()


@nnx.jit
def train_step(model, optimizer, batch):
    diff = nnx.DiffState(0, nnx.LoRAParam)
    loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model, batch)
    optimizer.update(model, grads)
    return loss


def train(model, batches, *, lr: float, put_batch) -> list[float]:
    optimizer = nnx.Optimizer(model, optax.adamw(lr, weight_decay=0.0), wrt=nnx.LoRAParam)
    return [float(train_step(model, optimizer, put_batch(b))) for b in batches]


def adapters(model) -> dict[str, np.ndarray]:
    """The trained parameters by path: lora_a, lora_b, magnitude of every DoRA layer."""
    flat = nnx.state(model, nnx.LoRAParam).flat_state()
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in flat}


def specs(model) -> dict[str, str]:
    """Where each adapter of layer 0 lies: its PartitionSpec, one entry per dimension."""
    out = {}
    for path, v in nnx.state(model, nnx.LoRAParam).flat_state():
        if path[2] == 0:
            value = v.get_value()
            spec = tuple(value.sharding.spec)
            spec += (None,) * (value.ndim - len(spec))
            out["/".join(map(str, path[3:]))] = str(jax.sharding.PartitionSpec(*spec))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="split over the data axis")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--check", action="store_true", help="also train an unsharded copy")
    args = p.parse_args(argv)

    devices, default_device = pick_devices(MESH_SHAPE[0] * MESH_SHAPE[1])
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=(auto, auto), devices=devices)
    tok = ByteTokenizer()
    tokens = tok.encode(load_text(TRAIN_FILE))
    batches = sample_batches(
        tokens, batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps, seed=0
    ).astype(np.int32)
    cfg = model_config(tok.vocab_size, args.layers)
    kw = dict(r=args.r, lora_alpha=args.lora_alpha)
    print(f"mesh {dict(mesh.shape)} on {devices[0].platform}; {args.steps} steps")

    result = {}
    with default_device:
        model = build(cfg, **kw, annotate_for_mesh=True)
        place(model, mesh)
        batch_sharding = named(mesh, "data", None)
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            losses = train(
                model, batches, lr=args.lr, put_batch=lambda b: jax.device_put(b, batch_sharding)
            )
        seconds = time.perf_counter() - t0
        for i in sorted({0, len(losses) // 2, len(losses) - 1}):
            print(f"step {i:3d}  loss {losses[i]:.4f}")
        print(f"{seconds:.1f} s (first step includes compilation)")
        layer_specs = specs(model)
        for name, spec in layer_specs.items():
            print(f"  layers.0.{name}: {spec}")
        result.update(losses=losses, specs=layer_specs, seconds=seconds)

        if args.check:
            ref = build(cfg, **kw, annotate_for_mesh=False)
            one = devices[0]
            ref_losses = train(ref, batches, lr=args.lr, put_batch=lambda b: jax.device_put(b, one))
            mine, theirs = adapters(model), adapters(ref)
            loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
            param_diff = max(float(np.max(np.abs(mine[k] - theirs[k]))) for k in mine)
            print(f"unsharded copy: max |Δloss| {loss_diff:.2e}, max |Δadapter| {param_diff:.2e}")
            result.update(ref_losses=ref_losses, loss_diff=loss_diff, param_diff=param_diff)
    return result


if __name__ == "__main__":
    main()
