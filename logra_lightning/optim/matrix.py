"""How LoGRA sees one low-rank parameter: its matrix, sketched side, rank and, under FSDP2, its rows here.

:class:`LowRankMatrix` is fixed when the optimizer is built; it holds no tensors. It knows
the state layout of its param (docs/design.md §2, §3; the sharded layouts are tabled in
:mod:`~logra_lightning.optim.sharding`) and does the per-matrix pieces of LoGRA's step
that depend on it: the first basis, sketching a gradient (and the range sketch on refresh
steps), the refresh input, and the gathers and reductions a row-sharded matrix needs. The
math is in :mod:`~logra_lightning.optim.sketch`; the state itself lives in ``LoGRA.state``.

**3-D expert weights** (transformers' fused MoE experts, ``[E, m, n]``) are one
``[E*m, n]`` matrix with a right sketch by default: one input-space basis
``Q [n, r]`` shared by the experts, moments ``[E*m, r]`` per expert row, so each
expert's update ``U_e @ Q.T`` has rank <= r of its own, and experts the router did
not pick have zero sketch rows (like Adam, they move only by momentum), as with
embeddings. A left sketch would give all experts together one rank-r update.
Under FSDP2 (sharded by experts) the number of experts must divide by the group size.

**Factored second moment** (``LowRankMatrix.factored``, LoGRA choice 8): ``V`` kept as its row
and column means ``exp_avg_sq_row`` ``[a]`` and ``exp_avg_sq_col`` ``[b]`` of the ``[a, b]``
moments (:func:`~logra_lightning.optim.sketch.factored_second_moment`). With ``"auto"`` only a
right sketch of a matrix with ``m > n`` (tied embedding, 3-D experts, whose side is forced) has
it: there the ``[m, r]`` moments are larger than the ``[r, n]`` the other side would give.

Example::

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(6, 4))
    >>> mat = LowRankMatrix.build(w, "w", rank=2, side="auto")
    >>> mat.shape, mat.side, mat.shard is None
    (torch.Size([6, 4]), 'left', True)
    >>> {k: tuple(v.shape) for k, v in mat.init_state(seed=0, device=w.device).items()}
    {'step': (), 'seed': (), 'basis': (6, 2), 'exp_avg': (2, 4), 'exp_avg_sq': (2, 4)}
    >>> emb = LowRankMatrix.build(torch.nn.Parameter(torch.zeros(10, 4)), "embed", rank=2, side="right")
    >>> {k: tuple(v.shape) for k, v in emb.init_state(seed=0, device=w.device, basis_dtype=torch.bfloat16).items()}
    {'step': (), 'seed': (), 'basis': (4, 2), 'exp_avg': (10, 2), 'exp_avg_sq_row': (10,), 'exp_avg_sq_col': (2,)}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from logra_lightning._util import local
from logra_lightning.optim import sharding as sh
from logra_lightning.optim import sketch as sk


def resolve_side(side: str, shape: torch.Size) -> str:
    """``"auto"`` -> the side with the smaller state: right (``[m, r]``) if ``m <= n`` else left (``[r, n]``)."""
    if side != "auto":
        return side
    m, n = shape
    return "right" if m <= n else "left"


def matrix_shape(p: torch.Tensor) -> torch.Size:
    """The matrix LoGRA sees: a 3-D expert weight ``[E, m, n]`` is one ``[E*m, n]`` matrix (LoGRA choice 7)."""
    return torch.Size((math.prod(p.shape[:-1]), p.shape[-1])) if p.ndim > 2 else p.shape


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as :func:`matrix_shape` (a view: in-place changes reach the parameter)."""
    return t.view(-1, t.shape[-1]) if t.ndim > 2 else t


@dataclass(frozen=True)
class LowRankMatrix:
    """One low-rank param as LoGRA sketches it.

    Attributes:
        shape: global ``[m, n]`` (also for a row-sharded DTensor; 3-D experts flattened).
        side: ``"right"`` (basis ``Q [n, r]``, moments ``[m, r]``) or ``"left"`` (``P [m, r]``, ``[r, n]``).
        rank: ``r``.
        shard: this rank's rows under FSDP2, ``None`` when the matrix is whole here.
        factored: ``V`` is kept as row and column means (LoGRA choice 8) rather than Adam's ``[a, b]``.
    """

    shape: torch.Size
    side: str
    rank: int
    shard: sh.RowShard | None
    factored: bool = False

    @classmethod
    def build(cls, p: torch.Tensor, name: str, rank: int, side: str, second_moment: str = "auto") -> LowRankMatrix:
        """Check ``p`` can be low-rank with ``rank`` and find its side, shard and second-moment layout.

        A 3-D expert weight defaults to a right sketch (per-expert moments; LoGRA choice 7).
        ``second_moment``: ``"auto"``, ``"factored"`` or ``"full"`` (LoGRA choice 8).

        Raises:
            ValueError: ``p`` is not 2-D/3-D, or ``rank`` exceeds its smaller or sketched dimension.
        """
        if p.ndim not in (2, 3):
            raise ValueError(
                f"Low-rank param {name!r} has shape {tuple(p.shape)}; only 2-D (and 3-D expert) params can be low-rank"
            )
        shape = matrix_shape(p)
        side = "right" if p.ndim > 2 and side == "auto" else resolve_side(side, shape)
        if rank > min(shape):
            raise ValueError(
                f"rank={rank} is larger than min(m, n)={min(shape)} of {name!r} with shape "
                f"{tuple(p.shape)} (allowed: 1 <= rank <= {min(shape)})"
            )
        if rank > (shape[1] if side == "right" else shape[0]):
            raise ValueError(f"rank={rank} exceeds the {side} dimension of {name!r} with shape {tuple(p.shape)}")
        shard = sh.row_shard(p, name)
        if shard is not None and p.ndim > 2:
            shard = sh.flatten_rows(shard, tuple(p.shape), name)  # experts' rows of the [E*m, n] matrix
        return cls(shape, side, rank, shard, sk.factored_second_moment_wanted(second_moment, side, *shape))

    @property
    def full_rank(self) -> bool:
        """The basis spans the sketched side: the identity, nothing to refresh."""
        return self.rank == self.shape[1 if self.side == "right" else 0]

    def sketch_shape(self) -> tuple[int, int]:
        """Shape of a whole matrix's gradient sketch: ``[m, r]`` (right) or ``[r, n]`` (left)."""
        m, n = self.shape
        return (m, self.rank) if self.side == "right" else (self.rank, n)

    def range_shape(self, oversample: int) -> tuple[int, int]:
        """Shape of a whole matrix's range sketch: ``[n, r + p]`` (right) or ``[m, r + p]`` (left)."""
        m, n = self.shape
        return (n if self.side == "right" else m, self.rank + oversample)

    def refresh_due(self, st: dict, update_proj_gap: int) -> bool:
        """Whether this step (completed steps ``st["step"]``) picks a new basis."""
        return not self.full_rank and int(st["step"]) % update_proj_gap == 0

    def accumulate(self, st: dict, grad: torch.Tensor, sketch: torch.Tensor | None, group: dict) -> torch.Tensor:
        """Add the sketch of ``grad`` to ``sketch`` (``None``: the step's first) and return it.

        On a refresh step with ``refresh="randomized"`` the range sketch is added to ``st["range"]`` too.
        """
        g = as_matrix(local(grad))  # [m_i, n]
        s = sk.project(g, self.full_basis(st["basis"]), self.side)  # [m_i, r] | [r, n], fp32
        sketch = s if sketch is None else sketch.add_(s)
        if group["refresh"] == "randomized" and self.refresh_due(st, group["update_proj_gap"]):
            omega = self.omega(int(st["seed"]), int(st["step"]), group["oversample"], g.device)
            y = sk.range_sketch(g, omega, self.side)  # [n, k] | [m, k]
            st["range"] = st["range"].add_(y) if "range" in st else y
        return sketch

    def refresh_input(self, st: dict, grad: torch.Tensor | None, refresh: str) -> torch.Tensor | None:
        """What the new basis is taken from: the whole range sketch ``Y`` (popped from ``st``), or with
        ``refresh="svd"`` the exact basis of the (gathered) gradient; ``None``: no range sketch this step."""
        if refresh == "svd":
            g = as_matrix(grad.full_tensor() if self.shard is not None else local(grad))  # the reference mode gathers G
            return sk.exact_basis(g, self.rank, self.side)
        y = st.pop("range", None)
        return None if y is None else self.full_range(y)  # [n, k] | [m, k]

    def init_state(
        self, seed: int, device, basis_dtype: torch.dtype = torch.float32, exp_avg_dtype: torch.dtype = torch.float32
    ) -> dict[str, torch.Tensor]:
        """Step 0, the seed, the first basis (seeded random orthonormal) and zero moments, for this rank.

        The basis and ``exp_avg`` are stored in ``basis_dtype`` / ``exp_avg_dtype`` (LoGRA choice 9;
        the arithmetic upcasts them), the second moment in fp32: ``exp_avg_sq`` ``[a, b]``, or when
        :attr:`factored` its row and column means ``exp_avg_sq_row`` ``[a]`` and ``exp_avg_sq_col`` ``[b]``.
        """
        m, n = self.shape
        dim = n if self.side == "right" else m
        moment_shape = (m, self.rank) if self.side == "right" else (self.rank, n)
        basis = sk.random_orthonormal(dim, self.rank, seed, device=device)  # [n, r] | [m, r]
        if self.shard is not None:
            basis = self.own_rows(basis)  # [n_j, r] | [m_i, r]
            cols = self.shard.chunk(n)
            moment_shape = (self.shard.rows, self.rank) if self.side == "right" else (self.rank, cols.stop - cols.start)
        st = {
            "step": torch.zeros((), dtype=torch.int64),
            "seed": torch.tensor(seed, dtype=torch.int64),
            "basis": basis.to(basis_dtype),  # [n, r] | [m, r]
            "exp_avg": torch.zeros(moment_shape, dtype=exp_avg_dtype, device=device),  # [m, r] | [r, n]
        }
        if not self.factored:
            st["exp_avg_sq"] = torch.zeros(moment_shape, dtype=torch.float32, device=device)
        else:  # [a] + [b]
            st["exp_avg_sq_row"] = torch.zeros(moment_shape[0], dtype=torch.float32, device=device)
            st["exp_avg_sq_col"] = torch.zeros(moment_shape[1], dtype=torch.float32, device=device)
        return st

    def own_rows(self, basis: torch.Tensor) -> torch.Tensor:
        """The rows of a full basis this rank stores (``P``: W's rows; ``Q``: a chunk of W's columns).

        A copy with its own storage: a row slice would pin all rows. The basis itself when whole.
        """
        if self.shard is None:
            return basis
        rows = slice(self.shard.start, self.shard.stop) if self.side == "left" else self.shard.chunk(self.shape[1])
        return basis[rows].clone()

    def full_basis(self, basis: torch.Tensor) -> torch.Tensor:
        """The basis as the matmuls need it: ``Q`` gathered for a sharded right sketch, else ``basis`` itself."""
        if self.shard is None or self.side == "left":
            return basis  # [n, r] | [m_i, r]
        return sh.gather_chunks(basis, self.shard, self.shape[1])  # [n, r]

    def moment_cols(self, sketch: torch.Tensor) -> torch.Tensor:
        """A sharded left sketch ``[r, n]`` cut to this rank's columns ``[r, n_j]`` (the moments' chunk)."""
        if self.shard is None or self.side == "right":
            return sketch
        return sketch[:, self.shard.chunk(self.shape[1])]

    @property
    def sums_col_sq(self) -> bool:
        """A factored right sketch of a sharded matrix: its ``[r]`` column sums of ``S*S`` join the step's
        all-reduce (:func:`~logra_lightning.optim.sharding.complete_sketches`)."""
        return self.factored and self.side == "right" and self.shard is not None

    def sq_means(self, sketch: torch.Tensor, col_sq_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Row and column means of ``S*S`` over the whole matrix, shaped like this rank's factors ``[a]``, ``[b]``.

        Args:
            sketch: this step's sketch, ``[m_i, r]`` (right) or ``[r, n]`` (left, complete on every rank).
            col_sq_sum: when :attr:`sums_col_sq`, the ``[r]`` sums of ``S*S`` over all ``m`` rows.
        """
        row_sq, col_sq = sk.sq_means(self.moment_cols(sketch))  # [a], [b] over this rank's piece
        if self.shard is not None and self.side == "left":
            row_sq = sk.sq_means(sketch)[0]  # [r]: over all n columns
        elif self.sums_col_sq:
            col_sq = col_sq_sum / self.shape[0]  # [r]: over all m rows
        return row_sq, col_sq

    def full_direction(self, u: torch.Tensor) -> torch.Tensor:
        """A sharded left direction ``[r, n_j]`` gathered from every rank to ``[r, n]``."""
        if self.shard is None or self.side == "right":
            return u
        return sh.gather_chunks(u.T, self.shard, self.shape[1]).T

    def omega(self, seed: int, step: int, oversample: int, device) -> torch.Tensor:
        """The range-sketch test matrix of refresh step ``step``; this rank's rows of it for a sharded right sketch."""
        rows, cols = sk.range_test_matrix_shape(tuple(self.shape), self.rank + oversample, self.side)
        omega = sk.gaussian(rows, cols, sk.mix_seed(seed, step, 1), device=device)
        if self.shard is not None and self.side == "right":
            omega = omega[self.shard.start : self.shard.stop]  # [m_i, k]
        return omega

    def full_range(self, y: torch.Tensor) -> torch.Tensor:
        """The whole range sketch: ``sum_i G_i.T @ Omega_i`` (right), or ``G_i @ Omega`` of all ranks (left)."""
        if self.shard is None:
            return y
        if self.side == "right":
            return sk.reduce_range_sketch(y, self.shard.group)  # [n, k]
        return sh.gather_chunks(y, self.shard, self.shape[0])  # [m, k]

    def reduce_rotation_(self, rot: torch.Tensor) -> torch.Tensor:
        """Sum ``Q_old.T @ Q_new`` over ranks when both bases are row chunks (in place)."""
        return sh.all_reduce_sum_(rot, self.shard.group) if self.shard is not None else rot
