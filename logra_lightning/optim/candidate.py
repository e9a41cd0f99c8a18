"""LoGRA's candidate update Δ between ``prepare_update`` and the step, and the factors it applied.

:class:`PendingUpdate` holds one param's Δ (docs/design.md §2, §4): for a low-rank param the
Adam direction ``U`` and the basis it expands with, ``Δ = -lr * scale * U @ Q.T`` (right) or
``-lr * scale * P @ U`` (left); for a dense param the AdamW direction, computed from the
moments when needed. Decoupled weight decay makes the step at scale ``a``
``W(a) = c(a) * W0 + a * Δ`` with ``c(a) = 1 - a * lr * wd``; :func:`move_` moves W between
two such points in place, which is how the KL probe's ``perturb_`` and the scaled step work.
What a step applied is emitted as :class:`~logra_lightning.sync.wire.LowRankUpdate`
(``W <- c * W + L @ R``) for low-rank weight sync.

Example::

    >>> import torch
    >>> w = torch.zeros(3, 4)
    >>> pend = PendingUpdate(lr=0.1, weight_decay=0.0, direction=torch.ones(3, 1), basis=torch.ones(4, 1), side="right")
    >>> move_(w, pend, 0.0, 0.5); round(float(w[0, 0]), 6)  # W(0.5) = 0.5 * Δ
    -0.05
    >>> u = applied_update(pend, "w", eta=0.5); bool(torch.allclose(u.left @ u.right, w))
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from logra_lightning.optim import rounding
from logra_lightning.optim import sharding as sh
from logra_lightning.optim import sketch as sk
from logra_lightning.optim.matrix import LowRankMatrix, as_matrix
from logra_lightning.optim.state_io import dense_placeholder
from logra_lightning.sync.wire import LowRankUpdate


@dataclass
class PendingUpdate:
    """One param's candidate update Δ at scale 1, held from ``prepare_update`` until it is applied.

    Attributes:
        lr, weight_decay: the group's values when Δ was prepared.
        direction: low-rank Adam direction ``U``: ``[m, r]`` (right) or ``[r, n]`` (left); ``None`` for a dense param.
        basis: the basis ``U`` expands with, whole: ``Q [n, r]`` or ``P [m_i, r]`` (this rank's rows), in its
            stored dtype (``basis_dtype``: bf16 by default), upcast to ``U``'s fp32 where it is used.
        side: ``"right"`` or ``"left"`` (low-rank only).
        scale: the group's low-rank ``scale``.
        next_basis: a refreshed basis, taken (with the moments rotated) after the update is applied.
        dense: a dense param's AdamW direction (same shape as its local shard), computed on call.
    """

    lr: float
    weight_decay: float
    direction: torch.Tensor | None = None
    basis: torch.Tensor | None = None
    side: str = "right"
    scale: float = 1.0
    next_basis: torch.Tensor | None = None
    dense: Callable[[], torch.Tensor] | None = None

    @property
    def lowrank(self) -> bool:
        return self.direction is not None


def advance_lowrank_moments_(
    st: dict, mat: LowRankMatrix, sketch: torch.Tensor, group: dict, col_sq_sum: torch.Tensor | None = None
) -> None:
    """Add one step to a low-rank param's count and its Adam moments, from this step's gradient sketch.

    Args:
        st: the param's state (``step``, ``exp_avg`` and ``exp_avg_sq`` or its factors
            ``exp_avg_sq_row``/``exp_avg_sq_col``), updated in place; fp32 arithmetic, stored in each
            tensor's dtype (docs/design.md §2).
        sketch: ``[m_i, r]`` (right) or ``[r, n]`` (left, summed over ranks) gradient sketch.
        group: the param group (``betas``).
        col_sq_sum: a sharded factored right sketch's ``[r]`` sums of ``S*S`` over all rows
            (:meth:`~logra_lightning.optim.matrix.LowRankMatrix.sq_means`).
    """
    st["step"] += 1
    beta1, beta2 = group["betas"]
    s = mat.moment_cols(sketch)  # [m_i, r] | [r, n_j]
    if not mat.factored:
        sk.adam_moments_(st["exp_avg"], st["exp_avg_sq"], s, beta1, beta2)
        return
    row_sq, col_sq = mat.sq_means(sketch, col_sq_sum)  # [a], [b]
    sk.factored_moments_(st["exp_avg"], st["exp_avg_sq_row"], st["exp_avg_sq_col"], s, row_sq, col_sq, beta1, beta2)


def lowrank_candidate(st: dict, mat: LowRankMatrix, group: dict, next_basis: torch.Tensor | None) -> PendingUpdate:
    """A low-rank param's Δ from its (advanced) moments; ``next_basis`` is taken after the update, if given."""
    beta1, beta2 = group["betas"]
    step, eps = int(st["step"]), group["eps"]
    if mat.factored:
        u = sk.factored_direction(
            st["exp_avg"], st["exp_avg_sq_row"], st["exp_avg_sq_col"], mat.side, step, beta1, beta2, eps
        )
    else:
        u = sk.adam_direction(st["exp_avg"], st["exp_avg_sq"], step, beta1, beta2, eps)  # fp32 [m_i, r] | [r, n_j]
    return PendingUpdate(
        group["lr"],
        group["weight_decay"],
        direction=mat.full_direction(u),
        basis=mat.full_basis(st["basis"]),
        side=mat.side,
        scale=group["scale"],
        next_basis=next_basis,
    )


def take_next_basis_(st: dict, mat: LowRankMatrix, next_basis: torch.Tensor) -> None:
    """After the update: turn the moments into ``next_basis`` (LoGRA choices 3 and 8) and store it as the basis."""
    rot = mat.reduce_rotation_(sk.basis_rotation(st["basis"], next_basis))  # [r, r], fp32
    if mat.factored:
        st["exp_avg"], st["exp_avg_sq_row"], st["exp_avg_sq_col"] = sk.rotate_factored(
            st["exp_avg"], st["exp_avg_sq_row"], st["exp_avg_sq_col"], rot, mat.side
        )
    else:
        st["exp_avg"], st["exp_avg_sq"] = sk.rotate_moments(st["exp_avg"], st["exp_avg_sq"], rot, mat.side)
    st["basis"] = next_basis  # a new tensor object: weight sync sees a new basis version


def dense_candidate(st: dict, grad: torch.Tensor, group: dict) -> PendingUpdate:
    """Advance a dense param's AdamW moments by ``grad`` (its local shard); Δ's direction is computed when used."""
    if not st:  # its first step: zero moments shaped like the local shard (under FSDP2)
        st.update(dense_placeholder(grad))
    st["step"] += 1
    beta1, beta2 = group["betas"]
    sk.adam_moments_(st["exp_avg"], st["exp_avg_sq"], grad.float(), beta1, beta2)
    direction = partial(sk.adam_direction, st["exp_avg"], st["exp_avg_sq"], int(st["step"]), beta1, beta2, group["eps"])
    return PendingUpdate(group["lr"], group["weight_decay"], dense=direction)


def update_delta(pend: PendingUpdate, w: torch.Tensor) -> torch.Tensor:
    """Δ at scale 1 including weight decay, fp32, for the local weight ``w`` (a new tensor)."""
    lr, wd = pend.lr, pend.weight_decay
    if pend.lowrank:
        w = as_matrix(w)
        delta = sk.lowrank_delta(pend.direction, pend.basis, pend.side).mul_(-lr * pend.scale)  # [m, n]
    else:
        delta = pend.dense().mul_(-lr)
    if wd:
        delta.add_(w.float(), alpha=-lr * wd)
    return delta


@torch.no_grad()
def move_(
    w: torch.Tensor,
    pend: PendingUpdate,
    start: float,
    end: float,
    add_low_precision: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> None:
    """Take the local weight ``w`` from scale ``start`` to scale ``end`` of ``pend``, in place.

    ``W(a) = c(a) * W0 + a * Δ_add`` with ``c(a) = 1 - a * lr * wd``, so ``move_(w, p, a, b)``
    followed by ``move_(w, p, b, a)`` restores ``w`` up to rounding. Bf16/fp16 weights get the
    fp32 change through ``add_low_precision(w, delta)`` (LoGRA's ``bf16_update`` rule; default:
    round to nearest); for a low-rank Δ, ``delta`` is a function of a row range that expands
    those rows only (:func:`~logra_lightning.optim.rounding.add_by_rule`).
    """
    lr, wd = pend.lr, pend.weight_decay
    k = (1 - end * lr * wd) / (1 - start * lr * wd) if wd else 1.0
    coef = end - start * k
    if k != 1.0:
        w.mul_(k)
    if coef == 0.0:
        return
    low = w.dtype not in (torch.float32, torch.float64)
    add = add_low_precision or (lambda w_, d: rounding.add_by_rule("nearest", w_, d, {}, 0))
    if not pend.lowrank:
        if low:
            add(w, pend.dense().mul_(-lr * coef))
        else:
            w.add_(pend.dense().to(w.dtype), alpha=-lr * coef)
        return
    w = as_matrix(w)  # [m, n]
    u, basis, alpha = pend.direction, pend.basis, -lr * pend.scale * coef
    basis = basis.to(u.dtype)  # a bf16-stored basis: an fp32 copy of [n, r] | [m, r]
    if w.dtype != u.dtype:  # fp32 rows of Δ, expanded block by block and rounded once into w
        if pend.side == "right":
            rows = lambda lo, hi: (u[lo:hi] @ basis.T).mul_(alpha)  # noqa: E731  [c, r] @ [r, n]
        else:
            rows = lambda lo, hi: (basis[lo:hi] @ u).mul_(alpha)  # noqa: E731  [c, r] @ [r, n]
        add(w, rounding.DeltaRows(rows, w.shape))
        return
    if pend.side == "right":
        w.addmm_(u, basis.T, alpha=alpha)  # [m, r] @ [r, n]
    else:
        w.addmm_(basis, u, alpha=alpha)  # [m, r] @ [r, n]


def applied_update(pend: PendingUpdate, name: str, eta: float, version: str | None = None) -> LowRankUpdate:
    """What the step at scale ``eta`` did to a low-rank param: ``W <- c * W + L @ R`` (``L`` this rank's rows).

    ``version`` identifies the basis the update used (the factor on ``pend.side``), so an engine that
    keeps that basis needs only the coefficient (docs/design.md §5). Both factors are fp32: a
    bf16-stored basis is sent upcast (exactly its stored values).
    """
    left, right = sk.lowrank_factors(pend.direction, pend.basis, pend.side, -eta * pend.lr * pend.scale)
    c = 1.0 - eta * pend.lr * pend.weight_decay
    return LowRankUpdate(name, c, left.detach(), right.detach(), pend.side if version else None, version)


def gather_update_rows(updates: list[LowRankUpdate], matrices: dict[str, LowRankMatrix | None]) -> list[LowRankUpdate]:
    """The same updates with full left factors ``[m, r]`` from every rank's rows ``[m_i, r]``.

    A collective when a matrix is row-sharded: every rank calls it with the same matrices in the
    same order. ``matrices`` maps every param name of the optimizer to its
    :class:`~logra_lightning.optim.matrix.LowRankMatrix` (``None`` for dense params); updates of
    matrices that are whole here are returned as they are.

    Raises:
        KeyError: an update names no param in ``matrices``.
        ValueError: a left factor does not hold this rank's rows of its matrix.
    """
    out = []
    for u in updates:
        if u.name not in matrices:
            raise KeyError(f"update of {u.name!r}: no such parameter in the optimizer's param_names")
        mat = matrices[u.name]
        if mat is None or mat.shard is None:
            out.append(u)
            continue
        if u.left.shape[0] != mat.shard.rows:
            raise ValueError(
                f"update of {u.name!r}: left factor has {u.left.shape[0]} rows, but this rank holds rows "
                f"[{mat.shard.start}, {mat.shard.stop}) of {tuple(mat.shape)}"
            )
        left = sh.gather_chunks(u.left.contiguous(), mat.shard, mat.shape[0])  # [m, r] from every rank's [m_i, r]
        out.append(replace(u, left=left))  # keeps the basis version
    return out


class AppliedUpdates:
    """The weight-sync methods of :class:`~logra_lightning.optim.LoGRA` (one of its bases).

    With ``record_updates`` set, each step keeps what it did to every low-rank param (:meth:`_record`)
    for :meth:`pop_applied_updates`. Holds ``_applied`` and ``_basis_versions``; reads the
    optimizer's ``named_params()``, ``lowrank_matrix(p)``, ``state`` and ``param_groups``.
    """

    def _record(self, p: torch.Tensor, pend: PendingUpdate, name: str, eta: float) -> LowRankUpdate:
        """The update a step at scale ``eta`` applied to ``p``, with the version of the basis it used.

        The version keys on the stored basis tensor (``state[p]["basis"]``), replaced only by a
        refresh or a load, so an engine that keeps that basis is sent the coefficient only.
        """
        return applied_update(pend, name, eta, self._basis_versions.of(id(p), self.state[p]["basis"]))

    def pop_applied_updates(self) -> list[list[LowRankUpdate]]:
        """Factored updates of the steps since the last pop (one list per step; needs ``record_updates``).

        Under FSDP2 a left factor holds this rank's rows only: see :meth:`gather_updates`.
        """
        out, self._applied = self._applied, []
        return out

    def gather_updates(self, updates: list[LowRankUpdate]) -> list[LowRankUpdate]:
        """One step's updates with full left factors ``[m, r]``, all-gathered from every rank's rows.

        A collective under FSDP2 (every rank calls it with its own list from
        :meth:`pop_applied_updates`); the updates as they are on one process.

        Raises:
            KeyError: an update names no param of this optimizer.
            ValueError: a left factor does not hold this rank's rows of its matrix.
        """
        matrices = {n: self.lowrank_matrix(p) for n, p in self.named_params()}
        return gather_update_rows(updates, matrices)

    def dense_param_names(self) -> list[str]:
        """Names of params in dense (AdamW) groups: sync these as values."""
        return [n for g in self.param_groups if g.get("rank") is None for n in g["param_names"]]
