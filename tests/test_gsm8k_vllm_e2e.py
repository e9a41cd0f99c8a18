"""The GSM8K-shaped GPU config, end to end on CPU: tiny local model, tiny local JSONL, math-verify reward, vLLM.

Only the sizes and the device are swapped for stand-ins (model path, data paths, precision,
lengths); the config's reward (``MathVerifyReward``), engine (``VLLMEngineSpec``), optimizer
(LoGRA) and callbacks (weight sync, KL control, memory) run as written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_run  # tests/conftest.py

from logra_lightning.cli import run
from logra_lightning.models import TinyModelConfig, build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "gsm8k_tiny.jsonl"

pytest.importorskip("vllm")


@pytest.mark.vllm
def test_gsm8k_config_end_to_end_with_vllm(tmp_path):
    model = build_tiny_model(tmp_path / "tiny-512", TinyModelConfig(num_layers=2, max_position_embeddings=512))
    cli = run(
        [
            "fit",
            "--config",
            str(ROOT / "configs/qwen2.5-0.5b_gsm8k.yaml"),
            "--model.model",
            model,
            "--trainer.accelerator",
            "cpu",
            "--trainer.precision",
            "32-true",
            *tiny_run(tmp_path, group_size=2),
            "--model.max_new_tokens",
            "16",
            "--model.micro_batch_size",
            "4",
            "--model.torch_threads",
            "1",
            "--model.activation_checkpointing",
            "false",
            "--model.engine.init_args.dtype",
            "float32",
            "--model.engine.init_args.max_model_len",
            "512",
            "--model.engine.init_args.enforce_eager",
            "true",
            "--model.engine.init_args.kv_cache_space_gb",
            "0.25",
            "--data.train.init_args.path",
            str(DATA),
            "--data.val.init_args.path",
            str(DATA),
            "--data.val_batch_size",
            "8",
        ]
    )
    assert cli.trainer.global_step == 2
    assert type(cli.model.engine).__name__ == "VLLMEngine"
    summary = json.loads((Path(cli.trainer.log_dir) / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    mean_gap, max_gap = cli.model.engine_logprob_gap
    assert max_gap < 1e-3  # the engine's copy followed the low-rank updates
