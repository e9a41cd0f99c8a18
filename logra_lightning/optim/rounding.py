"""Adding an fp32 update to bf16 weights: round to nearest, stochastic rounding, or Kahan compensation.

A bf16 weight has 8 significant bits: an update smaller than half a unit in the last place
(``|Δ| < 2^-9 |w|``, e.g. ``lr = 1e-5`` on a weight of size ``1e-2``) rounds back to the old
value and is lost. :class:`~logra_lightning.optim.LoGRA` with bf16 weights adds its fp32
update with one of these rules (``bf16_update=``); measured in docs/results.md (the bf16 paragraph):

* :func:`add_nearest` — ``round(w + Δ)``: no extra memory; small updates vanish.
* :func:`add_stochastic` — round up or down with the probabilities that make the result
  unbiased, ``E[new] = w + Δ``: no extra memory; a small update survives on average.
* :func:`add_kahan` — compensated summation: a bf16 buffer ``c`` (2 bytes per weight) keeps
  what rounding dropped and adds it back at the next step, so ``w + c`` tracks the exact sum.

Each function returns new tensors (the optimizer copies them into place) and takes the fp32
sum ``w + Δ`` once, so the only rounding is the final one. :func:`add_by_rule` applies a rule
in blocks of rows, so its fp32 temporaries are a few MB whatever the matrix. :func:`lost_updates` counts the
entries whose nonzero update left the weight unchanged. Tests: ``tests/test_rounding.py``
(against float64 arithmetic).

Example::

    >>> import torch
    >>> w = torch.ones(4, dtype=torch.bfloat16)
    >>> delta = torch.full((4,), 1e-3)                     # below half an ulp of 1.0 (2^-8)
    >>> bool((add_nearest(w, delta) == w).all())            # nearest: the update is lost
    True
    >>> new, comp = add_kahan(w, delta, torch.zeros(4, dtype=torch.bfloat16))
    >>> bool((new == w).all()), float(comp[0]) > 0          # Kahan: kept in the compensation
    (True, True)
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable

import torch

MODES = ("nearest", "stochastic", "kahan")
_LOW16 = 0xFFFF


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 up or down at random, unbiased: ``E[result] = x``.

    bf16 is the top 16 bits of fp32. Adding a uniform 16-bit integer to the low 16 bits of
    ``x``'s bit pattern and truncating rounds the magnitude up with probability equal to the
    dropped fraction of an ulp. Non-finite values pass through (rounded to nearest).

    Args:
        x: fp32 tensor.
        generator: CPU generator of the random bits (seed it for reproducible steps).
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16: expected float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, _LOW16 + 1, x.shape, generator=generator, dtype=torch.int32, device="cpu").to(x.device)
    rounded = torch.bitwise_and(bits + noise, ~_LOW16).view(torch.float32)  # low 16 bits zero: exact in bf16
    return torch.where(torch.isfinite(x) & torch.isfinite(rounded), rounded, x).to(torch.bfloat16)


def add_nearest(w: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``w + delta`` computed in fp32, rounded once to ``w``'s dtype (round to nearest even)."""
    return (w.float() + delta).to(w.dtype)


def add_stochastic(w: torch.Tensor, delta: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``w + delta`` (fp32) stochastically rounded to bf16 (:func:`stochastic_round_bf16`)."""
    if w.dtype != torch.bfloat16:
        raise TypeError(f"add_stochastic: weights must be bfloat16, got {w.dtype}")
    return stochastic_round_bf16(w.float() + delta, generator)


def add_kahan(w: torch.Tensor, delta: torch.Tensor, comp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kahan-compensated ``w + delta``: returns ``(new_w, new_comp)``, both in ``w``'s dtype.

    ``y = delta + comp``; ``new_w = round(w + y)``; ``new_comp = round(y - (new_w - w))``. The
    difference ``new_w - w`` of two bf16 numbers is exact in fp32, so the only loss is
    rounding the compensation itself to bf16 (relative ``2^-9`` of what it holds).
    """
    y = delta + comp.float()
    new = (w.float() + y).to(w.dtype)
    new_comp = (y - (new.float() - w.float())).to(comp.dtype)
    return new, new_comp


def lost_updates(old: torch.Tensor, new: torch.Tensor, delta: torch.Tensor) -> int:
    """Entries whose update was nonzero but whose weight did not change."""
    return int(((new == old) & (delta != 0)).sum())


CHUNK_ELEMENTS = 1 << 20  # entries per block of the rounded add: 4 MB per fp32 temporary


class DeltaRows:
    """An fp32 update of shape ``shape`` given by its rows: ``delta(lo, hi)`` is ``[hi - lo, n]``.

    Example::

        >>> d = DeltaRows(lambda lo, hi: torch.ones(hi - lo, 3), (4, 3))
        >>> d(1, 3).shape, d.numel()
        (torch.Size([2, 3]), 12)
    """

    def __init__(self, rows: Callable[[int, int], torch.Tensor], shape: tuple[int, ...]) -> None:
        self.rows, self.shape = rows, tuple(shape)

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        return self.rows(lo, hi)

    def numel(self) -> int:
        return math.prod(self.shape)


def add_by_rule(
    rule: str,
    w: torch.Tensor,
    delta: torch.Tensor | DeltaRows,
    state: dict,
    seed: int,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> int:
    """``w += delta`` in place for a bf16/fp16 ``w`` by ``rule`` (one of :data:`MODES`); returns the entries lost.

    The add runs over blocks of rows of ``w`` (its first dim; about ``chunk_elements`` entries each),
    so the fp32 update, the fp32 sum, the random bits and their masks exist for one block at a
    time, not for the whole matrix. ``delta`` is the fp32 update (``w``'s shape), or a function
    returning its rows ``lo:hi``, so that a low-rank update is expanded block by block too
    (:func:`~logra_lightning.optim.candidate.move_`). The result does not depend on the blocks:
    the random bits come from one generator in row order.

    ``"kahan"`` keeps its compensation in ``state["bf16_comp"]`` (created on first use);
    ``"stochastic"`` (bf16 only; fp16 falls back to nearest) draws its bits from ``seed``.

    Example::

        >>> w = torch.ones(5, 3, dtype=torch.bfloat16)
        >>> add_by_rule("nearest", w, DeltaRows(lambda lo, hi: torch.full((hi - lo, 3), 0.5), (5, 3)), {}, 0, 6)
        0
        >>> w[4].tolist()
        [1.5, 1.5, 1.5]
    """
    rows = w.shape[0] if w.dim() else 1
    flat = w.view(rows, -1)  # [m, n]
    comp = state.setdefault("bf16_comp", torch.zeros_like(w)).view(rows, -1) if rule == "kahan" else None
    gen = torch.Generator().manual_seed(seed) if rule == "stochastic" and w.dtype == torch.bfloat16 else None
    step = max(1, chunk_elements // max(flat.shape[1], 1))
    lost = 0
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        d = delta(lo, hi) if callable(delta) else delta.view(rows, -1)[lo:hi]  # [c, n] fp32
        old = flat[lo:hi]
        if comp is not None:
            new, comp_new = add_kahan(old, d, comp[lo:hi])
            comp[lo:hi] = comp_new
        elif gen is not None:
            new = add_stochastic(old, d, gen)
        else:
            new = add_nearest(old, d)
        lost += lost_updates(old, new, d)
        old.copy_(new)
    return lost


def autocast_off() -> contextlib.ExitStack:
    """Autocast switched off where it is on.

    Lightning's ``bf16-mixed`` runs a manual-optimization ``training_step`` (backward hooks and
    ``optimizer.step()`` included) under autocast, which would compute LoGRA's sketches, moments
    and updates in bf16; they are fp32 by design.
    """
    stack = contextlib.ExitStack()
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def outside_autocast(fn: Callable) -> Callable:
    """Decorator: run ``fn`` under :func:`autocast_off`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with autocast_off():
            return fn(*args, **kwargs)

    return wrapper
