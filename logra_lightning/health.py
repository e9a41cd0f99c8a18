"""What a training step does when something goes wrong: the checks, as pure functions.

:class:`~logra_lightning.module.PolicyGradientModule` calls these and acts on them; every rank
takes the same decision (one boolean all-reduce through the strategy). Tests:
``tests/test_faults.py``.

======================================  =========================================  ==============================
Fault                                   Behaviour                                  Counter / message
======================================  =========================================  ==============================
reward function raises / returns        that sample gets reward 0                  ``reward/errors``; warned once
NaN or inf for a sample
empty batch (no completion token) or    step skipped before scoring: no            ``health/skipped_batches``;
all completions cut at                  backward, no optimizer or callback         warned once with the step
``max_new_tokens``                      state touched
NaN/inf loss, gradient or LoGRA         backward runs, then ``zero_grad()``        ``health/skipped_steps``;
sketch                                  instead of ``step()``: weights, moments,   warned once with the step
                                        step counts, LR schedule, KL control
                                        and weight sync all stay as they were
more than ``max_consecutive_skips``     checkpoint ``halted-step=N.ckpt`` in the   ``TrainingError`` naming the
skips in a row (either kind)            log dir's ``checkpoints/``, then stop      step, the cause, the file
engine fails during generation          stop; no checkpoint of this step, the      ``TrainingError`` naming the
(or returns the wrong number of         last one stays intact                      step, the error and
samples)                                                                           ``--ckpt_path last``
======================================  =========================================  ==============================
"""

from __future__ import annotations

import torch

from logra_lightning.rollout.base import Rollout


def degenerate_rollout(rollout: Rollout) -> str | None:
    """Why a rollout has nothing to learn from, or ``None`` when it is usable.

    ``"empty"``: no completion has a single token. ``"all truncated"``: every completion was
    cut at ``max_new_tokens`` (none ended with EOS), so no sample gave a complete answer.
    """
    if not any(len(c) for c in rollout.completion_ids):
        return "empty"
    if not any(rollout.finished):
        return "all truncated"
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def grads_finite(optimizer: torch.optim.Optimizer) -> bool:
    """True when every gradient, and every accumulated LoGRA sketch, of ``optimizer``'s params is finite.

    LoGRA frees the gradients of low-rank params in backward and keeps their sketches
    (``optimizer.gradient_sketches()``); those are checked instead. Under FSDP2 each rank checks
    its local shards (callers all-reduce the answer).
    """
    optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the real one
    flags = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                flags.append(torch.isfinite(_local(p.grad)).all())
    for sketch in getattr(optimizer, "gradient_sketches", list)():
        flags.append(torch.isfinite(sketch).all())
    return bool(torch.stack(flags).all()) if flags else True
