"""Which parameters get low-rank sketches, and how param groups are built.

Two entry points share one eligibility rule:

* :func:`logra_param_groups` (module-aware): the weights of ``nn.Linear`` and
  ``nn.Embedding`` modules, the 3-D weights of fused-expert modules (transformers'
  MoE ``experts.gate_up_proj`` ``[E, 2I, H]`` / ``experts.down_proj`` ``[E, H, I]``),
  plus any param whose name matches ``include``, minus names matching ``exclude``.
  A MoE router (``mlp.gate``, ``[E, H]``, not an ``nn.Linear`` in transformers 5) stays
  dense in both (:data:`ROUTER_PATTERNS`): it is small and its logits decide the routing.
* :func:`split_named_params` (names + shapes only, what ``LoGRA(named_params, rank=8)``
  uses): every 2-D param and 3-D expert weight, plus ``include``, minus ``exclude``.

On an HF causal LM the two select the same set (all 2-D params there are
Linear or Embedding weights).

Embeddings and ``lm_head`` are low-rank by default: they are the largest
matrices of a small LLM, and dense AdamW keeps 12 bytes per weight for them (fp32
grad + two moments): ~295 MB for the ``[32000, 768]`` tied embedding of the ~100M
Qwen2 shape, where its rank-64 right sketch keeps ~12.5 MB (the fp32 sketch
``[32000, 64]``, a bf16 first moment, a factored second moment; the ``logra`` and
``logra_dense_embed`` rows of ``benchmarks/optimizer_memory.py`` measure the whole
difference). Input embeddings are forced to a *right* sketch (``S = G @ Q``, ``Q``
is ``[hidden, r]``): rows of tokens absent from the batch have zero sketch rows, so, as with Adam, the step only moves
rows with gradient or momentum; a left sketch would mix rows across the
vocabulary. Pass ``exclude=("embed_tokens", "lm_head")`` for dense ones. Expert weights get a right
sketch too (:class:`~logra_lightning.optim.LoGRA`, choice 7): per-expert moments, one
shared input-space basis.

Example::

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> groups = logra_param_groups(model, rank=4, update_proj_gap=10)
    >>> [(g.get("rank"), g["param_names"]) for g in groups]
    [(4, ['0.weight']), (None, ['0.bias', '1.weight', '1.bias'])]
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

#: Names treated as input embeddings (forced right sketch), matched with ``re.search``.
EMBEDDING_PATTERNS: tuple[str, ...] = (r"embed_tokens\.", r"(^|\.)wte\.", r"word_embeddings\.", r"embed_in\.")


def matches(name: str, patterns: str | Sequence[str] | None) -> bool:
    """True when any regex of ``patterns`` (one string or several) is found in ``name`` (``re.search``)."""
    if isinstance(patterns, str):
        patterns = [patterns]
    return bool(patterns) and any(re.search(p, name) for p in patterns)


def is_embedding_name(name: str) -> bool:
    """True if ``name`` looks like an input-embedding weight (see :data:`EMBEDDING_PATTERNS`)."""
    return matches(name, EMBEDDING_PATTERNS)


#: Names of 3-D fused-expert weights, matched with ``re.search``.
EXPERT_PATTERNS: tuple[str, ...] = (r"experts\.(gate_up_proj|down_proj|gate_proj|up_proj)$",)


#: MoE routers (``[E, H]``), kept dense by both entry points, matched with ``re.search``.
ROUTER_PATTERNS: tuple[str, ...] = (r"mlp\.gate\.weight$", r"block_sparse_moe\.gate\.weight$")


def is_expert_weight(name: str, param: torch.Tensor) -> bool:
    """True for a 3-D fused-expert weight ``[E, m, n]`` (see :data:`EXPERT_PATTERNS`)."""
    return param.ndim == 3 and matches(name, EXPERT_PATTERNS)


def is_eligible(name: str, param: torch.Tensor, include=None, exclude=None) -> bool:
    """The name+shape rule: 2-D or a 3-D expert weight, (no ``include`` or matches it), not matching ``exclude``."""
    if not (param.ndim == 2 or is_expert_weight(name, param)) or matches(name, exclude):
        return False
    if matches(name, ROUTER_PATTERNS) and not matches(name, include):
        return False
    return include is None or matches(name, include)


def _build_groups(lowrank, dense, rank, lowrank_kwargs, emb_ids=frozenset()) -> list[dict[str, Any]]:
    groups = []
    is_emb = [is_embedding_name(n) or id(p) in emb_ids or p.ndim == 3 for n, p in lowrank]  # right sketch
    emb = [np for np, e in zip(lowrank, is_emb) if e]
    rest = [np for np, e in zip(lowrank, is_emb) if not e]
    for members, extra in ((rest, {}), (emb, {"side": "right"})):
        if members:
            groups.append(
                {
                    "params": [p for _, p in members],
                    "param_names": [n for n, _ in members],
                    "rank": rank,
                    **lowrank_kwargs,
                    **extra,
                }
            )
    if dense:
        groups.append({"params": [p for _, p in dense], "param_names": [n for n, _ in dense]})
    return groups


def split_by_rank(groups: list[dict[str, Any]], rank: int, *, include=None, exclude=None) -> list[dict[str, Any]]:
    """Each group split by :func:`split_named_params`, keeping the group's other keys."""
    split = []
    for g in groups:
        extra = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        for sub in split_named_params(zip(g["param_names"], g["params"]), rank, include=include, exclude=exclude):
            split.append({**extra, **sub})
    return split


def split_named_params(
    named: Iterable[tuple[str, torch.Tensor]], rank: int, *, include=None, exclude=None, **lowrank_kwargs
) -> list[dict[str, Any]]:
    """Split ``(name, param)`` pairs into low-rank group(s) and one dense group by name+shape."""
    lowrank, dense = [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        (lowrank if is_eligible(name, p, include, exclude) else dense).append((name, p))
    return _build_groups(lowrank, dense, rank, lowrank_kwargs)


def logra_param_groups(
    model: nn.Module,
    rank: int = 16,
    update_proj_gap: int = 100,
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    **lowrank_kwargs: Any,
) -> list[dict[str, Any]]:
    """Param groups for :class:`~logra_lightning.optim.LoGRA`.

    Args:
        model: any module; tied params are listed once (first name wins).
        rank: sketch rank ``r`` of every low-rank matrix.
        update_proj_gap: steps between basis refreshes.
        include: extra regexes (``re.search`` on HF names) of 2-D params to make low-rank.
        exclude: regexes of params to keep dense, applied last.
        **lowrank_kwargs: other per-group keys (``scale``, ``side``, ``refresh``, ``oversample``).

    Returns:
        Up to three groups: low-rank matrices, low-rank input embeddings and expert
        weights (``side="right"``), and one dense group (no ``rank`` key: dense AdamW). Every group has ``param_names``.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))
        >>> [(g["param_names"], g.get("side")) for g in logra_param_groups(model, rank=4)]
        [(['1.weight'], None), (['0.weight'], 'right'), (['1.bias'], None)]
    """
    by_type, emb_ids = set(), set()
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and getattr(module, "weight", None) is not None:
            by_type.add(id(module.weight))
            if isinstance(module, nn.Embedding):
                emb_ids.add(id(module.weight))
    lowrank, dense = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        eligible = (p.ndim == 2 and (id(p) in by_type or matches(name, include))) or is_expert_weight(name, p)
        chosen = eligible and not matches(name, exclude)
        (lowrank if chosen else dense).append((name, p))
    return _build_groups(lowrank, dense, rank, {"update_proj_gap": update_proj_gap, **lowrank_kwargs}, emb_ids)


def rank_limit(
    shapes: Iterable[tuple[str, Sequence[int]]], *, include=None, exclude=None
) -> tuple[str, tuple[int, ...], int] | None:
    """The largest rank LoGRA accepts for these params: the smallest side of any matrix it makes low-rank.

    ``shapes`` are ``(name, shape)`` pairs (e.g. from
    :func:`~logra_lightning.models.loading.parameter_shapes`); the name+shape rule is
    :func:`is_eligible`'s, and a 3-D expert weight counts as its ``[E*m, n]`` matrix (what
    ``LowRankMatrix.build`` checks when the optimizer is built).

    Returns:
        ``(name, shape, limit)`` of the matrix that bounds the rank, or ``None`` when no param is low-rank.

    Example::

        >>> rank_limit([("a.weight", (64, 16)), ("b.weight", (8, 64)), ("norm", (64,))])
        ('b.weight', (8, 64), 8)
        >>> rank_limit([("b.weight", (8, 64))], exclude=["b"]) is None
        True
    """
    best = None
    for name, shape in shapes:
        if not is_eligible(name, torch.empty(tuple(shape), device="meta"), include, exclude):
            continue
        limit = min(math.prod(shape[:-1]), shape[-1])
        if best is None or limit < best[2]:
            best = (name, tuple(shape), limit)
    return best


def normalize_params(params: Any) -> list[dict[str, Any]]:
    """Turn any accepted ``params`` form into groups that all carry ``param_names``.

    Accepts param groups (dicts), an iterable of tensors, or of ``(name, tensor)`` pairs.
    Unnamed params are called ``param{i}`` (i = position in the optimizer).
    """
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors, (name, tensor) pairs or dicts, got a Tensor")
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(items[0], dict):
        items = [{"params": items}]
    groups, counter = [], 0
    for g in items:
        g = dict(g)
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        names = list(g.get("param_names", []))
        if ps and isinstance(ps[0], tuple):
            names, ps = [n for n, _ in ps], [p for _, p in ps]
        if len(names) != len(ps):
            names = [f"param{counter + i}" for i in range(len(ps))]
        counter += len(ps)
        g["params"], g["param_names"] = ps, names
        groups.append(g)
    return groups


SIDES = ("auto", "left", "right")
REFRESH = ("randomized", "svd")


def validate_hparams(lr, betas, eps, weight_decay, update_proj_gap, scale, side, refresh, oversample, rank) -> None:
    """Check LoGRA's hyperparameters (of the constructor or one group); the message names the bad value."""
    if not lr >= 0:
        raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
    if not eps >= 0:
        raise ValueError(f"Invalid epsilon value: {eps} (must be >= 0)")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Invalid betas: {betas} (each must be in [0, 1))")
    if not weight_decay >= 0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
    if not (isinstance(update_proj_gap, int) and update_proj_gap >= 1):
        raise ValueError(f"Invalid update_proj_gap: {update_proj_gap} (must be an int >= 1)")
    if not scale > 0:
        raise ValueError(f"Invalid scale: {scale} (must be > 0)")
    if side not in SIDES:
        raise ValueError(f"Invalid side: {side!r} (allowed: {', '.join(map(repr, SIDES))})")
    if refresh not in REFRESH:
        raise ValueError(f"Invalid refresh: {refresh!r} (allowed: {', '.join(map(repr, REFRESH))})")
    if not (isinstance(oversample, int) and oversample >= 0):
        raise ValueError(f"Invalid oversample: {oversample} (must be an int >= 0)")
    if rank is not None and not (isinstance(rank, int) and rank >= 1):
        raise ValueError(f"Invalid rank: {rank} (must be an int >= 1, or None for dense AdamW)")


SECOND_MOMENTS = ("auto", "factored", "full")
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def storage_dtype(value: str | torch.dtype, key: str = "basis_dtype") -> torch.dtype:
    """A storage dtype option (``basis_dtype``, ``exp_avg_dtype``) as a torch dtype: its name or the dtype.

    Raises:
        ValueError: not one of :data:`STORAGE_DTYPES` (the message names ``key``).
    """
    dtype = STORAGE_DTYPES.get(value, value) if isinstance(value, str) else value
    if dtype not in STORAGE_DTYPES.values():
        raise ValueError(f"Invalid {key}: {value!r} (allowed: {', '.join(map(repr, STORAGE_DTYPES))})")
    return dtype


def validate_storage(second_moment: str, basis_dtype, exp_avg_dtype) -> None:
    """Check LoGRA's state-storage options (choices 8 and 9); the message names the bad value."""
    if second_moment not in SECOND_MOMENTS:
        raise ValueError(f"Invalid second_moment: {second_moment!r} (allowed: {', '.join(map(repr, SECOND_MOMENTS))})")
    storage_dtype(basis_dtype, "basis_dtype")
    storage_dtype(exp_avg_dtype, "exp_avg_dtype")


def validate_group(group: dict, *, sketch_in_backward: bool) -> None:
    """Check one LoGRA param group (its hyperparameters, storage, and refresh rule); the message names the bad value."""
    keys = ("lr", "betas", "eps", "weight_decay", "update_proj_gap", "scale", "side", "refresh", "oversample")
    validate_hparams(*(group[k] for k in keys), group.get("rank"))
    validate_storage(group["second_moment"], group["basis_dtype"], group["exp_avg_dtype"])
    if group.get("rank") is not None and group["refresh"] == "svd" and sketch_in_backward:
        raise ValueError(
            "refresh='svd' needs the full gradient: set sketch_in_backward=False, or use refresh='randomized'"
        )
