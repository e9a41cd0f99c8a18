"""The rollout-engine interface shared by the Hugging Face and vLLM engines.

An engine turns prompts (token ids) into ``n`` sampled completions each, with the
log-probability the engine gave every sampled token. It also accepts weight
updates from the trainer, either as full tensors or as low-rank factors
(``W <- c*W + L @ R``, between basis refreshes possibly only the coefficient), so
that the weight-sync callback can keep it in step with the policy being trained.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from logra_lightning.sync.wire import LowRankUpdate  # re-exported: engines take it


@dataclass
class Rollout:
    """Completions for ``B`` prompts x ``n`` samples, grouped by prompt.

    Row ``i * n + j`` is sample ``j`` of prompt ``i``. Completion token lists do not
    include the prompt; they include the EOS token when the sample finished.
    """

    prompt_ids: list[list[int]]  # B lists
    completion_ids: list[list[int]]  # B*n lists
    logprobs: list[list[float]]  # B*n lists, one per completion token (sampling distribution)
    texts: list[str]  # B*n decoded completions, EOS removed
    finished: list[bool]  # B*n: ended with EOS (False = cut at max_new_tokens)
    n: int = 1
    policy_version: str | None = None  # the engine's weight version that sampled every token (None: not reported)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def metrics(self, seconds: float) -> dict[str, float]:
        """``completion/length_mean``, ``completion/clipped_ratio`` and, for a step of ``seconds``, ``perf/*``."""
        lengths = [len(c) for c in self.completion_ids]
        return {
            "completion/length_mean": sum(lengths) / max(len(lengths), 1),
            "completion/clipped_ratio": 1.0 - sum(self.finished) / max(len(self.finished), 1),
            "perf/step_seconds": seconds,
            "perf/tokens_per_second": sum(lengths) / seconds,
        }


@dataclass
class SamplingConfig:
    """How an engine samples. ``temperature=0`` means greedy."""

    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    extra: dict = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer and the weight-sync callback need from an engine."""

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingConfig) -> Rollout: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the named parameters (HF names) with these values."""

    def apply_lowrank_updates(
        self, updates: list[LowRankUpdate], dense: Iterable[tuple[str, torch.Tensor]] = ()
    ) -> None:
        """Apply ``W <- c*W + L@R`` per update, then overwrite the ``dense`` params.

        An engine whose class sets ``caches_bases = True`` keeps each matrix's basis factor
        (:class:`~logra_lightning.sync.wire.BasisCache`) and also accepts updates that carry only
        their coefficient (the basis factor ``None``); it must refuse one whose basis version
        it does not hold. Without that attribute the sender always sends both factors.
        """

    def close(self) -> None: ...


class EngineSpec:
    """How to build a rollout engine; a config picks one by ``class_path``.

    Subclasses hold only plain options (so jsonargparse can build them from YAML)
    and create the engine once the policy is loaded, in the module's ``setup``.
    """

    def build(self, model_path: str, policy, tokenizer) -> RolloutEngine:
        """Create the engine for the policy saved at ``model_path`` (already loaded as ``policy``)."""
        raise NotImplementedError


@runtime_checkable
class OffPolicyEngine(Protocol):
    """An engine that samples while the trainer trains (``off_policy_steps=1``), besides :class:`RolloutEngine`.

    The module submits the next batch's rollout before it trains on the previous one, so the
    engine must run it in the background and say which weights produced it.
    :class:`~logra_lightning.rollout.vllm.server.VLLMServerEngine` is one; ``isinstance(engine,
    OffPolicyEngine)`` tells (it looks the methods up with ``getattr_static`` from Python 3.12 on,
    so a wrapper that forwards them through ``__getattr__`` does not count: check the engine it wraps).

    Example::

        >>> from logra_lightning.rollout import HFEngine, VLLMServerEngine
        >>> issubclass(VLLMServerEngine, OffPolicyEngine), issubclass(HFEngine, OffPolicyEngine)
        (True, False)
    """

    def submit(self, prompt_ids: list[list[int]], n: int, sampling: SamplingConfig) -> Any:
        """Start a rollout and return at once; the handle goes to :meth:`wait`."""

    def wait(self, pending: Any) -> Rollout:
        """The rollout that :meth:`submit` started (after any recovery the engine does)."""

    def policy_lag(self, rollout: Rollout) -> int | None:
        """Weight syncs since the weights that sampled ``rollout`` (0: on-policy; ``None``: unknown)."""


@runtime_checkable
class ReportsWeightDrift(Protocol):
    """An engine that reads back its own copy of the weights, besides :class:`RolloutEngine`: what
    :class:`~logra_lightning.callbacks.LowRankWeightSync`'s ``check_drift_every`` needs.

    Example::

        >>> from logra_lightning.rollout import HFEngine, VLLMEngine, VLLMServerEngine
        >>> [issubclass(e, ReportsWeightDrift) for e in (VLLMEngine, VLLMServerEngine, HFEngine)]
        [True, True, False]
    """

    def weight_drift(self, named: Iterable[tuple[str, torch.Tensor]], count: int = 256, seed: int = 0) -> dict:
        """How far the engine's weights are from ``named`` (HF names, the trainer's values), on ``count`` entries
        drawn from each weight: ``{"max_abs", "entries", "weights"}``."""
