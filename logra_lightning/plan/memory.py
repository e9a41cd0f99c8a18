"""`logra plan`: will RL on this model fit? Per-GPU memory of dense AdamW vs LoGRA under FSDP2.

This module is the memory model (the optimizer terms in :mod:`~logra_lightning.plan.optimizers`);
:mod:`logra_lightning.plan.cli` is the command that prints it:

    logra plan --model gemma-3-27b --gpus 8 --gpu-memory-gb 80 --rank 256 --batch 1 --seq-len 4096 \\
        --precision bf16-mixed --activation-checkpointing
    logra plan --model path/to/hf_model_dir --gpus 1 --json

``--model`` is a shipped shape (``qwen2.5-0.5b``, ``qwen2.5-7b``, ``gemma-3-27b``, ``llama-3-8b``,
``qwen3-8b``, ``mistral-7b``, ``phi-3-mini``, ``qwen3-30b-a3b``), a local HF directory or config
JSON of a Qwen2, Qwen3, Llama, Mistral, Gemma 3, Phi-3 or Qwen3-MoE model, or a hub ``org/name``
(see :mod:`logra_lightning.models.shapes`, which reads architecture fields only; the model is
never built). The memory model is
pure functions of the shape and a :class:`PlanSetup`. Checked against exact tensor sums (one
process and a real 2-process FSDP2 run) in ``tests/test_plan.py`` and against measured peak
memory in ``benchmarks/real_shapes_memory.py`` (a real-shape RL step) and in the archived
``plan_vs_measured`` results (three sizes; ``benchmarks/archive.py`` says where its script is).

The model, per GPU, for ``N`` GPUs (FSDP2 shards every parameter on dim 0: a rank holds
``ceil(m / N)`` rows), ``t = batch * seq_len`` tokens per micro-batch (or fewer with
``--micro-batch-tokens``), ``c`` bytes per compute
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
  moments ``[r, n/N]`` (factored: ``[r]`` + ``[n/N]``); int64 ``step`` and ``seed``. The gradient
  sketch (``[m/N, r]`` or ``[r, n]``) exists only from backward to the step and is counted with the transients. Dense
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
  log-softmax backward runs (``rl.logprobs.gather_logprobs`` over the full vocabulary), with
  ``--lm-head-chunk 0``. By default (``--lm-head-chunk k``, :mod:`logra_lightning.rl.lm_head`)
  the logits never exist whole: saved per token only the hidden state at the target ``c h`` and
  16 bytes (fp32 log-sum-exp and log-prob, int64 target); one block of ``k`` tokens is live at a
  time: ``k (c + 4 + 4) V`` in forward (logits, their fp32 copy when ``c = 2``, softmax for the
  entropy), ``k (c + 4) V`` in backward; the hidden states' gradient ``c h`` per token. With
  ``--micro-batch-tokens B`` a micro-batch holds ``min(batch, B // seq_len)`` (>= 1) whole
  sequences packed in one row.
* FSDP2 buffers (``N > 1`` or a bf16 compute cast): the root unit (embeddings, untied lm_head,
  final norm) unsharded in ``c`` for the whole step (FSDP2 does not reshard the root after
  forward; with the chunked head, only until backward has passed the head and the final norm,
  :func:`logra_lightning.rl.lm_head.forward_hidden`) plus its unsharded gradient in backward
  (tied: two more ``[V, h]`` while the two contributions are summed; one with the chunked head,
  whose gradient autograd adds to in place); two decoder layers gathered (current + prefetch);
  one unit's unsharded gradient and its fp32 reduce-scatter copy.
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
   about 20% more (``benchmarks/results/plan_vs_measured.json`` fits it on the smallest size
   and tests it on the two larger ones).
5. ``--gpu-memory-gb`` is read as GiB (an "80 GB" H100 reports 79.6 GiB).
6. Mixture-of-experts layers (``k`` of ``E`` experts per token): activations as a dense MLP of
   width ``k * moe_intermediate_size``
   (:attr:`~logra_lightning.models.shapes.Architecture.active_intermediate_size`: every token
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

import math
from dataclasses import asdict
from typing import Any

from logra_lightning.models.shapes import Architecture
from logra_lightning.plan.optimizers import OPTIMIZERS
from logra_lightning.plan.setup import GiB, PlanSetup, check_rank, shard

ENGINE_BYTES = 2  # rollout engines serve bf16 weights and a bf16 KV cache
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
    if setup.lm_head_chunk:
        k = min(setup.lm_head_chunk, t)
        upcast = 4 if c != 4 else 0  # the fp32 copy of a block's logits (none when they are fp32 already)
        head_saved = t * (c * h + 16)  # hidden states at the targets, fp32 log-sum-exp and log-prob, target ids
        phases = {
            "loss_backward": saved + head_saved + k * (c + upcast + 4) * v,  # block: logits, fp32, softmax
            "head_backward": saved + head_saved + t * c * h + k * (c + upcast) * v,  # + grad of the hidden states
            "layer_backward": t * (c * h + layer),
            "embedding_backward": 0,
            "optimizer_step": 0,
        }
        return {**phases, "peak": max(phases.values())}
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
    copies = 1 if setup.lm_head_chunk else 2  # see optimizers.tied_grad_copies
    tied = copies * arch.vocab_size * arch.hidden_size * c if arch.tie_word_embeddings else 0
    # unsharded root weights in the decoder layers' backward: none once the chunked head has resharded them
    held = 0 if setup.lm_head_chunk else root * c
    return {
        "loss_backward": root * c + 2 * layer * c,
        "head_backward": 2 * root * c + 2 * layer * c,
        "layer_backward": held + root * c + 2 * layer * c + layer * (c + extra),
        "embedding_backward": held + root * c + max(tied, root * extra),  # the tied sum is freed before the cast
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
    params = sum(shard(m.rows, n) * m.cols * m.count for m in arch.matrices())
    params = (params + sum(shard(s, n) * c for _, s, c, _ in arch.vectors())) * setup.param_bytes
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
        parts = dict(
            params=params,
            grads=grads,
            optimizer_state=terms.state,
            activations=acts[phase],
            transients=transient,
            fsdp_buffers=fsdp[phase],
        )
        parts["allocator_slack"] = round(setup.allocator_slack * sum(parts.values()))
        parts.update(engine_weights=weights, kv_cache=kv, reserve=int(setup.reserve_gb * GiB))
        phases[phase] = {**parts, "total": sum(parts.values())}
    worst = max(phases, key=lambda p: phases[p]["total"])
    peak = phases[worst]["total"]
    budget = int(setup.gpu_memory_gb * GiB)
    return {
        "peak_bytes": peak,
        "peak_phase": worst,
        "fits": peak <= budget,
        "headroom_bytes": budget - peak,
        "breakdown": phases[worst],
        "phases": phases,
        "activation_peak_bytes": {
            "checkpointed": activation_phases(arch, setup, True)["peak"],
            "not_checkpointed": activation_phases(arch, setup, False)["peak"],
        },
    }


def plan(arch: Architecture, setup: PlanSetup) -> dict[str, Any]:
    """The planner's answer as plain values (what ``--json`` prints).

    Example::

        >>> from logra_lightning.models.shapes import load_architecture
        >>> arch = load_architecture("qwen2.5-7b")
        >>> result = plan(arch, PlanSetup(gpus=8, rank=256, batch=1, seq_len=4096))
        >>> sorted(result["optimizers"]), result["optimizers"]["logra"]["fits"]
        (['adamw', 'logra'], True)
    """
    check_rank(arch, setup.rank)
    return {
        "model": {
            "name": arch.name,
            "model_type": arch.model_type,
            "params": arch.num_params(),
            **{k: v for k, v in asdict(arch).items() if k not in ("name", "model_type", "layer_windows")},
            "sliding_layers": sum(w is not None for w in arch.layer_windows),
        },
        "setup": asdict(setup),
        "optimizers": {name: plan_optimizer(arch, setup, name) for name in OPTIMIZERS},
    }
