"""Every tunable of the PyTorch backend in one place: eps, dispatch thresholds, Triton blocks.

Block sizes are (BLOCK_*, num_warps, num_stages) per kernel, fixed (no autotuning: see
``lora_gemm_config``). Under the Triton interpreter (``TRITON_INTERPRET=1``, CPU CI) blocks
shrink (``interp_small``): each program is Python-slow there and big tiles cost RAM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: Norm clamp: g = m / max(n, EPS). Must equal ``shared_spec.compose.EPS`` (a test checks).
EPS = 1e-12

#: impl="auto" picks the eager tier when the output has fewer elements than this: for tiny
#: layers kernel launches dominate and the plain torch path is as fast.
FUSED_MIN_ELEMENTS = 1 << 16

#: Columns of d_in per step when the norm upcasts W to fp32 (CPU / eager path): bounds the
#: transient fp32 copy of W to d_out × NORM_CHUNK × 4 bytes.
NORM_CHUNK = 2048

#: Elements of U = W Aᵀ (fp32) formed at a time when the detached norm is computed: rows
#: of W are taken in blocks of max(1, NORM_U_ELEMENTS // r), so the norm's transient stays
#: bounded (24 MiB) for wide layers at large r, while small r needs a single block (each
#: extra block costs launches on host-bound steps, and in a compiled graph a second split of
#: G, B·G GEMM and row kernel plus a ``cat``): one block up to 16384 rows at r = 384, which
#: covers a Llama-8B MLP (14336).
NORM_U_ELEMENTS = 16384 * 384


def norm_row_chunk(r: int) -> int:
    """Rows of W per block of the detached norm for rank r (see ``NORM_U_ELEMENTS``)."""
    return max(1, NORM_U_ELEMENTS // max(r, 1))


#: Forward composition: True = fused into the epilogue of the Triton ``h @ Bᵀ`` GEMM (the
#: adapter product ``lora`` never touches memory); False = cuBLAS ``h @ Bᵀ`` then the
#: one-pass elementwise compose kernel. The layer benchmark measures both.
COMPOSE_IN_GEMM_EPILOGUE = True


#: Launch Triton kernels through ``kernels.launch.Launcher``'s cache of compiled kernels
#: (a fraction of ``JITFunction.run``'s host time); False = always ``kernel[grid](...)``.
FAST_TRITON_LAUNCH = True

#: Layers with stacked weights (``dora_torch.stacking``) also form base and h as one GEMM
#: x Fᵀ (True), or keep the forward's two GEMMs and contiguous outputs (False, default: the
#: backward's one dx GEMM either way). On the model's step the forward half cost time (its
#: outputs are column views the next ops read strided): runs 148 and 150, NOTES session 33.
STACK_FORWARD = False

#: Recompute the norms of a model's DoRA layers (``accelerate_peft``, ``inject``) with one
#: CUDA-graph replay per parameter update (``norm_group``); False = layer by layer.
NORM_GROUP_GRAPHS = True
#: Streams the norm group's captured graph spreads its members over (member i on stream
#: i mod this), so that one member's small GEMMs (G = A Aᵀ: 9 output tiles at r = 384; U at
#: k/v's widths: 24) run beside another's instead of after it; 1 = one stream. Read when a
#: group is made (``accelerate_peft``, ``inject``, ``norm_group.group_norms``).
NORM_GROUP_STREAMS = 1

#: Where a compiled training graph takes each layer's norm from: "graph" computes it inside
#: the graph from A and B as they are at the call; "buffer" reads the module's norm buffer,
#: which is then kept in training mode too and refreshed eagerly after every optimizer step
#: (one norm-group replay for the model, on ``NORM_GROUP_STREAMS`` streams), as compiled eval
#: graphs read it. With "buffer", rule 5's limit of docs/design.md §8 reaches training graphs:
#: an in-place write to A or B outside an optimizer step (``lora_B.mul_(2)`` under no_grad)
#: is seen at the next step of an optimizer holding it, eager call or ``clear_caches``
#: (initializing adapters in place after ``inject``: call ``clear_caches``). Read when a layer is
#: built or accelerated (``dora_torch.Linear``, ``inject``, ``accelerate_peft``).
COMPILED_TRAIN_NORM = "graph"

#: Where compiled graphs run the fused tier's products and composition as torch ops (the
#: eager tier's code: x Wᵀ, (x Aᵀ) Bᵀ, g ⊙ (base + s·lora) + bias), so that Inductor fuses
#: the composition with the pointwise ops around the layer (SiLU·up, RoPE, residual adds) as
#: it does for a LoRA layer, instead of calling our Triton compose kernel: "inference"
#: (graphs that need no gradient), "forward" (training graphs' forwards too, before our
#: backward kernels), "auto" ("inference", and "forward" for layers of rank
#: ≥ ``COMPILED_TORCH_FORWARD_MIN_RANK``), "always" (the eager tier's backward too) or
#: "never". The norm keeps its tier. Read when a graph is traced.
COMPILED_TORCH_COMPOSE = "auto"
#: The rank from which "auto" gives training graphs the torch forward. On the compiled
#: model step (one H100, runs 185, 192-197, 200, 204) it saved GPU time at r = 384, cost it
#: at r = 16, 256 and 320, and tied at r = 128; ranks between 320 and 384 are unmeasured.
COMPILED_TORCH_FORWARD_MIN_RANK = 384

#: Compiled training graphs read ‖W‖² from the module's ``dora_base_sq`` buffer (kept by
#: ``dora_torch.cache``, refreshed eagerly) instead of recomputing it from W in every step,
#: which reads W once more where the one-pass norm does not run (r > ``NORM_PASS_MAX_RANK``).
#: False = reduce W in every compiled step. The buffer's limit: docs/design.md §8, rule 5.
COMPILED_BASE_SQ_BUFFER = True

#: Triton picks interpreter or compiler when a kernel is decorated (at import), so the
#: environment is read once, here; set TRITON_INTERPRET=1 before importing dora_torch.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return _INTERPRETING


# ---- forward: h @ Bᵀ GEMM with the DoRA epilogue (kernels/compose.py) -------------------------
@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int
    #: Contraction block over r; the launch caps it at r's next power of two and raises it to
    #: 16 (tl.dot's minimum).
    block_k: int = 64


#: Candidates for the epilogue GEMM (K = r: at small ranks the kernel is bound by the base
#: read and the y write; at r = 384 its FLOPs weigh as much). ``benchmarks/bench_torch_layer.py``
#: and ``benchmarks/bench_kernel_tiles.py`` time them on the benchmark shapes;
#: ``lora_gemm_config`` encodes the winners. No ``triton.autotune``: its per-call key building
#: cost ~15 µs of host time per launch on the H200 host, which small, launch-bound layers
#: cannot afford.
LORA_GEMM_CANDIDATES = (
    GemmConfig(128, 128, 8, 8, 3),
    GemmConfig(128, 256, 8, 8, 3),
    GemmConfig(64, 256, 8, 8, 3),
    GemmConfig(128, 128, 8, 4, 4),
    GemmConfig(64, 128, 8, 4, 4),
    GemmConfig(128, 128, 8, 4, 3),
)
#: The tile for small ranks, few tiles, a stored inner and dropout.
LORA_GEMM_NARROW = LORA_GEMM_CANDIDATES[4]
#: The tile for large ranks: 128², 4 warps, 3 stages.
LORA_GEMM_SQUARE = LORA_GEMM_CANDIDATES[5]
_INTERPRETER_GEMM = GemmConfig(16, 32, 4, 1, 1)


#: Tile count (of LORA_GEMM_SQUARE) from which the large-rank tile fills the H200's 132 SMs
#: twice over.
LORA_GEMM_SQUARE_MIN_TILES = 264
#: Rank from which the large-rank tile may win: at r = 16 the narrow one is faster (run 159,
#: the square tile with its early base load 1.03-1.18× at r = 16, 0.86-0.94× at r = 384 with
#: enough tiles; r = 128 and 256 were not swept).
LORA_GEMM_SQUARE_MIN_RANK = 256


def lora_gemm_config(
    M: int, N: int, r: int, *, store_inner: bool = False, dropout: bool = False
) -> GemmConfig:
    """The epilogue GEMM's tiles for y [M, N] = compose(h [M, r] · Bᵀ), from the H200 sweeps.

    Run 159 (``results/kernel_tiles_run159.csv``, device time of graph replays): at r = 384
    a square tile (128², 4 warps) that loaded its base tile before the K loop took 0.86-0.94×
    the time of the tile chosen before at the bench model's widths with ≥ 264 tiles (T = 2048
    and 8192, d_out = 4096 and 14336, and 8192 × 1024), against the wide tile's 0.87-1.00×;
    with fewer tiles (2048 × 1024: 128) it lost (1.05×) and the narrow tile stays. Run 160
    (``kernel_tiles_run160.csv``): the same tile without that early load
    (``LORA_GEMM_SQUARE``) took 0.969-0.992× its time at those five shapes, at 248 registers
    instead of 255 (``kernel_resources``); the early load was removed.
    At r = 16 the narrow tile (64×128, 4 warps, 4 stages) is within 4% of every candidate and
    3-95% faster than the square ones. When the epilogue stores inner (a layer with a bias
    or dropout, in training) or applies dropout, the narrow tile serves: the wide tile
    spilled there and lost by 1.6-4.5% (inner stored) and 1.6-1.7× (dropout, run 52); those
    forms were not swept with the square tile.
    """
    if interpreting():
        return _INTERPRETER_GEMM
    if store_inner or dropout or r < LORA_GEMM_SQUARE_MIN_RANK:
        return LORA_GEMM_NARROW
    square = LORA_GEMM_SQUARE
    tiles = -(-M // square.block_m) * -(-N // square.block_n)
    return square if tiles >= LORA_GEMM_SQUARE_MIN_TILES else LORA_GEMM_NARROW


# ---- forward: elementwise compose (kernels/compose.py) ----------------------------------------
COMPOSE_BLOCK_M = 32
COMPOSE_BLOCK_N = 128
COMPOSE_WARPS = 4


# ---- backward: scale by g + reduce dm, dbias over tokens (kernels/backward.py) ----------------
@dataclass(frozen=True)
class ReduceConfig:
    block_m: int  # tokens per inner step
    block_n: int  # columns per program
    num_warps: int
    rows_per_program: int  # tokens each program reduces; partials are [cdiv(T, this), d_out]
    #: When > 0, fewer tokens per program (down to block_m) until the grid has at least this
    #: many programs: a narrow layer (d_out = 1024: 8 column blocks) otherwise leaves most of
    #: the GPU's SMs idle at batch 1 (132 on an H100 / H200).
    min_programs: int = 0


#: The default first; ``benchmarks/bench_torch_layer.py`` times each at 4096 × 8192
#: (``torch_layer_reduce_configs.csv``). Run 6: the default reached 68% of copy bandwidth.
BWD_CANDIDATES = (
    ReduceConfig(32, 128, 4, 256),
    ReduceConfig(16, 256, 4, 256),
    ReduceConfig(32, 256, 8, 256),
    ReduceConfig(64, 128, 8, 512),
    ReduceConfig(32, 128, 4, 128),
    ReduceConfig(16, 128, 2, 256),
    ReduceConfig(32, 128, 4, 512),
    ReduceConfig(64, 128, 8, 256),
    ReduceConfig(32, 256, 8, 512),
    ReduceConfig(64, 256, 8, 512),
    ReduceConfig(32, 128, 4, 256, min_programs=264),
    ReduceConfig(32, 128, 4, 256, min_programs=528),
    ReduceConfig(32, 128, 4, 256, min_programs=1056),
    ReduceConfig(16, 128, 4, 256, min_programs=528),
    ReduceConfig(32, 256, 8, 256, min_programs=528),
    ReduceConfig(32, 128, 8, 256),
    ReduceConfig(16, 128, 4, 256),
)
BWD = BWD_CANDIDATES[0]
#: Tiles of the zero-magnitude recompute in recover mode: [BWD_SUB_M tokens, BWD_SUB_N columns]
#: (smaller than the pass's, whose kernel it shares: at the pass's tile it set the kernel's
#: registers, 248 against 125), contracted over d_in and r in steps of BWD_BLOCK_D, BWD_BLOCK_R.
BWD_SUB_M = 16
BWD_SUB_N = 32
BWD_BLOCK_D = 32
BWD_BLOCK_R = 32

# ---- norm assembly from U = W Aᵀ and G = A Aᵀ (kernels/norm.py) -------------------------------
#: (BLOCK_M, BLOCK_R, warps) of the fused assembly kernel for ranks below ``NORM_WIDE_RANK``,
#: and from it up. Run 17, 8192 rows, µs for (32, 32, 4) / (64, 64, 4): r = 16: 6.5 / 21.9;
#: r = 64: 53.5 / 9.7; r = 128: 29.2 / 19.0; r = 384: 175.0 / 103.0
#: (``benchmarks/results/assembly_configs_run17.csv``).
NORM_KERNEL_BLOCKS = (32, 32, 4)
NORM_KERNEL_BLOCKS_WIDE = (64, 64, 4)
NORM_WIDE_RANK = 64
#: tl.dot precision for B·G in the norm assembly: "tf32x3" splits each fp32 operand into two
#: TF32 parts (three tensor-core products), ~fp32 accuracy; "ieee" is exact fp32 FMA (slow).
NORM_DOT_PRECISION = "tf32x3"
#: How the fused tier assembles the norm (kernels/norm.py): "kernel" (B·G in registers, the
#: fused kernel above), "gemm" (one cuBLAS GEMM for B·G, then a row-reduction kernel), "pairs"
#: (the gemm's bf16 products formed in registers: a 16-bit W only) or
#: "auto": from ``NORM_GEMM_MIN_RANK`` up, "pairs" for a 16-bit W with ``NORM_GEMM_BF16X3`` and
#: "gemm" for an fp32 W with IEEE fp32 matmuls (``torch.backends.cuda.matmul.allow_tf32``
#: off), "kernel" otherwise. Run 17 (8192 rows, µs, IEEE gemm / best kernel blocks): r = 128:
#: 24.4 / 19.0; r = 256: 47.7 / 52.1; r = 384: 88.6 / 103.0. At r = 384, batch 1, the step
#: drops from 65.5 to 59.0 ms (benchmarks/NOTES.md).
NORM_ASSEMBLY = "auto"
#: For a layer whose W is 16-bit, the gemm assembly forms B·G from bf16 tensor-core products
#: (each fp32 operand split into two bf16 terms; kernels/norm.py gives the error bound,
#: 3·2⁻¹⁶ against the output's 2⁻⁸ or 2⁻¹¹) instead of an fp32 GEMM on the CUDA cores: at
#: r = 384, 27.5 against 77.3 µs per 8192 rows (run 38); False = the fp32 GEMM.
NORM_GEMM_BF16X3 = True
#: Elements per program of the kernel that splits B or G into bf16 pairs.
SPLIT_BF16_BLOCK = 1024
#: Up to this rank the fused tier computes the whole norm in one pass over W
#: (``kernels/norm_pass.py``: U, G and, when not cached, ‖W‖² never reach memory), where the
#: kernel assembly is chosen; (BLOCK_M, BLOCK_D, warps, stages) of that kernel
#: (``benchmarks/bench_norm_pass.py`` sweeps them). On because the training step was faster
#: with it in every mode measured (eager, compile, reduce-overhead: benchmarks/NOTES.md,
#: session 8).
NORM_PASS_MAX_RANK = 32
NORM_PASS_BLOCKS = (64, 128, 4, 4)
NORM_GEMM_MIN_RANK = 256
NORM_ROWS_BLOCK_M = 16
NORM_ROWS_BLOCK_R = 128
NORM_ROWS_WARPS = 4
#: (BLOCK_M, BLOCK_R, warps, stages) of the "pairs" assembly's kernel, which forms only G's
#: blocks on and above the diagonal: the fastest of ``bench_kernel_tiles``' candidates over
#: the bench model's widths (benchmarks/NOTES.md, session 45).
NORM_PAIRS = (64, 64, 4, 2)


def interp_small(block: int, small: int = 16) -> int:
    """Shrink a block under the interpreter (each program is Python-slow, big tiles cost RAM)."""
    return min(block, small) if interpreting() else block


# ---- FSDP2 (distributed.prepare_fsdp, fsdp_norms.py) ------------------------------------------
#: Compute every prepared layer's norm at each root forward from the local shards (two
#: collectives for the whole model) instead of from each layer's all-gathered W inside its
#: forward. Read by ``prepare_fsdp`` (call it again after changing this). Off until it is
#: measured on GPUs (``benchmarks/fsdp_torch.py``'s ``ours_local_norms``); tested on CPU.
FSDP_LOCAL_NORMS = False


# ---- ScaLoRA (scalora.py) --------------------------------------------------------------------
#: Elements of the fp32 product B·diag(c)·A that a merge into a 16-bit base forms at a time (W
#: is updated in blocks of ``SCALORA_MERGE_ELEMS // d_in`` rows, one layer after another).
SCALORA_MERGE_ELEMS = 1 << 24
