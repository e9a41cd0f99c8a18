"""The two-phase step for any torch optimizer: compute the candidate update Δ, probe it, apply ``eta * Δ``.

Predicted-KL step control (docs/design.md §4) needs four calls between backward and the
update: ``prepare_update()`` (hold Δ), ``update_max_abs()``, ``perturb_(alpha)`` (``W +=
alpha * Δ`` in place) and ``set_step_scale(eta)``; its forward-mode probe reads one param's Δ
at a time with ``update_delta(p)`` instead of the middle two. :class:`~logra_lightning.optim.LoGRA`
has them natively; :func:`two_phase` gives them to any optimizer:

* :class:`NativeTwoPhase` forwards to an optimizer that has them. The candidate exists
  before the optimizer's own ``step()``, which then applies ``eta * Δ``.
* :class:`SnapshotTwoPhase` (e.g. ``torch.optim.AdamW``): :meth:`~SnapshotTwoPhase.begin`
  copies every param that has a gradient just before the optimizer steps; after the step,
  :meth:`~SnapshotTwoPhase.prepare_update` turns the copy into ``Δ = new - old`` in place and
  puts W back at ``old``; :meth:`~SnapshotTwoPhase.finish` sets ``W = old + eta * Δ``. Extra
  memory: one copy of the params being trained, from just before the step to just after
  it. The optimizer's moments advance as for the full step (only the applied update is
  scaled), as they do with LoGRA.

Both have the same lifecycle, so a caller writes one path::

    two = two_phase(opt)
    two.begin()                      # before the optimizer's update
    # ... if two.candidate_before_step: control now; else after the optimizer's step:
    two.prepare_update(); two.perturb_(eps); ...; two.set_step_scale(eta)
    two.finish()                     # W = W0 + eta * Δ (native: the optimizer's step does it)

The update lands at ``W0 + eta * Δ`` from wherever ``perturb_`` left W (a native optimizer's
``step()`` moves W from its accumulated perturbation, as LoGRA does), so a probe need not undo
its perturbation before the step.

Example::

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(3))
    >>> opt = torch.optim.SGD([w], lr=1.0)
    >>> two = two_phase(opt)
    >>> w.grad = torch.ones(3); two.begin(); opt.step()
    >>> two.prepare_update(); two.update_max_abs(), w.tolist()  # W back at W0, Δ held
    (1.0, [0.0, 0.0, 0.0])
    >>> two.set_step_scale(0.25); two.finish(); w.tolist()
    [-0.25, -0.25, -0.25]
"""

from __future__ import annotations

import math
from typing import Any

import torch

from logra_lightning._util import local
from logra_lightning.optim import sketch as sk

TWO_PHASE_METHODS = ("prepare_update", "update_max_abs", "perturb_", "set_step_scale")


def is_two_phase(optimizer: Any) -> bool:
    """Whether ``optimizer`` splits "compute the candidate update" from "apply it with a scale"."""
    return all(callable(getattr(optimizer, name, None)) for name in TWO_PHASE_METHODS)


def two_phase(optimizer: torch.optim.Optimizer) -> NativeTwoPhase | SnapshotTwoPhase:
    """The two-phase adapter of ``optimizer`` (a Lightning ``LightningOptimizer`` is unwrapped)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)
    return NativeTwoPhase(optimizer) if is_two_phase(optimizer) else SnapshotTwoPhase(optimizer)


class NativeTwoPhase:
    """An optimizer with the two-phase calls; its own ``step()`` applies ``eta * Δ``."""

    candidate_before_step = True

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def begin(self) -> None:
        """Nothing to keep: the optimizer holds its candidate."""

    def prepare_update(self) -> None:
        self.optimizer.prepare_update()

    def update_max_abs(self) -> float:
        return float(self.optimizer.update_max_abs())

    def perturb_(self, alpha: float) -> None:
        self.optimizer.perturb_(alpha)

    def update_delta(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s scale-1 Δ (for a forward-mode probe); the optimizer must have ``update_delta``."""
        return self.optimizer.update_delta(p)

    @property
    def has_update_delta(self) -> bool:
        return callable(getattr(self.optimizer, "update_delta", None))

    def set_step_scale(self, eta: float) -> None:
        self.optimizer.set_step_scale(eta)

    def finish(self) -> None:
        """Nothing: the optimizer's ``step()`` applies the scaled update."""


class SnapshotTwoPhase:
    """Snapshot-and-rescale two-phase calls for an optimizer that only has ``step()`` (see the module docstring)."""

    candidate_before_step = False

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, W0 copy, then Δ), local shards
        self._delta_of: dict[int, torch.Tensor] = {}  # id(param) -> its Δ, once prepared
        self._at = 1.0  # W = W0 + at * Δ once prepared
        self._eta = 1.0
        self._prepared = False

    @torch.no_grad()
    def begin(self) -> None:
        """Copy every param that has a gradient (call just before the optimizer's update)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self._held = [(p, local(p).detach().clone()) for p in params if p.grad is not None]
        self._at, self._eta, self._prepared = 1.0, 1.0, False

    @torch.no_grad()
    def prepare_update(self) -> None:
        """After the optimizer's step: the copies become ``Δ = new - old`` and W goes back to ``old``."""
        if self._prepared:
            return
        for p, old in self._held:
            torch.sub(local(p), old, out=old)  # old <- Δ = new - old; W stays at old + 1*Δ
        self._delta_of = {id(p): delta for p, delta in self._held}  # a forward-mode probe asks per module
        self._prepared = True
        self.perturb_(-1.0)

    def update_max_abs(self) -> float:
        return max((sk.max_abs(d) for _, d in self._held if d.numel()), default=0.0)

    has_update_delta = True

    def update_delta(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s Δ (held, not copied), or ``None`` when ``p`` had no gradient."""
        if not self._prepared:
            raise RuntimeError("update_delta() needs prepare_update() first")
        return self._delta_of.get(id(p))

    @torch.no_grad()
    def perturb_(self, alpha: float) -> None:
        """In place ``W += alpha * Δ``."""
        for p, delta in self._held:
            local(p).add_(delta, alpha=alpha)
        self._at += alpha

    def set_step_scale(self, eta: float) -> None:
        eta = float(eta)
        if not (math.isfinite(eta) and eta >= 0):
            raise ValueError(f"Invalid step scale: {eta} (must be finite and >= 0)")
        self._eta = eta

    @torch.no_grad()
    def finish(self) -> None:
        """``W = old + eta * Δ`` (``eta`` 1 unless set) and drop the copies."""
        if self._prepared:
            self.perturb_(self._eta - self._at)
        self._held, self._delta_of, self._prepared = [], {}, False
