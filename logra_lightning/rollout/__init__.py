"""Rollout engines: Hugging Face ``generate`` in-process, vLLM in-process, and a separate ``vllm serve`` process.

``VLLMEngine`` / ``VLLMEngineSpec`` and ``VLLMServerEngine`` / ``VLLMServerEngineSpec`` are loaded on
first access, so importing this package never imports vLLM (which is optional and slow to import).
"""

from logra_lightning.rollout.base import (
    EngineSpec,
    LowRankUpdate,
    OffPolicyEngine,
    ReportsWeightDrift,
    Rollout,
    RolloutEngine,
    SamplingConfig,
)
from logra_lightning.rollout.hf import HFEngine, HFEngineSpec
from logra_lightning.rollout.vllm.options import VLLMOptions

_LAZY = {
    "VLLMEngine": "vllm.engine",
    "VLLMEngineSpec": "vllm.engine",
    "VLLMServerEngine": "vllm.server",
    "VLLMServerEngineSpec": "vllm.server",
}

__all__ = [
    "EngineSpec",
    "HFEngine",
    "HFEngineSpec",
    "LowRankUpdate",
    "OffPolicyEngine",
    "ReportsWeightDrift",
    "Rollout",
    "RolloutEngine",
    "SamplingConfig",
    "VLLMEngine",
    "VLLMEngineSpec",
    "VLLMOptions",
    "VLLMServerEngine",
    "VLLMServerEngineSpec",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
