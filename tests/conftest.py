"""Shared fixtures: the built-in tiny policy (built once, cached in .cache/logra) and thread settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("LOGRA_CACHE_DIR", str(ROOT / ".cache" / "logra"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


# Modules that compare two computation paths in floating point (fast vs reference optimizer, engine vs HF copy,
# chunked vs whole logits, sharded or data-parallel vs one process, resumed vs uninterrupted) or that train on
# the built-in policy, which is warmed up on the machine that runs the suite and so differs by CPU. `make
# test-isa` runs them under other CPU code paths (MKL_CBWR, ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY).
NUMERICS_MODULES = {
    "test_architectures",
    "test_chunked_logprobs",
    "test_clipping",
    "test_ddp",
    "test_export",
    "test_faults",
    "test_fsdp2",
    "test_fsdp_lightning",
    "test_grad_features",
    "test_kl_control",
    "test_lora",
    "test_multinode",
    "test_optim_logra",
    "test_pi_old",
    "test_resume",
    "test_rounding",
    "test_token_budget",
    "test_vllm_engine",
    "test_vllm_server",
    "test_weight_sync",
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module = getattr(item, "module", None)  # None for items that are not Python test functions
        if module is not None and module.__name__.rsplit(".", 1)[-1] in NUMERICS_MODULES:
            item.add_marker(pytest.mark.numerics)


@pytest.fixture(scope="session")
def tiny_policy_path() -> str:
    """The warmed-up ``builtin:arithmetic-tiny`` policy directory (the demo's base model)."""
    from logra_lightning.builtin import resolve_model

    return resolve_model("builtin:arithmetic-tiny")


@pytest.fixture(scope="session")
def raw_tiny_path() -> str:
    """A randomly initialised tiny Qwen2 directory (no warm-up)."""
    from logra_lightning.builtin import resolve_model

    return resolve_model("builtin:arithmetic-tiny-raw")


def hf_greedy_answers(model, tokenizer, prompts: list[str], max_tokens: int = 5) -> list[str]:
    """Stripped greedy answers of a transformers model (the in-process HF engine), for comparing with vLLM's."""
    from logra_lightning.rollout import HFEngine
    from logra_lightning.rollout.greedy import greedy_completions

    texts = greedy_completions(
        HFEngine(model, tokenizer), tokenizer, prompts, max_new_tokens=max_tokens, batch_size=128
    )
    return [t.strip() for t in texts]


def vllm_greedy_answers(model_dir, prompts: list[str], max_tokens: int = 5) -> list[str]:
    """Greedy answers of a plain ``vllm.LLM(model=DIR)`` (own tokenizer, text prompts), as ``vllm serve`` does."""
    import vllm

    llm = vllm.LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=64,
        kv_cache_memory_bytes=1 << 30,
    )
    try:
        outs = llm.generate(prompts, vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        return [o.outputs[0].text.strip() for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
