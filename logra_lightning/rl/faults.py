"""What a training step does when something goes wrong: the checks, and the policy that acts on them.

The checks are pure functions (:func:`degenerate_rollout`, :func:`grads_finite`);
:class:`FaultPolicy` holds the counters (checkpointed) and acts: it scores rewards safely,
counts skips, warns once, and stops with a checkpoint after too many skips in a row.
:class:`~logra_lightning.rl.module.PolicyGradientModule` calls them; every rank takes the same
decision (:func:`all_ranks_agree`, one boolean all-reduce through the strategy). Tests:
``tests/test_faults.py``.

======================================  =========================================  ==============================
Fault                                   Behaviour                                  Counter / message
======================================  =========================================  ==============================
reward function raises / returns        that sample gets reward 0 (of a            ``reward/errors``; warned once
None, NaN or inf for a sample           WeightedRewards: that part of it)
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

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from logra_lightning._util import WarnOnce, local
from logra_lightning.errors import TrainingError
from logra_lightning.rewards.base import safe_rewards
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
                flags.append(torch.isfinite(local(p.grad)).all())
    for sketch in getattr(optimizer, "gradient_sketches", list)():
        flags.append(torch.isfinite(sketch).all())
    return bool(torch.stack(flags).all()) if flags else True


def all_ranks_agree(trainer: L.Trainer | None, ok: bool) -> bool:
    """True only when ``ok`` on every rank (one all-reduce under DDP/FSDP; ``ok`` itself without a trainer)."""
    if trainer is None:
        return ok
    return bool(trainer.strategy.reduce_boolean_decision(bool(ok), all=True))


def engine_failure(err: Exception, engine: Any, step: int, trainer: L.Trainer | None) -> TrainingError:
    """The error that stops training when the rollout engine fails: names the step, the error and the way back."""
    cb = trainer.checkpoint_callback if trainer is not None else None
    last = getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "") or None
    kept = f"the last checkpoint, {last}, is intact" if last else "no checkpoint was written in this run"
    return TrainingError(
        f"rollout engine {type(engine).__name__} failed at global step {step} "
        f"({type(err).__name__}: {err}). Training stopped without checkpointing this step; {kept}. "
        "Fix the engine (see the error above), then resume: logra fit --config <config> --ckpt_path last"
    )


def halt_checkpoint(trainer: L.Trainer, step: int) -> Path:
    """Write ``halted-step=<step>.ckpt`` under the log dir's ``checkpoints/`` (a collective under DDP/FSDP)."""
    root = Path(trainer.log_dir or trainer.default_root_dir)
    path = root / "checkpoints" / f"halted-step={step}.ckpt"
    trainer.save_checkpoint(path)  # every rank gets here together
    return path


class FaultPolicy:
    """The fault counters of a run and what each fault costs (the table above).

    Args:
        max_consecutive_skips: stop after more than this many skips in a row; ``None``: never.
        max_new_tokens: the completion limit, named in the skipped-batch warning.

    Example::

        >>> faults = FaultPolicy(max_consecutive_skips=None, max_new_tokens=6)
        >>> faults.score(lambda p, c, a: [1.0, float("nan")], ["p", "p"], ["4", "x"], ["4", "4"], step=0).tolist()
        [1.0, 0.0]
        >>> faults.reward_errors, faults.state_dict()["skipped_steps"]
        (1, 0)
    """

    def __init__(self, max_consecutive_skips: int | None, max_new_tokens: int) -> None:
        self.max_consecutive_skips = max_consecutive_skips
        self.max_new_tokens = max_new_tokens
        self.reward_errors = 0
        self.skipped_steps = 0
        self.skipped_batches = 0
        self.consecutive_skips = 0
        self.last_parts: dict[str, list[float]] = {}  # the last score()'s values per part of a WeightedRewards
        self._warn_once = WarnOnce(rank_zero_warn)

    def score(
        self,
        reward_fn: Callable,
        prompts: list[str],
        completions: list[str],
        answers: list[str],
        step: int,
        fields: dict[str, list] | None = None,
    ) -> torch.Tensor:
        """Rewards ``[N]``; a sample whose scoring raised or gave None/NaN/inf gets 0 and counts in ``reward/errors``.

        ``fields`` are the records' other fields, passed to a reward that asks for them. The parts of a
        :class:`~logra_lightning.rewards.WeightedRewards` are scored one by one (a failing part costs only
        its share of the sample) and kept in ``last_parts`` (``{name: [N] values}``) for ``reward/<name>``.
        """
        parts = getattr(reward_fn, "parts", None) or [(None, reward_fn, 1.0)]
        total, errors, first = [0.0] * len(completions), 0, None
        self.last_parts = {}
        for name, fn, weight in parts:
            values, n, why = safe_rewards(fn, prompts, completions, answers, fields)
            bad = {i for i, v in enumerate(values) if not math.isfinite(v)}
            if bad:  # a NaN/inf reward would turn its whole group's advantages into NaN: treat it as a failed sample
                i = min(bad)
                why = why or f"no finite reward ({values[i]}; None counts as NaN) for sample {i}"
                values = [0.0 if i in bad else v for i, v in enumerate(values)]
                n += len(bad)
            if n and first is None:
                first = why if name is None else f"reward {name}: {why}"
            errors += n
            if name is not None:
                self.last_parts[name] = values
            total = [t + weight * v for t, v in zip(total, values)]
        if errors:
            if not self.reward_errors:
                rank_zero_warn(
                    f"reward function failed on {errors} sample(s) at step {step} "
                    f"(they get reward 0; counted in reward/errors). First error: {first}"
                )
            self.reward_errors += errors
        return torch.tensor(total, dtype=torch.float32)  # [N]

    def stepped(self) -> None:
        """An optimizer step was taken: the run of consecutive skips is over."""
        self.consecutive_skips = 0

    def skip(self, kind: str, why: str, trainer: L.Trainer, step: int) -> None:
        """Count a skipped ``"step"`` or ``"batch"``; warn the first time; stop after too many in a row.

        Raises:
            TrainingError: more than ``max_consecutive_skips`` in a row (after writing :func:`halt_checkpoint`).
        """
        if kind == "step":
            self.skipped_steps += 1
        else:
            self.skipped_batches += 1
        self.consecutive_skips += 1
        limit = self.max_consecutive_skips
        what = (
            "optimizer step skipped (counted in health/skipped_steps)"
            if kind == "step"
            else (
                f"batch skipped (counted in health/skipped_batches; raise model.max_new_tokens="
                f"{self.max_new_tokens} if answers need more tokens, or set model.truncated_reward=0 if the policy "
                "learned to keep going after its answer)"
            )
        )
        self._warn_once(
            kind,
            f"{why} at global step {step}: {what}. Warned once; training stops after "
            f"more than {limit} consecutive skips (model.max_consecutive_skips).",
        )
        if limit is not None and self.consecutive_skips > limit:
            path = halt_checkpoint(trainer, step)
            raise TrainingError(
                f"{self.consecutive_skips} consecutive steps skipped at global step {step} (last: {why}; "
                f"model.max_consecutive_skips={limit}). Wrote {path} (the weights before these skips). Check the "
                "data, rewards and learning rate, then resume from it with --ckpt_path <that file>."
            )

    def metrics(self) -> dict[str, float]:
        """``health/skipped_steps``, ``health/skipped_batches``: cumulative counts."""
        return {
            "health/skipped_steps": float(self.skipped_steps),
            "health/skipped_batches": float(self.skipped_batches),
        }

    def state_dict(self) -> dict[str, int]:
        """The counters, under the keys the module's checkpoints have always used."""
        return {
            "reward_errors": self.reward_errors,
            "skipped_steps": self.skipped_steps,
            "skipped_batches": self.skipped_batches,
            "consecutive_skips": self.consecutive_skips,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("reward_errors", "skipped_steps", "skipped_batches", "consecutive_skips"):
            setattr(self, key, state.get(key, 0))
