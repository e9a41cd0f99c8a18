"""One-step off-policy rollouts: the rollout of batch k+1 is sampled while step k trains.

With ``PolicyGradientModule(off_policy_steps=1)``, each ``training_step`` first *submits* its own
batch to the engine (which samples it in the background, from the weights synced after the
previous step) and then trains on the batch submitted one step earlier, whose rollout came from
the weights one optimizer step older. The sync after the step waits for the running rollout
(``/pause?mode=wait``), so every rollout comes from one weight version. The first batch of a fit
only fills the pipeline (no optimizer step; Lightning counts optimizer steps, so ``max_steps``
still means optimizer steps), and a rollout still in flight when a fit ends or is checkpointed is
dropped: a resumed run refills the pipeline with its first batch.

Correction: the loss weights each token by ``min(pi_trainer / pi_engine, tis_cap)`` (TIS), with
``pi_engine`` the sampling logprob the engine reported, so ``tis_cap`` is required. The lag (in
syncs) of each trained rollout is logged as ``rollout/policy_lag`` when the engine reports weight
versions (:meth:`~logra_lightning.rollout.vllm.server.VLLMServerEngine.policy_lag`).

Example::

    >>> q = OffPolicyQueue()
    >>> q.exchange(Submitted(["1+1="], ["2"], [[5, 6]], pending="R0")) is None  # the first batch fills it
    True
    >>> q.exchange(Submitted(["2+2="], ["4"], [[7, 6]], pending="R1")).pending  # the second trains on R0
    'R0'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Submitted:
    """A batch whose rollout the engine is sampling: its prompts, answers, prompt ids, the engine's handle, and
    the records' other fields (for the reward)."""

    prompts: list[str]
    answers: list[str]
    prompt_ids: list[list[int]]
    pending: Any
    fields: dict[str, list] = field(default_factory=dict)


class OffPolicyQueue:
    """Holds the one batch submitted ahead (see the module notes)."""

    def __init__(self) -> None:
        self.queued: Submitted | None = None

    def exchange(self, new: Submitted) -> Submitted | None:
        """Queue ``new``; return the batch queued before it (``None`` on the first call)."""
        old, self.queued = self.queued, new
        return old

    def drop(self) -> Submitted | None:
        """Forget the queued batch (end of a fit); returns it."""
        old, self.queued = self.queued, None
        return old
