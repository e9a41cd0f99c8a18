"""Pure math of low-rank gradient sketches (docs/design.md §2).

Every function here is stateless: the optimizer (``logra.py``) and the slow
reference (``reference.py``) hold the state and call these. Shapes follow the
torch ``nn.Linear`` layout, ``W`` and ``G`` are ``[m, n]`` (out x in).

Conventions:

* ``side="right"``: basis ``Q`` is ``[n, r]``, sketch ``S = G @ Q`` is ``[m, r]``,
  update ``dW = U @ Q.T``.
* ``side="left"``: basis ``P`` is ``[m, r]``, sketch ``S = P.T @ G`` is ``[r, n]``,
  update ``dW = P @ U``.

Randomness is always drawn from a ``torch.Generator`` seeded from plain integers
(``seed``, ``step``), so every data-parallel rank draws the same test matrix and
nothing but integers has to be stored to reproduce it.

Example::

    >>> import torch
    >>> G = torch.randn(6, 4)
    >>> Q = random_orthonormal(4, 2, seed=0)
    >>> S = project(G, Q, "right")          # [6, 2]
    >>> torch.allclose(Q.T @ Q, torch.eye(2), atol=1e-6)
    True
"""

from __future__ import annotations

import torch

from logra_lightning._util import mix_seed  # noqa: F401 - optim/ draws every seed through it
from logra_lightning.optim.sharding import all_reduce_sum_


def gaussian(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """A ``[rows, cols]`` standard normal matrix drawn from ``seed`` (CPU generator, then moved)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(rows, cols, generator=gen, dtype=dtype).to(device)


def random_orthonormal(dim: int, rank: int, seed: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """A ``[dim, rank]`` matrix with orthonormal columns, or the identity's first columns if ``rank == dim``.

    The full-rank case is the exact identity so that a full-rank LoGRA step is
    elementwise Adam (Adam is not rotation invariant; any other full basis would differ).
    """
    if rank == dim:
        return torch.eye(dim, dtype=dtype, device=device)
    q, r = torch.linalg.qr(gaussian(dim, rank, seed, dtype=torch.float32, device=device))  # [dim, rank]
    q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))  # unique QR
    return q.to(dtype)


def project(grad: torch.Tensor, basis: torch.Tensor, side: str) -> torch.Tensor:
    """Sketch of a gradient in a basis: ``G @ Q`` ([m, r]) or ``P.T @ G`` ([r, n]), in fp32.

    A basis stored in bf16 (``basis_dtype``) is upcast first: its values are the rounded
    ones, the arithmetic stays fp32.
    """
    basis = basis.float()
    g = grad.to(basis.dtype)
    return g @ basis if side == "right" else basis.T @ g


def range_test_matrix_shape(shape: tuple[int, int], k: int, side: str) -> tuple[int, int]:
    """Shape of the Gaussian test matrix Omega for a range sketch of an ``[m, n]`` gradient."""
    m, n = shape
    return (m, k) if side == "right" else (n, k)


def range_sketch(grad: torch.Tensor, omega: torch.Tensor, side: str) -> torch.Tensor:
    """Randomized range sketch ``Y``: ``G.T @ Omega`` ([n, k], right) or ``G @ Omega`` ([m, k], left).

    ``Y`` spans (approximately) the dominant right (resp. left) singular subspace of ``G``.
    It is linear in ``G``, so micro-batches add and, under FSDP2 with row shards,
    ``sum_i G_i.T @ Omega_i`` is one all-reduce (see :func:`reduce_range_sketch`).
    """
    g = grad.to(omega.dtype)
    return g.T @ omega if side == "right" else g @ omega


def reduce_range_sketch(y: torch.Tensor, group=None) -> torch.Tensor:
    """Sum a right range sketch over the ranks that shard the matrix's rows (in place).

    Under FSDP2 rank ``i`` holds rows ``G_i`` and the rows ``Omega_i`` of the shared
    test matrix, so its ``G_i.T @ Omega_i`` is a partial sum of ``G.T @ Omega``; one
    all-reduce over ``group`` (the shard group) completes it. ``group=None`` means the
    matrix is whole on this rank (one process, or DDP, whose gradients arrive already
    averaged) and this is the identity, whether or not ``torch.distributed`` is initialized.
    """
    return all_reduce_sum_(y, group)


def basis_from_range(y: torch.Tensor, rank: int) -> torch.Tensor:
    """Orthonormal ``[d, rank]`` basis of the top-``rank`` left singular subspace of ``y`` ([d, k]).

    ``QR`` alone would keep an arbitrary rank-r slice of the oversampled range;
    an SVD of the small ``[d, k]`` sketch ranks its directions by energy, so the
    oversampling columns are the ones dropped. Signs are fixed (largest entry of
    each column positive) so the result is deterministic.
    """
    u, _, _ = torch.linalg.svd(y.float(), full_matrices=False)  # [d, k]
    return _fix_signs(u[:, :rank]).contiguous()


def exact_basis(grad: torch.Tensor, rank: int, side: str) -> torch.Tensor:
    """Top-``rank`` singular vectors of the full gradient (GaLore's projector): ``[n, r]`` or ``[m, r]``."""
    u, _, vh = torch.linalg.svd(grad.float(), full_matrices=False)
    basis = vh[:rank].T if side == "right" else u[:, :rank]
    return _fix_signs(basis).contiguous()


def _fix_signs(basis: torch.Tensor) -> torch.Tensor:
    idx = basis.abs().argmax(dim=0)  # [r]
    signs = torch.sign(basis[idx, torch.arange(basis.shape[1])])
    return basis * torch.where(signs == 0, torch.ones_like(signs), signs)


def basis_rotation(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``R = old.T @ new`` ([r, r], fp32): coordinates of the new basis vectors in the old basis."""
    return old.float().T @ new.float()


def rotate_moments(
    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, rot: torch.Tensor, side: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry Adam moments from the old basis into the new one.

    First moment (linear, exact when the old span contains the new one):
    ``M <- M @ R`` (right) or ``M <- R.T @ M`` (left).

    Second moment: a sketch coordinate in the new basis is ``s_new_j = sum_i s_i R_ij``.
    Treating the old coordinates as uncorrelated, ``E[s_new_j^2] = sum_i E[s_i^2] R_ij^2``,
    so ``V <- V @ (R*R)`` (right) or ``(R*R).T @ V`` (left). This keeps ``V >= 0``,
    is exact for permutations and sign flips of the basis, and keeps Adam's
    step count (and bias correction) running instead of restarting it.
    """
    r2 = rot * rot  # [r, r]
    return _turn(exp_avg, rot, side), (exp_avg_sq @ r2 if side == "right" else r2.T @ exp_avg_sq)


def _turn(exp_avg: torch.Tensor, rot: torch.Tensor, side: str) -> torch.Tensor:
    """``M @ R`` (right, [m, r]) or ``R.T @ M`` (left, [r, n]) in fp32, stored in ``M``'s dtype."""
    m = exp_avg.float()
    return (m @ rot if side == "right" else rot.T @ m).to(exp_avg.dtype)


def ema_(buf: torch.Tensor, x: torch.Tensor, weight: float) -> None:
    """``buf <- buf + weight * (x - buf)`` (``lerp``) in fp32, stored in ``buf``'s dtype.

    A bf16 ``buf`` (``exp_avg_dtype``) is rounded once per update; with ``weight = 1 - beta1 = 0.1``
    each update moves it by far more than its 2^-8 relative resolution, so it does not stall
    (a ``beta2 = 0.999`` second moment would, which is why that one stays fp32).
    """
    if buf.dtype == x.dtype:
        buf.lerp_(x, weight)
    else:
        buf.copy_(buf.float().lerp_(x.float(), weight))


def adam_moments_(
    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, beta1: float, beta2: float
) -> None:
    """In-place Adam moment update (``torch.optim.Adam``'s order of operations)."""
    ema_(exp_avg, grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)


def adam_direction(
    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, beta1: float, beta2: float, eps: float
) -> torch.Tensor:
    """Bias-corrected Adam direction ``m_hat / (sqrt(v_hat) + eps)`` (same shape as the moments).

    Written in ``torch.optim.AdamW``'s single-tensor arithmetic so a full-rank
    identity basis reproduces it to fp32 rounding.
    """
    bias1 = 1 - beta1**step
    bias2_sqrt = (1 - beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)
    return (exp_avg.float() / bias1) / denom


def max_abs(x: torch.Tensor) -> float:
    """``max |x|`` (NaN if ``x`` holds one) in one pass: ``aminmax`` writes no ``|x|`` temporary of ``x``'s size.

    Example::

        >>> max_abs(torch.tensor([[1.0, -5.0], [3.0, 2.0]]))
        5.0
    """
    lo, hi = torch.aminmax(x)
    return float(torch.maximum(-lo, hi))


def lowrank_delta(direction: torch.Tensor, basis: torch.Tensor, side: str) -> torch.Tensor:
    """Full ``[m, n]`` matrix ``U @ Q.T`` (right) or ``P @ U`` (left). Materializes one matrix."""
    basis = basis.to(direction.dtype)
    return direction @ basis.T if side == "right" else basis @ direction


def lowrank_factors(direction: torch.Tensor, basis: torch.Tensor, side: str, coef: float):
    """Thin factors ``(left [m, r], right [r, n])`` with ``left @ right == coef * lowrank_delta(...)``."""
    basis = basis.to(direction.dtype)
    if side == "right":
        return direction * coef, basis.T.contiguous()
    return basis.contiguous(), direction * coef


# ------------------------------------------------------- factored second moment (docs/design.md §2)
# A moment matrix is [a, b]: right sketch [m, r], left sketch [r, n]. The factored second moment
# keeps Adafactor's row and column means of the EMA of s*s, ``row`` [a] and ``col`` [b], and
# reads V back as their outer product over the mean of the rank-sized factor (``col`` right,
# ``row`` left): both means equal the mean of V, and the rank-sized factor is the one every
# FSDP2 rank holds whole (see logra.py choice 8).


def factored_second_moment_wanted(second_moment: str, side: str, m: int, n: int) -> bool:
    """Whether an ``[m, n]`` matrix sketched on ``side`` keeps the factored second moment.

    ``"auto"``: only a right sketch of a matrix with ``m > n`` (input embeddings and fused experts,
    whose side is forced): its ``[m, r]`` moments are larger than the ``[r, n]`` ones the smaller
    side would give, and the factors ``[m]`` + ``[r]`` give most of that back.
    """
    if second_moment == "auto":
        return side == "right" and m > n
    return second_moment == "factored"


def sq_means(sketch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean over columns, mean over rows)`` of ``sketch * sketch`` ([a, b] -> [a], [b])."""
    sq = sketch * sketch  # [a, b]
    return sq.mean(dim=1), sq.mean(dim=0)


def factored_moments_(
    exp_avg: torch.Tensor,
    row: torch.Tensor,
    col: torch.Tensor,
    sketch: torch.Tensor,
    row_sq: torch.Tensor,
    col_sq: torch.Tensor,
    beta1: float,
    beta2: float,
) -> None:
    """In place: first moment as Adam; ``row``/``col`` EMAs of the row/column means ``row_sq``/``col_sq`` of ``s*s``."""
    ema_(exp_avg, sketch, 1 - beta1)
    row.mul_(beta2).add_(row_sq, alpha=1 - beta2)
    col.mul_(beta2).add_(col_sq, alpha=1 - beta2)


def factored_second_moment(row: torch.Tensor, col: torch.Tensor, side: str) -> torch.Tensor:
    """``V`` read back from its factors: ``outer(row, col) / mean(rank-sized factor)`` ([a, b]); 0 where it is 0."""
    small = col if side == "right" else row
    mean = small.mean().clamp_min(torch.finfo(small.dtype).tiny)
    return torch.outer(row, col).div_(mean)


def factored_direction(
    exp_avg: torch.Tensor,
    row: torch.Tensor,
    col: torch.Tensor,
    side: str,
    step: int,
    beta1: float,
    beta2: float,
    eps: float,
) -> torch.Tensor:
    """:func:`adam_direction` with ``V`` read back from its factors (one ``[a, b]`` temporary)."""
    bias1 = 1 - beta1**step
    bias2_sqrt = (1 - beta2**step) ** 0.5
    denom = factored_second_moment(row, col, side).sqrt_().div_(bias2_sqrt).add_(eps)
    return (exp_avg.float() / bias1) / denom


def rotate_factored(
    exp_avg: torch.Tensor, row: torch.Tensor, col: torch.Tensor, rot: torch.Tensor, side: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rotate_moments` for the factored second moment.

    The rank-sized factor turns like ``V``'s rows or columns (``col <- (R*R).T @ col`` right,
    ``row <- (R*R).T @ row`` left); the other factor is the row (column) mean of
    ``V (R*R)`` under the rank-one model, i.e. itself times ``mean(new) / mean(old)`` of the
    rank-sized factor. So the read-back ``V`` is exactly the rotated read-back ``V``.
    """
    r2 = rot * rot  # [r, r]
    if side == "right":
        new_col = r2.T @ col  # [r]
        old, new = col.mean(), new_col.mean()
        ratio = new / old if float(old) > 0 else torch.ones_like(old)
        return _turn(exp_avg, rot, side), row * ratio, new_col
    new_row = r2.T @ row  # [r]
    old, new = row.mean(), new_row.mean()
    ratio = new / old if float(old) > 0 else torch.ones_like(old)
    return _turn(exp_avg, rot, side), new_row, col * ratio
