"""Rollout engines: Hugging Face ``generate`` in-process, and vLLM.

``VLLMEngine`` / ``VLLMEngineSpec`` are loaded on first access, so importing this package
never imports vLLM (which is optional and slow to import).
"""

from logra_lightning.rollout.base import EngineSpec, LowRankUpdate, Rollout, RolloutEngine, SamplingConfig
from logra_lightning.rollout.hf import HFEngine, HFEngineSpec
from logra_lightning.rollout.vllm_options import VLLMOptions

_LAZY = {"VLLMEngine", "VLLMEngineSpec"}

__all__ = [
    "EngineSpec",
    "HFEngine",
    "HFEngineSpec",
    "LowRankUpdate",
    "Rollout",
    "RolloutEngine",
    "SamplingConfig",
    "VLLMEngine",
    "VLLMEngineSpec",
    "VLLMOptions",
]


def __getattr__(name: str):
    if name in _LAZY:
        from logra_lightning.rollout import vllm as _vllm_engine

        return getattr(_vllm_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
