"""``K``, the predicted KL of a prepared update at scale 1, two ways (docs/design.md §4).

Both take the two-phase calls of :mod:`~logra_lightning.optim.two_phase` after ``prepare_update()``:

* :func:`finite_difference_K`: move W by ``eps * Δ`` and compare fp32 logits with the base's;
  W stays there (the step takes it on to ``W0 + eta * Δ``, one pass over the weights fewer).
* :func:`forward_mode_K`: one forward-mode pass along ``update_delta`` (:mod:`~logra_lightning.kl.jvp`).

Example::

    >>> import torch
    >>> from logra_lightning.optim.two_phase import two_phase
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> opt = torch.optim.SGD([w], lr=1.0)
    >>> two = two_phase(opt)
    >>> w.grad = torch.tensor([1.0, -1.0]); two.begin(); opt.step(); two.prepare_update()
    >>> logits = lambda: w.detach()[None, :].clone()  # [1, V=2]: the logits are the weights
    >>> fd = finite_difference_K(two, logits, torch.zeros(1, 2), max_abs=1.0, probe_weight_change=1e-5)
    >>> two.perturb_(-1e-5)  # back at W0
    >>> fm = forward_mode_K(two, lambda tangent: (torch.zeros(1, 2), tangent(w)[None, :]))
    >>> round(fd, 6), round(fm, 6)  # dz = (-1, 1) at p = (1/2, 1/2): K = Var / 2 = 1/2
    (0.5, 0.5)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from logra_lightning.kl.estimates import finite_difference_epsilon, softmax_variance_kl
from logra_lightning.kl.jvp import Tangent


def finite_difference_K(
    two: Any, logits: Callable[[], torch.Tensor], base: torch.Tensor, max_abs: float, probe_weight_change: float
) -> float:
    """``K`` from ``(logits() at W0 + eps * Δ - base) / eps``.

    ``eps`` moves the largest weight by ``probe_weight_change``: ``max_abs`` is ``max |Δ|`` (reduced over
    ranks); 0 gives ``K = 0`` and leaves W at ``W0``.
    """
    eps = finite_difference_epsilon(max_abs, probe_weight_change)
    if eps <= 0.0:
        return 0.0
    two.perturb_(eps)
    try:
        probe = logits()  # [N, V]
    except BaseException:
        two.perturb_(-eps)
        raise
    return float(softmax_variance_kl(base, (probe.double() - base.double()) / eps))


def forward_mode_K(two: Any, logits_and_tangent: Callable[[Tangent], tuple[torch.Tensor, torch.Tensor]]) -> float:
    """``K`` from ``logits_and_tangent(two.update_delta)``: the logits ``[N, V]`` and their change along Δ."""
    if not getattr(two, "has_update_delta", False):
        raise RuntimeError(
            f"KLStepControl(probe='jvp') needs the optimizer's update per parameter (`update_delta(p)`); "
            f"{type(two.optimizer).__name__} has the two-phase calls without it. Use probe='finite_difference'"
        )
    base, dz = logits_and_tangent(two.update_delta)
    return float(softmax_variance_kl(base, dz))
