"""What LoGRA holds for one step only, and when each part of it is forgotten.

A step's state lives like a gradient: it is built by backward and consumed by the step, never
checkpointed. Its fields end at different points, the scopes of :meth:`StepState.reset`:

* ``"completion"``: ``touched``, ``reduced``, ``completed``, ``nonfinite``, ``col_sums``; at the end
  of ``prepare_update``, when the gradients became the candidate (``clip_norm`` stays: it is the
  norm that candidate was prepared from).
* ``"gradients"``: those and ``sketches``, ``clip_norm``; at ``zero_grad``. A prepared candidate is
  kept, as ``zero_grad`` keeps torch's optimizer state.
* ``"candidate"``: ``pending``, ``prepared``, ``perturb_total``, ``step_scale``, ``clip_norm``; once
  the step applied the candidate.
* ``"all"``: every field; when a checkpoint is loaded.

Clipping (:mod:`~logra_lightning.optim.clipping`) and data-parallel averaging
(:mod:`~logra_lightning.optim.data_parallel`) read and scale these fields through
``LoGRA.step_state``.

Example::

    >>> import torch
    >>> s = StepState()
    >>> s.sketches[0] = torch.ones(2); s.touched.add(0); s.clip_norm = torch.tensor(1.0)
    >>> s.reset("completion"); (list(s.sketches), s.touched, float(s.clip_norm))
    ([0], set(), 1.0)
    >>> s.reset("gradients"); (s.sketches, s.clip_norm)
    ({}, None)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from logra_lightning.optim.candidate import PendingUpdate

SCOPES = ("completion", "gradients", "candidate", "all")


@dataclass
class StepState:
    """One LoGRA step's gradients (as sketches), their completion, and the candidate update Δ.

    Attributes:
        sketches: ``id(p)`` -> accumulated gradient sketch of a low-rank param: allocated by the
            step's first backward hook, consumed by ``prepare_update``.
        touched: ``id(p)`` of the low-rank params that got a gradient this step (on any replica, once
            averaged).
        reduced: the data-parallel average of this step's sketches ran (once per step).
        completed: ``id(p)`` whose sketch is complete: FSDP2's partial sums added, checked for NaN/inf.
        nonfinite: ``id(p)`` whose completed sketch holds NaN or inf (that matrix skips its step).
        col_sums: ``id(p)`` -> column sums of ``S * S`` for a factored second moment under FSDP2.
        clip_norm: the global gradient norm once clipped this step, ``None`` before.
        pending: param -> its candidate update, from ``prepare_update`` to the step.
        prepared: ``pending`` holds this step's candidate (``prepare_update`` ran).
        perturb_total: the scale of Δ the weights sit at now (``perturb_`` moves them).
        step_scale: the scale of Δ the next ``step()`` applies (``set_step_scale``).
    """

    sketches: dict[int, torch.Tensor] = field(default_factory=dict)
    touched: set[int] = field(default_factory=set)
    reduced: bool = False
    completed: set[int] = field(default_factory=set)
    nonfinite: set[int] = field(default_factory=set)
    col_sums: dict[int, torch.Tensor] = field(default_factory=dict)
    clip_norm: torch.Tensor | None = None
    pending: dict[torch.Tensor, PendingUpdate] = field(default_factory=dict)
    prepared: bool = False
    perturb_total: float = 0.0
    step_scale: float = 1.0

    def reset(self, scope: str = "all") -> None:
        """Forget the fields of ``scope`` (the module docstring's table).

        Raises:
            ValueError: ``scope`` is not one of :data:`SCOPES`.
        """
        if scope not in SCOPES:
            raise ValueError(f"Invalid step-state scope: {scope!r} (allowed: {', '.join(SCOPES)})")
        if scope in ("completion", "gradients", "all"):
            self.touched.clear()
            self.reduced = False
            self.completed = set()
            self.nonfinite = set()
            self.col_sums = {}
        if scope in ("gradients", "all"):
            self.sketches.clear()
        if scope in ("candidate", "all"):
            self.pending.clear()
            self.prepared = False
            self.perturb_total = 0.0
            self.step_scale = 1.0
        if scope != "completion":
            self.clip_norm = None
