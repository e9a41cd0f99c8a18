"""Rollout engines: Hugging Face ``generate`` in-process, and vLLM."""

from logra_lightning.rollout.base import LowRankUpdate, Rollout, RolloutEngine, SamplingConfig
from logra_lightning.rollout.hf import HFEngine

__all__ = ["HFEngine", "LowRankUpdate", "Rollout", "RolloutEngine", "SamplingConfig"]
