"""`logra plan`: will RL on this model fit? Per-GPU memory of dense AdamW vs LoGRA under FSDP2.

    logra plan --model gemma-3-27b --gpus 8 --gpu-memory-gb 80 --rank 256 --batch 1 --seq-len 4096 \\
        --precision bf16-mixed --activation-checkpointing
    logra plan --model path/to/hf_model_dir --gpus 1 --json

``--model`` is a shipped shape (``qwen2.5-0.5b``, ``qwen2.5-7b``, ``gemma-3-27b``, ``llama-3-8b``,
``qwen3-8b``, ``mistral-7b``, ``phi-3-mini``, ``qwen3-30b-a3b``), a local HF directory or config
JSON of a Qwen2, Qwen3, Llama, Mistral, Gemma 3, Phi-3 or Qwen3-MoE model, or a hub ``org/name``
(see :mod:`logra_lightning.model_shapes`, which reads architecture fields only; the model is
never built). This module is the memory model,
pure functions of the shape and a :class:`PlanSetup`. Checked against exact tensor sums (one
process and a real 2-process FSDP2 run) in ``tests/test_plan.py`` and against measured peak
memory in ``benchmarks/plan_vs_measured.py``.

The model, per GPU, for ``N`` GPUs (FSDP2 shards every parameter on dim 0: a rank holds
``ceil(m / N)`` rows), ``t = batch * seq_len`` tokens per micro-batch, ``c`` bytes per compute
element (4 for fp32, 2 for bf16):

* parameters: sharded, fp32 (``fp32``, ``bf16-mixed``: fp32 master weights) or bf16 (``bf16-true``).
* gradients alive after backward: AdamW every sharded gradient; LoGRA only the dense group's
  (biases, norms): low-rank gradients are sketched and freed in their post-accumulate hook.
* optimizer state: AdamW ``exp_avg``/``exp_avg_sq`` in the parameter dtype + an fp32 ``step``;
  LoGRA per low-rank ``[m, n]`` matrix, right side (``m <= n``, embeddings, and MoE
  experts ``[E, m', n]`` as one ``[E m', n]`` matrix):
  basis ``[n/N, r]`` (bf16 by default, ``logra_basis_dtype``), ``exp_avg`` ``[m/N, r]`` (bf16 by
  default, ``logra_exp_avg_dtype``), fp32 ``exp_avg_sq`` ``[m/N, r]``, or its factors ``[m/N]`` +
  ``[r]`` (``logra_second_moment``: ``"auto"`` factors it for embeddings and experts with
  ``m > n``, as ``optim/sketch.factored_second_moment_wanted``); left side: basis ``[m/N, r]``,
  moments ``[r, n/N]`` (factored: ``[r]`` + ``[n/N]``); int64 ``step`` and ``seed``. The gradient sketch (``[m/N, r]``
  or ``[r, n]``) exists only from backward to the step and is counted with the transients. Dense
  group: fp32 AdamW moments + int64 ``step`` (what ``optim/logra.py`` allocates).
* activations saved per token per decoder layer (counted tensor by tensor on HF Qwen2, Qwen3,
  Gemma 3, Phi-3 and Qwen3-MoE in ``tests/test_plan.py``): each RMSNorm before a linear ``(4 + 2c) h + 4`` (fp32
  upcast input, normalized and weighted outputs, rsqrt; Gemma ``(8 + c) h + 4``), q/k and Gemma's
  post-norms without the weighted output; attention ``c (2 q_dim + 2 kv_dim) + 4 heads`` (q, k,
  v, output, fp32 logsumexp; no ``s^2`` scores: flash attention, or SDPA without a mask; Phi-3's
  fused ``qkv_proj``: ``c (q_dim + kv_dim)`` more, v being a view that keeps the whole fused
  output alive, and ``c q_dim`` for the copy of the attention output o_proj saves); MLP
  ``4 c I`` (gate, act, up, product; MoE layers ``I = k * moe_intermediate_size`` and routing,
  see departure 6). Checkpointed: only ``c h`` per layer is saved and one layer
  is recomputed during backward. Head: ids 8, the final norm, and the logits:
  ``c V`` kept by the step + fp32 log-softmax ``4 V`` saved + two fp32 ``V`` gradients while
  log-softmax backward runs (``grpo.gather_logprobs`` over the full vocabulary).
* FSDP2 buffers (``N > 1`` or a bf16 compute cast): the root unit (embeddings, untied lm_head,
  final norm) unsharded in ``c`` for the whole step (FSDP2 does not reshard the root after
  forward) plus its unsharded gradient in backward (tied: two more ``[V, h]`` while the two
  contributions are summed); two decoder layers gathered (current + prefetch); one unit's
  unsharded gradient and its fp32 reduce-scatter copy.
* rollout engine when colocated: bf16 weights ``/ engine_tp`` and the KV cache of
  ``rollout_batch`` sequences per GPU (K and V, bf16; sliding-window layers keep ``window`` tokens).

The peak is the largest of five moments of a training step (a basis-refresh step, the worst
case for LoGRA), each on top of parameters + optimizer state + engine + a fixed reserve:

1. ``loss_backward``: all saved activations + the logits block at its largest.
2. ``head_backward``: saved activations + logits and their gradient in ``c`` + the lm_head gradient.
3. ``layer_backward``: live gradients (LoGRA: range sketches + that layer's gradients before
   their hooks; with tied embeddings the lm_head gradient waiting in autograd's buffer) + the
   held logits + one layer's activations and its backward working set ``c (3I + 2h)``.
4. ``embedding_backward``: live gradients + the embedding gradient (tied: three ``[V, h]``
   copies at once, measured) + the held logits.
5. ``optimizer_step``: live gradients + optimizer temporaries (AdamW ``foreach``, torch's
   default on GPUs: one moment-sized buffer; ``for-loop`` (CPU): two of the largest tensor;
   ``fused``: none. LoGRA: the pending low-rank directions, one per matrix).

Assumptions and departures (numbered):

1. Attention is flash-like: HF's SDPA path with an attention mask (padding, sliding windows)
   repeats the KV heads first and saves ``2c (q_dim - kv_dim)`` more per token and layer.
2. bf16-mixed means FSDP2 ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``:
   compute and residual stream in bf16. ``torch.autocast`` keeps more fp32 copies; not modelled.
3. Extra memory of the CUDA context and NCCL buffers is one constant, ``--reserve-gb`` (2 GiB by
   default); the colocated engine is resident during training (no vLLM sleep mode) and its CUDA
   graphs / sampler workspace are not modelled.
4. Everything above is *live* tensor bytes (what ``torch.cuda.max_memory_allocated`` reports).
   What the allocator holds on top (freed blocks kept cached, fragmentation) is
   ``--allocator-slack`` x the training tensors at the peak (params, grads, state, activations,
   transients, FSDP buffers), 0 by default: set it from your own
   ``memory_reserved / max_memory_allocated - 1``. On the CPU check machine glibc + MKL held
   about 20% more (``benchmarks/plan_vs_measured.py`` fits it on the smallest size and tests
   it on the two larger ones).
5. ``--gpu-memory-gb`` is read as GiB (an "80 GB" H100 reports 79.6 GiB).
6. Mixture-of-experts layers (``k`` of ``E`` experts per token): activations as a dense MLP of
   width ``k * moe_intermediate_size``
   (:attr:`~logra_lightning.model_shapes.Architecture.active_intermediate_size`: every token
   visits ``k`` experts however the router balances them) plus what transformers 5's default
   experts implementation (``grouped_mm``) saves for the routing: per token and chosen expert
   the gathered input and the expert's output (``2 c h``), its routing weight (``c``) and int64
   indices (16), per token the fp32 router probabilities ``4 E``. Its ``eager`` loop keeps the
   weighted output too (``c h`` more per chosen expert, +7% on the tiny test model);
   ``batched_mm`` gathers a weight copy per token and is not modelled. The backward working set of a
   layer is the dense one at that width. Weights, gradients and optimizer state count all ``E``
   experts; FSDP2 shards an expert weight by experts, modelled as its ``E m'`` rows (exact
   when ``N`` divides ``E``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable

from logra_lightning.errors import ConfigError
from logra_lightning.model_shapes import Architecture, Matrix, ShapeError, load_architecture, shipped_shapes

GiB = 1024**3
PRECISIONS = ("fp32", "bf16-mixed", "bf16-true")
ADAMW_IMPLS = ("foreach", "fused", "for-loop")
ENGINE_BYTES = 2  # rollout engines serve bf16 weights and a bf16 KV cache
STATE_BYTES = {"bfloat16": 2, "float32": 4}  # LoGRA's basis_dtype / exp_avg_dtype
SECOND_MOMENTS = ("auto", "factored", "full")


class PlanError(ConfigError):
    """A planner input is missing or out of range; the message names the field and the value."""


# ------------------------------------------------------------------------------------------ setup
@dataclass(frozen=True)
class PlanSetup:
    """What is trained how. ``batch`` and ``rollout_batch`` are sequences per GPU.

    Raises:
        PlanError: a field out of range (the message names it and the allowed values).
    """

    gpus: int = 1
    gpu_memory_gb: float = 80.0
    rank: int = 256
    batch: int = 1
    seq_len: int = 2048
    precision: str = "bf16-mixed"
    activation_checkpointing: bool = True
    colocate_engine: bool = False
    engine_tp: int = 1
    rollout_batch: int | None = None
    oversample: int = 8
    adamw_impl: str = "foreach"
    reserve_gb: float = 2.0
    allocator_slack: float = 0.0
    logra_second_moment: str = "auto"  # LoGRA's ``second_moment``
    logra_basis_dtype: str = "bfloat16"  # LoGRA's ``basis_dtype``
    logra_exp_avg_dtype: str = "bfloat16"  # LoGRA's ``exp_avg_dtype``

    def __post_init__(self) -> None:
        for key in ("gpus", "rank", "batch", "seq_len", "engine_tp"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{key}={value!r} must be an integer >= 1")
        if self.rollout_batch is not None and self.rollout_batch < 1:
            raise PlanError(f"rollout_batch={self.rollout_batch!r} must be >= 1 (or None: the training batch)")
        if self.oversample < 0:
            raise PlanError(f"oversample={self.oversample!r} must be >= 0")
        if not self.gpu_memory_gb > 0 or self.reserve_gb < 0:
            raise PlanError(f"gpu_memory_gb={self.gpu_memory_gb!r} must be > 0 and reserve_gb={self.reserve_gb!r} >= 0")
        if not 0 <= self.allocator_slack < 10:
            raise PlanError(f"allocator_slack={self.allocator_slack!r} must be a fraction in [0, 10) (0.1 = 10%)")
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.logra_second_moment not in SECOND_MOMENTS:
            allowed = ", ".join(SECOND_MOMENTS)
            raise PlanError(f"logra_second_moment={self.logra_second_moment!r} is not one of {allowed}")
        for key in ("logra_basis_dtype", "logra_exp_avg_dtype"):
            if getattr(self, key) not in STATE_BYTES:
                raise PlanError(f"{key}={getattr(self, key)!r} is not one of {', '.join(STATE_BYTES)}")
        if self.adamw_impl not in ADAMW_IMPLS:
            raise PlanError(f"adamw_impl={self.adamw_impl!r} is not one of {', '.join(ADAMW_IMPLS)}")
        if self.colocate_engine and self.gpus % self.engine_tp:
            raise PlanError(f"engine_tp={self.engine_tp} must divide gpus={self.gpus}")

    @property
    def param_bytes(self) -> int:
        return 2 if self.precision == "bf16-true" else 4

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def fsdp_buffers(self) -> bool:
        """FSDP2 all-gathers (N > 1) or casts (bf16-mixed) each unit into a separate buffer."""
        return self.gpus > 1 or self.compute_bytes != self.param_bytes


def check_rank(arch: Architecture, rank: int) -> None:
    """The optimizer's rule: ``rank <= min(m, n)`` of every low-rank matrix."""
    if rank > arch.hidden_size:
        raise PlanError(f"rank={rank} is larger than the model's hidden_size={arch.hidden_size}")
    smallest, m = arch.min_matrix_dim()
    if rank > smallest:
        raise PlanError(f"rank={rank} is larger than min(m, n)={smallest} of {m.name} with shape "
                        f"({m.rows}, {m.cols}) (allowed: 1 <= rank <= {smallest})")  # fmt: skip


def _shard(rows: int, n: int) -> int:
    return math.ceil(rows / n)


# --------------------------------------------------------------------------------- optimizer terms
@dataclass
class OptimizerTerms:
    """Per-GPU bytes that depend on the optimizer (see the module docstring for the phases)."""

    grads: int  # alive after backward
    state: int  # persistent optimizer state
    layer_transient: int  # during a decoder layer's backward (LoGRA: its gradients before the hook)
    root_transient: int  # during the embedding's backward, the last op of backward
    range_sketches: int  # refresh-step range sketches, alive from backward to step
    step_temporaries: int


def _lowrank_layout(m: Matrix, rank: int, k: int, n_gpus: int, second_moment: str = "auto") -> dict[str, int]:
    """Elements per rank of one LoGRA matrix, laid out as ``optim/logra.py`` and ``optim/sharding.py`` do.

    The side comes from the global shape (right if ``m <= n``; embeddings and experts always right). Under
    FSDP2 every state tensor is sharded: right: basis rows ``[n_j, r]`` (all-gathered to ``[n, r]``
    in the hook and from ``prepare_update`` to the update), moments ``[m_i, r]``; left: basis
    ``[m_i, r]``, moments ``[r, n_j]``. The gradient sketch (``[m_i, r]`` right, ``[r, n]`` left: the
    partial ``P_i.T G_i``) lives only from backward to the step, like a gradient. ``basis`` and
    ``exp_avg`` count elements of those tensors, ``second`` the fp32 second moment's: full (the
    shape of ``exp_avg``) or factored (``[m_i]`` + ``[r]`` right, ``[r]`` + ``[n_j]`` left; the
    ``[r]`` factor is whole on every rank).
    """
    rows, cols, sharded = _shard(m.rows, n_gpus), _shard(m.cols, n_gpus), n_gpus > 1
    right = m.embedding or m.expert or m.rows <= m.cols
    factored = second_moment == "factored" or (second_moment == "auto" and right and m.rows > m.cols)
    if right:
        return dict(basis=cols * rank, exp_avg=rows * rank, second=rows + rank if factored else rows * rank,
                    sketch=rows * rank, moment=rows * rank, direction=rows * rank, range=m.cols * k, omega=rows * k,
                    held_basis=m.cols * rank if sharded else 0, refresh_input=m.cols * k)  # fmt: skip
    return dict(basis=rows * rank, exp_avg=rank * cols, second=rank + cols if factored else rank * cols,
                sketch=rank * m.cols, moment=rank * cols, direction=rank * m.cols, range=rows * k, omega=m.cols * k,
                held_basis=0, refresh_input=m.rows * k)  # fmt: skip


def _tied_grad_copies(arch: Architecture, setup: PlanSetup) -> int:
    """Extra full embedding gradients during the embedding's backward with tied weights (no FSDP).

    Autograd keeps the lm_head contribution in the input buffer of the shared weight until the
    embedding's own gradient exists, then adds them out of place: three ``[V, h]`` at once
    (measured: 3.1x ``V*h*4`` bytes on CPU, with or without a post-accumulate hook).
    """
    tied = arch.tie_word_embeddings and not setup.fsdp_buffers
    return 2 * arch.vocab_size * arch.hidden_size * setup.param_bytes if tied else 0


def adamw_terms(arch: Architecture, setup: PlanSetup) -> OptimizerTerms:
    """``torch.optim.AdamW`` on every parameter: moments and gradients in the parameter dtype, fp32 ``step``."""
    n, pb = setup.gpus, setup.param_bytes
    sizes = [_shard(m.rows, n) * m.cols for m in arch.matrices() for _ in range(m.count)]
    sizes += [_shard(s, n) for _, s, c, _ in arch.vectors() for _ in range(c)]
    total = sum(sizes)
    temps = {"foreach": total * pb, "for-loop": 2 * max(sizes) * pb, "fused": 0}[setup.adamw_impl]
    return OptimizerTerms(grads=total * pb, state=2 * total * pb + 4 * len(sizes), layer_transient=0,
                          root_transient=_tied_grad_copies(arch, setup), range_sketches=0,
                          step_temporaries=temps)  # fmt: skip


def logra_terms(arch: Architecture, setup: PlanSetup) -> OptimizerTerms:
    """LoGRA with every Linear/Embedding weight low-rank (``logra_param_groups`` defaults)."""
    n, r, k, g = setup.gpus, setup.rank, setup.rank + setup.oversample, setup.param_bytes
    state = held = ranges = step_max = 0
    transient = {"root": 0, "layer": 0}
    mode = setup.logra_second_moment
    basis_b, avg_b = STATE_BYTES[setup.logra_basis_dtype], STATE_BYTES[setup.logra_exp_avg_dtype]
    for m in arch.matrices():
        lay = _lowrank_layout(m, r, k, n, mode)
        state += m.count * (basis_b * lay["basis"] + avg_b * lay["exp_avg"] + 4 * lay["second"] + 16)  # + step, seed
        # gradient sketches (like gradients: alive from backward to the step, not optimizer state)
        # and, on refresh steps, range sketches
        ranges += m.count * 4 * (lay["range"] + lay["sketch"])
        # held from prepare_update to the update: the directions and (sharded, right) the gathered bases
        held += m.count * 4 * (lay["direction"] + lay["held_basis"])
        step_max = max(step_max, 4 * (2 * lay["moment"] + 2 * lay["refresh_input"]))  # Adam temps, range SVD
        if not setup.fsdp_buffers:  # autograd hands each hook one full gradient
            grad = m.rows * m.cols * g + (_tied_grad_copies(arch, setup) if m.embedding else 0)
            transient[m.unit] = max(transient[m.unit], grad + 4 * lay["omega"])
    if setup.fsdp_buffers:  # FSDP2 reduce-scatters a whole unit, then the hooks run one by one
        for unit in transient:
            mats = [m for m in arch.matrices() if m.unit == unit]
            hook = max(4 * (_lowrank_layout(m, r, k, n)["omega"] + m.cols * r) for m in mats)  # + gathered Q
            transient[unit] = sum(_shard(m.rows, n) * m.cols for m in mats) * g + hook
    elif arch.tie_word_embeddings:  # the lm_head gradient waits in autograd's buffer for the embedding's
        transient["layer"] += arch.vocab_size * arch.hidden_size * g
    dense = [_shard(s, n) for _, s, c, _ in arch.vectors() for _ in range(c)]
    state += sum(8 * d + 8 for d in dense)
    return OptimizerTerms(grads=sum(dense) * g, state=state, layer_transient=transient["layer"],
                          root_transient=transient["root"], range_sketches=ranges,
                          step_temporaries=held + step_max + 8 * max(dense))  # fmt: skip


OPTIMIZERS: dict[str, Callable[[Architecture, PlanSetup], OptimizerTerms]] = {
    "adamw": adamw_terms,
    "logra": logra_terms,
}
PHASES = ("loss_backward", "head_backward", "layer_backward", "embedding_backward", "optimizer_step")


# ------------------------------------------------------------------------------------ activations
def _norm_bytes(arch: Architecture, c: int, width: int, rows: int, feeds_linear: bool) -> int:
    """Saved per token by one RMSNorm over ``rows`` rows of ``width`` elements in total.

    Always the fp32 upcast input and the fp32 ``rsqrt`` per row; then the normalized input the
    weight multiplies (in ``c``; Gemma: fp32); and the output only if a linear layer consumes it
    (q/k norms feed RoPE and Gemma's post-norms feed the residual add, which save nothing).
    """
    normalized = 4 * width if arch.gemma_norm else c * width
    return 4 * width + 4 * rows + normalized + (c * width if feeds_linear else 0)


def layer_activation_bytes(arch: Architecture, c: int) -> int:
    """Bytes saved for backward per token by one decoder layer (see the module docstring)."""
    h, q, kv = arch.hidden_size, arch.q_dim, arch.kv_dim
    norms = 2 * _norm_bytes(arch, c, h, 1, feeds_linear=True)
    if arch.post_norms:
        norms += 2 * _norm_bytes(arch, c, h, 1, feeds_linear=False)
    if arch.qk_norm:
        norms += _norm_bytes(arch, c, q, arch.num_heads, False) + _norm_bytes(arch, c, kv, arch.num_kv_heads, False)
    attention = c * (2 * q + 2 * kv) + 4 * arch.num_heads  # q, k, v, output; fp32 logsumexp per head
    if arch.fused_projections:  # v views the fused [q + 2 kv] output; o_proj saves a copy of the output
        attention += c * (q + kv) + c * q
    return norms + attention + 4 * c * arch.active_intermediate_size + _routing_bytes(arch, c)


def _routing_bytes(arch: Architecture, c: int) -> int:
    """Per token, a MoE layer's saved routing (departure 6): k x (gathered input, expert output, weight, indices)."""
    if not arch.num_experts:
        return 0
    return arch.num_experts_per_tok * (2 * c * arch.hidden_size + c + 16) + 4 * arch.num_experts


def saved_activation_bytes(arch: Architecture, setup: PlanSetup, checkpointing: bool) -> int:
    """Bytes saved for backward at the end of the forward pass, logits block excluded."""
    c, h = setup.compute_bytes, arch.hidden_size
    per_layer = c * h if checkpointing else layer_activation_bytes(arch, c)
    return setup.tokens * (arch.num_layers * per_layer + 8 + _norm_bytes(arch, c, h, 1, feeds_linear=True))


def activation_phases(arch: Architecture, setup: PlanSetup, checkpointing: bool) -> dict[str, int]:
    """Activation bytes per GPU at each phase of a step, and ``peak`` (their maximum)."""
    c, t, v, h = setup.compute_bytes, setup.tokens, arch.vocab_size, arch.hidden_size
    saved = saved_activation_bytes(arch, setup, checkpointing)
    layer = layer_activation_bytes(arch, c) + c * (3 * arch.active_intermediate_size + 2 * h)  # + backward working set
    phases = {
        "loss_backward": saved + t * (12 + c) * v,
        "head_backward": saved + t * 2 * c * v,
        "layer_backward": t * (c * v + c * h + layer),
        "embedding_backward": t * c * v,
        "optimizer_step": t * c * v,
    }
    return {**phases, "peak": max(phases.values())}


def fsdp_phases(arch: Architecture, setup: PlanSetup) -> dict[str, int]:
    """Unsharded FSDP2 buffers per GPU at each phase (zero on one GPU without a compute cast)."""
    if not setup.fsdp_buffers:
        return dict.fromkeys(PHASES, 0)
    c = setup.compute_bytes
    extra = 4 - c if setup.precision == "bf16-mixed" else 0  # fp32 reduce-scatter copy of a bf16 grad
    root, layer = arch.unit_params("root"), arch.unit_params("layer")
    tied = 2 * arch.vocab_size * arch.hidden_size * c if arch.tie_word_embeddings else 0
    return {
        "loss_backward": root * c + 2 * layer * c,
        "head_backward": 2 * root * c + 2 * layer * c,
        "layer_backward": 2 * root * c + 2 * layer * c + layer * (c + extra),
        "embedding_backward": 2 * root * c + max(tied, root * extra),  # the tied sum is freed before the cast
        "optimizer_step": 0,
    }


def engine_bytes(arch: Architecture, setup: PlanSetup) -> tuple[int, int]:
    """(weights, KV cache) per GPU of a colocated rollout engine; (0, 0) when not colocated."""
    if not setup.colocate_engine:
        return 0, 0
    tp = setup.engine_tp
    weights = math.ceil(arch.num_params() * ENGINE_BYTES / tp)
    seqs = (setup.rollout_batch or setup.batch) * tp  # per engine replica
    per_token = 2 * math.ceil(arch.num_kv_heads / tp) * arch.head_dim * ENGINE_BYTES  # K and V
    tokens = sum(min(setup.seq_len, w) if w else setup.seq_len for w in arch.layer_windows)
    return weights, seqs * tokens * per_token


# ------------------------------------------------------------------------------------------- plan
def plan_optimizer(arch: Architecture, setup: PlanSetup, optimizer: str) -> dict[str, Any]:
    """Per-GPU breakdown of one optimizer at each phase; ``peak`` and ``breakdown`` at the worst one."""
    terms = OPTIMIZERS[optimizer](arch, setup)
    n = setup.gpus
    params = sum(_shard(m.rows, n) * m.cols * m.count for m in arch.matrices())
    params = (params + sum(_shard(s, n) * c for _, s, c, _ in arch.vectors())) * setup.param_bytes
    acts = activation_phases(arch, setup, setup.activation_checkpointing)
    fsdp = fsdp_phases(arch, setup)
    weights, kv = engine_bytes(arch, setup)
    head_grad = 0 if setup.fsdp_buffers else arch.vocab_size * arch.hidden_size * setup.param_bytes
    dense = optimizer == "adamw"
    grads_and_transients = {
        "loss_backward": (0, 0),
        "head_backward": (head_grad, 0) if dense else (0, head_grad),
        "layer_backward": (terms.grads, terms.layer_transient + terms.range_sketches),
        "embedding_backward": (terms.grads, terms.root_transient + terms.range_sketches),
        "optimizer_step": (terms.grads, terms.step_temporaries + terms.range_sketches),
    }
    phases = {}
    for phase, (grads, transient) in grads_and_transients.items():
        parts = dict(params=params, grads=grads, optimizer_state=terms.state, activations=acts[phase],
                     transients=transient, fsdp_buffers=fsdp[phase])  # fmt: skip
        parts["allocator_slack"] = round(setup.allocator_slack * sum(parts.values()))
        parts.update(engine_weights=weights, kv_cache=kv, reserve=int(setup.reserve_gb * GiB))
        phases[phase] = {**parts, "total": sum(parts.values())}
    worst = max(phases, key=lambda p: phases[p]["total"])
    peak = phases[worst]["total"]
    budget = int(setup.gpu_memory_gb * GiB)
    return {
        "peak_bytes": peak, "peak_phase": worst, "fits": peak <= budget, "headroom_bytes": budget - peak,
        "breakdown": phases[worst], "phases": phases,
        "activation_peak_bytes": {"checkpointed": activation_phases(arch, setup, True)["peak"],
                                  "not_checkpointed": activation_phases(arch, setup, False)["peak"]},
    }  # fmt: skip


def plan(arch: Architecture, setup: PlanSetup) -> dict[str, Any]:
    """The planner's answer as plain values (what ``--json`` prints).

    Example::

        >>> arch = load_architecture("qwen2.5-7b")
        >>> result = plan(arch, PlanSetup(gpus=8, rank=256, batch=1, seq_len=4096))
        >>> sorted(result["optimizers"]), result["optimizers"]["logra"]["fits"]
        (['adamw', 'logra'], True)
    """
    check_rank(arch, setup.rank)
    return {
        "model": {"name": arch.name, "model_type": arch.model_type, "params": arch.num_params(),
                  **{k: v for k, v in asdict(arch).items() if k not in ("name", "model_type", "layer_windows")},
                  "sliding_layers": sum(w is not None for w in arch.layer_windows)},  # fmt: skip
        "setup": asdict(setup),
        "optimizers": {name: plan_optimizer(arch, setup, name) for name in OPTIMIZERS},
    }


_ROWS = [
    ("params", "parameters"), ("grads", "gradients"), ("optimizer_state", "optimizer state"),
    ("activations", "activations"), ("transients", "optimizer transients"),
    ("fsdp_buffers", "FSDP2 unsharded buffers"), ("allocator_slack", "allocator slack"),
    ("engine_weights", "engine weights"),
    ("kv_cache", "engine KV cache"), ("reserve", "reserve (context, NCCL)"),
]  # fmt: skip


def format_table(result: dict[str, Any]) -> str:
    """A readable per-GPU table (GiB) for both optimizers, at each one's peak phase."""
    s, m = result["setup"], result["model"]
    opts = result["optimizers"]
    names = {"adamw": "AdamW", "logra": f"LoGRA r={s['rank']}"}
    lines = [
        f"{m['name']}: {m['params'] / 1e9:.2f}B params ({m['model_type']}, hidden {m['hidden_size']}, "
        f"{m['num_layers']} layers, vocab {m['vocab_size']}"
        + (f", {m['num_experts']} experts, {m['num_experts_per_tok']} per token" if m["num_experts"] else "") + ")",
        f"{s['gpus']} GPU(s) x {s['gpu_memory_gb']:g} GiB, FSDP2, {s['precision']}, batch {s['batch']} x "
        f"seq {s['seq_len']} per GPU, activation checkpointing {'on' if s['activation_checkpointing'] else 'off'}"
        + (f", engine colocated (tp={s['engine_tp']})" if s["colocate_engine"] else ""),
        "",
        f"{'per GPU, GiB, at the peak':<32}" + "".join(f"{names[k]:>14}" for k in opts),
    ]
    for key, label in _ROWS:
        lines.append(f"{label:<32}" + "".join(f"{o['breakdown'][key] / GiB:>14.2f}" for o in opts.values()))
    lines.append("-" * (32 + 14 * len(opts)))
    lines.append(f"{'peak total':<32}" + "".join(f"{o['peak_bytes'] / GiB:>14.2f}" for o in opts.values()))
    lines.append(f"{'  at':<32}" + "".join(f"{o['peak_phase']:>14}" for o in opts.values()))
    verdict = [f"{'fits' if o['fits'] else 'OOM'} ({o['headroom_bytes'] / GiB:+.1f})" for o in opts.values()]
    lines.append(f"{'fits in ' + format(s['gpu_memory_gb'], 'g') + ' GiB?':<32}" + "".join(f"{v:>14}" for v in verdict))
    for mode in ("checkpointed", "not_checkpointed"):
        label = f"activation peak, {mode.replace('_', ' ')}"
        values = (o["activation_peak_bytes"][mode] / GiB for o in opts.values())
        lines.append(f"{label:<32}" + "".join(f"{v:>14.2f}" for v in values))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="logra plan", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help=f"shipped shape ({', '.join(shipped_shapes())}), HF dir, "
                    "config JSON, or hub org/name")  # fmt: skip
    ap.add_argument("--gpus", type=int, default=1, help="GPUs; FSDP2 shards over all of them")
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU, GiB")
    ap.add_argument("--rank", type=int, default=None, help="LoGRA rank (default 256, or the smallest matrix dim)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per GPU per micro-batch")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (prompt + completion)")
    ap.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    ap.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--colocate-engine", action="store_true", help="rollout engine on the training GPUs")
    ap.add_argument("--engine-tp", type=int, default=1, help="tensor parallel size of the colocated engine")
    ap.add_argument("--rollout-batch", type=int, default=None, help="sequences per GPU in the engine (default --batch)")
    ap.add_argument("--adamw-impl", default="foreach", choices=ADAMW_IMPLS, help="AdamW step temporaries")
    ap.add_argument("--reserve-gb", type=float, default=2.0, help="CUDA context and NCCL buffers, GiB")
    ap.add_argument("--allocator-slack", type=float, default=0.0,
                    help="fraction the allocator holds on top of the live training tensors (cached free blocks, "
                         "fragmentation); 0 = live bytes, as max_memory_allocated")  # fmt: skip
    ap.add_argument("--logra-second-moment", default="auto", choices=SECOND_MOMENTS,
                    help="LoGRA's second_moment (auto: factored for embeddings and experts)")
    ap.add_argument("--logra-basis-dtype", default="bfloat16", choices=tuple(STATE_BYTES), help="LoGRA's basis_dtype")
    ap.add_argument("--logra-exp-avg-dtype", default="bfloat16", choices=tuple(STATE_BYTES),
                    help="LoGRA's exp_avg_dtype")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    """``logra plan``: print the table (or JSON); invalid inputs exit 2 with a message naming the field."""
    args = build_parser().parse_args(argv)
    try:
        arch = load_architecture(args.model)
        rank = args.rank if args.rank is not None else min(256, arch.min_matrix_dim()[0])
        setup = PlanSetup(
            gpus=args.gpus, gpu_memory_gb=args.gpu_memory_gb, rank=rank, batch=args.batch, seq_len=args.seq_len,
            precision=args.precision, activation_checkpointing=args.activation_checkpointing,
            colocate_engine=args.colocate_engine, engine_tp=args.engine_tp, rollout_batch=args.rollout_batch,
            adamw_impl=args.adamw_impl, reserve_gb=args.reserve_gb, allocator_slack=args.allocator_slack,
            logra_second_moment=args.logra_second_moment, logra_basis_dtype=args.logra_basis_dtype,
            logra_exp_avg_dtype=args.logra_exp_avg_dtype,
        )  # fmt: skip
        result = plan(arch, setup)
    except (PlanError, ShapeError) as e:
        print(f"logra plan: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    main()
