"""Every config in configs/ starts up through ``cli.run``, one per code path as a tiny fit; the commands' help.

Bad values on the command line: tests/test_user_errors.py (one table, each failing before a model is built).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_run  # tests/conftest.py

from logra_lightning.cli import run
from logra_lightning.cli.lightning_cli import LograCLI

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
# Configs that need more than this CPU machine gives a unit test get a stand-in: the tiny built-in
# model, CPU, one process, and the HF engine (the vLLM engine is tested in tests/test_vllm_engine.py).
STAND_IN = [
    "--model.model",
    "builtin:arithmetic-tiny",
    "--trainer.accelerator",
    "cpu",
    "--trainer.devices",
    "1",
    "--trainer.precision",
    "32-true",
    "--trainer.strategy",
    "auto",
    "--model.max_new_tokens",
    "8",
    "--model.torch_threads",
    "1",
]
DATA = ROOT / "tests" / "data"
NEEDS_STAND_IN = {
    "qwen2.5-0.5b_gsm8k.yaml": [
        "--data.train.init_args.path",
        str(DATA / "gsm8k_tiny.jsonl"),
        "--data.val.init_args.path",
        str(DATA / "gsm8k_tiny.jsonl"),
    ],
    "qwen2.5-7b_math_fsdp8.yaml": [
        "--data.train.init_args.path",
        str(DATA / "math_tiny.jsonl"),
        "--data.val.init_args.path",
        str(DATA / "math_tiny.jsonl"),
    ],
    "qwen2.5-7b_math_fsdp2x8.yaml": [
        "--trainer.num_nodes",
        "1",
        "--data.train.init_args.path",
        str(DATA / "math_tiny.jsonl"),
        "--data.val.init_args.path",
        str(DATA / "math_tiny.jsonl"),
    ],
}
# The real-model configs: the 135M model's held-out pass alone takes minutes here, so their smoke test runs the
# config on the stand-in with a small held-out set; tests/test_smollm2.py runs one on the real model (slow) and
# tests/test_reasoning_gym.py checks each one's prompts and reward.
NEEDS_STAND_IN.update(
    {
        c: ["--data.train.init_args.test_size", "8", "--data.val.init_args.test_size", "8"]
        for c in CONFIGS
        if c.startswith("smollm2_")
    }
)
# One smoke fit per code path the configs take; every other config is instantiated and checked up to the model
# build (test_config_starts_up), because it differs from one of these only in values or in a part fitted
# elsewhere: arithmetic_tiny_adamw (dense AdamW) by test_default_config_logs_required_metrics_and_completions
# below, arithmetic_tiny_lora by tests/test_lora.py, qwen2.5-0.5b_gsm8k by tests/test_gsm8k_vllm_e2e.py (both
# with vLLM), the Llama family (arithmetic_tiny_llama) and the reasoning_* configs (activation checkpointing) by
# tests/test_reasoning_tasks.py, the server engine by tests/test_vllm_server.py, arithmetic_fsdp by
# tests/test_fsdp_lightning.py (two processes).
FIT = {
    "arithmetic_tiny.yaml": "LoGRA, KL step control, low-rank weight sync, memory monitor",
    "arithmetic_tiny_gemma3.yaml": "another family: Gemma 3 with tied embeddings",
    "qwen2.5-7b_math_fsdp8.yaml": "MATH data, the math-verify reward",
    "smollm2_chain_sum.yaml": "reasoning-gym data and reward, truncated importance sampling",
}
# torch.compile takes most of a tiny fit's time; the compiled, bf16, eager-attention step is trained by
# tests/test_throughput.py::test_bf16_mixed_compiled_eager_attention_trains_and_reports_mfu
UNCOMPILED = ["--model.compile", "false"]
MULTI_PROCESS = {"arithmetic_fsdp.yaml"}  # ModelParallelStrategy over two processes: tests/test_fsdp_lightning.py
# The demo on other families: here on a 1-layer random-init model of the same family (the full
# config, warm-up included, is measured in README); its vLLM engine is replaced like the others'.
OTHER_FAMILY = {"arithmetic_tiny_llama.yaml": "llama", "arithmetic_tiny_gemma3.yaml": "gemma3"}


def family_stand_in(config: str, tmp_path: Path) -> list[str]:
    from dataclasses import replace

    from logra_lightning.builtin.registry import BUILTIN_MODELS
    from logra_lightning.models import build_tiny_model

    builtin = BUILTIN_MODELS[f"arithmetic-tiny-{OTHER_FAMILY[config]}"].model
    path = build_tiny_model(tmp_path / "model", replace(builtin, num_layers=1))
    return ["--model.model", path]


def engine_override(config: str) -> list[str]:
    text = (ROOT / "configs" / config).read_text()
    vllm = "VLLMEngineSpec" in text or "VLLMServerEngineSpec" in text  # the server engine: tests/test_vllm_server.py
    return ["--model.engine", "logra_lightning.rollout.HFEngineSpec"] if vllm else []


def smoke_args(config: str, tmp_path: Path) -> list[str]:
    """``logra fit`` of a config as a tiny run on this machine (stand-ins for what it lacks)."""
    args = ["fit", "--config", str(ROOT / "configs" / config), *tiny_run(tmp_path), *engine_override(config)]
    return args + STAND_IN + NEEDS_STAND_IN[config] if config in NEEDS_STAND_IN else args


def test_every_fitted_config_is_a_config():
    assert set(FIT) | set(OTHER_FAMILY) | MULTI_PROCESS <= set(CONFIGS)


@pytest.mark.parametrize("config", sorted(FIT))
def test_config_smoke(config, tmp_path, tiny_policy_path):
    args = smoke_args(config, tmp_path)
    if config in OTHER_FAMILY:
        args += family_stand_in(config, tmp_path)
    cli = run(args + UNCOMPILED)
    assert cli.trainer.global_step == 2
    summary = json.loads((Path(cli.trainer.log_dir) / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    assert (Path(cli.trainer.log_dir) / "config.yaml").exists()  # the resolved config is saved with the logs


@pytest.mark.parametrize("config", [c for c in CONFIGS if c not in set(FIT) | MULTI_PROCESS])
def test_config_starts_up(config, tmp_path, no_model_built):
    """Parsed, every class instantiated, every start-up check passed and the data loaded: ``fit`` gets as far as
    building the model (forbidden here)."""
    with pytest.raises(AssertionError, match="a model was built"):
        run(smoke_args(config, tmp_path))


def test_default_config_logs_required_metrics_and_completions(tmp_path, tiny_policy_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli = run(["fit", "--config", str(ROOT / "configs/arithmetic_tiny_adamw.yaml"), *tiny_run(tmp_path)])
    acc = EventAccumulator(cli.trainer.log_dir)
    acc.Reload()
    keys = set(acc.Tags()["scalars"])
    required = {
        "reward/mean",
        "reward/std",
        "reward/accuracy",
        "val/accuracy",
        "loss/policy",
        "policy/entropy",
        "policy/clip_frac",
        "policy/approx_kl",
        "completion/length_mean",
        "perf/step_seconds",
        "perf/tokens_per_second",
    }
    assert required <= keys, required - keys
    rows = (Path(cli.trainer.log_dir) / "completions.jsonl").read_text().splitlines()
    assert len(rows) == 8 and json.loads(rows[0])["step"] == 0  # LogCompletions is on by default: every 10 steps


def test_omegaconf_interpolation(tmp_path, no_model_built):
    text = (ROOT / "configs/arithmetic_tiny_adamw.yaml").read_text()
    cfg = tmp_path / "interp.yaml"
    cfg.write_text(text.replace("val_batch_size: 128", "val_batch_size: ${data.batch_size}"))
    cli = LograCLI(args=["--config", str(cfg)], run=False)
    assert cli.datamodule.val_batch_size == 16  # resolved from the file's data.batch_size, not the 128 it replaced


def test_help_lists_every_command(capsys):
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n  {cmd} " in out for cmd in ("fit", "validate", "test", "plan", "export", "serve"))
    assert "predict" not in out
    with pytest.raises(SystemExit) as err:
        run([])
    assert err.value.code == 2 and "a command is required" in capsys.readouterr().err


def test_predict_is_not_offered(capsys):
    with pytest.raises(SystemExit):
        run(["predict", "--config", str(ROOT / "configs/arithmetic_tiny_adamw.yaml")])
    assert "invalid choice: 'predict'" in capsys.readouterr().err


def test_test_and_validate_evaluate_the_checkpoint_not_the_base_model(tmp_path, tiny_policy_path):
    """An engine with its own weights (as vLLM has) is loaded with the checkpoint's before it evaluates."""
    import torch

    config = str(ROOT / "configs/arithmetic_tiny_adamw.yaml")
    own_engine = ["--model.engine", "logra_lightning.rollout.HFEngineSpec", "--model.engine.copy_weights", "true"]
    fit = run(["fit", "--config", config, *tiny_run(tmp_path), "--model.optimizer.init_args.lr", "3e-2", *own_engine])
    ckpt = str(tmp_path / "trained.ckpt")
    fit.trainer.save_checkpoint(ckpt)
    trained = {n: p.detach().clone() for n, p in fit.model.policy.named_parameters()}
    small = ["--data.val.init_args.test_size", "16", "--trainer.logger.init_args.save_dir", str(tmp_path / "eval")]
    for command, key in (("test", "test/accuracy"), ("validate", "val/accuracy")):
        cli = run([command, "--config", config, *small, *own_engine, "--ckpt_path", ckpt])
        engine = dict(cli.model.engine.model.named_parameters())
        for name, p in trained.items():
            torch.testing.assert_close(engine[name], p, rtol=0, atol=0, msg=name)
        assert 0.0 <= cli.trainer.callback_metrics[key].item() <= 1.0
