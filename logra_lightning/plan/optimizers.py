"""Per-GPU bytes that depend on the optimizer: dense AdamW and LoGRA (see :mod:`logra_lightning.plan.memory`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from logra_lightning.models.shapes import Architecture, Matrix
from logra_lightning.plan.setup import STATE_BYTES, PlanSetup, shard


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
    rows, cols, sharded = shard(m.rows, n_gpus), shard(m.cols, n_gpus), n_gpus > 1
    right = m.embedding or m.expert or m.rows <= m.cols
    factored = second_moment == "factored" or (second_moment == "auto" and right and m.rows > m.cols)
    if right:
        return dict(
            basis=cols * rank,
            exp_avg=rows * rank,
            second=rows + rank if factored else rows * rank,
            sketch=rows * rank,
            moment=rows * rank,
            direction=rows * rank,
            range=m.cols * k,
            omega=rows * k,
            held_basis=m.cols * rank if sharded else 0,
            refresh_input=m.cols * k,
        )
    return dict(
        basis=rows * rank,
        exp_avg=rank * cols,
        second=rank + cols if factored else rank * cols,
        sketch=rank * m.cols,
        moment=rank * cols,
        direction=rank * m.cols,
        range=rows * k,
        omega=m.cols * k,
        held_basis=0,
        refresh_input=m.rows * k,
    )


def _tied_grad_copies(arch: Architecture, setup: PlanSetup) -> int:
    """Extra full embedding gradients during the embedding's backward with tied weights (no FSDP).

    Autograd keeps the lm_head contribution in the input buffer of the shared weight until the
    embedding's own gradient exists, then adds them. With whole logits that contribution is the
    transposed product of the head's matmul and the sum is out of place: three ``[V, h]`` at once
    (measured: 3.1x ``V*h*4`` bytes on CPU, with or without a post-accumulate hook). The chunked
    head returns a contiguous gradient that the embedding's is added to in place: two (measured:
    2.0x, ``lm_head_chunk > 0``).
    """
    tied = arch.tie_word_embeddings and not setup.fsdp_buffers
    copies = 1 if setup.lm_head_chunk else 2
    return copies * arch.vocab_size * arch.hidden_size * setup.param_bytes if tied else 0


def adamw_terms(arch: Architecture, setup: PlanSetup) -> OptimizerTerms:
    """``torch.optim.AdamW`` on every parameter: moments and gradients in the parameter dtype, fp32 ``step``."""
    n, pb = setup.gpus, setup.param_bytes
    sizes = [shard(m.rows, n) * m.cols for m in arch.matrices() for _ in range(m.count)]
    sizes += [shard(s, n) for _, s, c, _ in arch.vectors() for _ in range(c)]
    total = sum(sizes)
    temps = {"foreach": total * pb, "for-loop": 2 * max(sizes) * pb, "fused": 0}[setup.adamw_impl]
    return OptimizerTerms(
        grads=total * pb,
        state=2 * total * pb + 4 * len(sizes),
        layer_transient=0,
        root_transient=_tied_grad_copies(arch, setup),
        range_sketches=0,
        step_temporaries=temps,
    )


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
            transient[unit] = sum(shard(m.rows, n) * m.cols for m in mats) * g + hook
    elif arch.tie_word_embeddings:  # the lm_head gradient waits in autograd's buffer for the embedding's
        transient["layer"] += arch.vocab_size * arch.hidden_size * g
    dense = [shard(s, n) for _, s, c, _ in arch.vectors() for _ in range(c)]
    state += sum(8 * d + 8 for d in dense)
    return OptimizerTerms(
        grads=sum(dense) * g,
        state=state,
        layer_transient=transient["layer"],
        root_transient=transient["root"],
        range_sketches=ranges,
        step_temporaries=held + step_max + 8 * max(dense),
    )


OPTIMIZERS: dict[str, Callable[[Architecture, PlanSetup], OptimizerTerms]] = {
    "adamw": adamw_terms,
    "logra": logra_terms,
}
