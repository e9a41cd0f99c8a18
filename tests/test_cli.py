"""Every config in configs/ runs through ``cli.main`` with a tiny budget; bad input fails early and clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from logra_lightning.cli import main
from logra_lightning.errors import ConfigError, DataError

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
SLOW = {"arithmetic_fsdp.yaml"}  # two processes: run as a subprocess by tests/test_fsdp_lightning.py
# The reasoning configs run on a tiny policy with their own BPE tokenizer in tests/test_reasoning_tasks.py.
OWN_TEST = {c for c in CONFIGS if c.startswith("reasoning_")}
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


def tiny_budget(tmp_path: Path) -> list[str]:
    return [
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--data.batch_size",
        "4",
        "--model.group_size",
        "4",
    ]


def engine_override(config: str) -> list[str]:
    text = (ROOT / "configs" / config).read_text()
    vllm = "VLLMEngineSpec" in text or "VLLMServerEngineSpec" in text  # the server engine: tests/test_vllm_server.py
    return ["--model.engine", "logra_lightning.rollout.HFEngineSpec"] if vllm else []


@pytest.mark.parametrize("config", [c for c in CONFIGS if c not in SLOW | OWN_TEST])
def test_config_smoke(config, tmp_path, tiny_policy_path):
    args = ["fit", "--config", str(ROOT / "configs" / config), *tiny_budget(tmp_path), *engine_override(config)]
    if config in NEEDS_STAND_IN:
        args += STAND_IN + NEEDS_STAND_IN[config]
    if config in OTHER_FAMILY:
        args += family_stand_in(config, tmp_path)
    cli = main(args)
    assert cli.trainer.global_step == 2
    summary = json.loads((Path(cli.trainer.log_dir) / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    assert (Path(cli.trainer.log_dir) / "config.yaml").exists()  # the resolved config is saved with the logs


def test_default_config_logs_required_metrics(tmp_path, tiny_policy_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cli = main(["fit", "--config", str(ROOT / "configs/arithmetic_tiny_adamw.yaml"), *tiny_budget(tmp_path)])
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


def test_omegaconf_interpolation(tmp_path, tiny_policy_path):
    text = (ROOT / "configs/arithmetic_tiny_adamw.yaml").read_text()
    cfg = tmp_path / "interp.yaml"
    cfg.write_text(text.replace("val_batch_size: 128", "val_batch_size: ${data.batch_size}"))
    cli = main(["fit", "--config", str(cfg), *tiny_budget(tmp_path)])
    assert cli.datamodule.val_batch_size == 16  # resolved from the file's data.batch_size, not the 128 it replaced


def test_unknown_key_is_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs/arithmetic_tiny_adamw.yaml"), "--model.grup_size", "4"])
    assert "grup_size" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, error, match",
    [
        (["--data.batch_size", "0"], ConfigError, "data.batch_size=0"),
        (["--model.group_size", "0"], ConfigError, "model.group_size=0"),
        (["--model.group_size", "1"], ConfigError, "scale_by_std"),
        (
            ["--data.train", "logra_lightning.data.JSONLSource", "--data.train.path", "/nonexistent/d.jsonl"],
            DataError,
            "/nonexistent/d.jsonl: data file not found",
        ),
    ],
)
def test_bad_input_fails_before_any_model_is_built(override, error, match, monkeypatch):
    import logra_lightning.rl.module as module

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was built before the input was validated")

    monkeypatch.setattr(module, "load_policy", forbidden)
    monkeypatch.setattr(module, "resolve_model", forbidden)
    with pytest.raises(error, match=match):
        main(["fit", "--config", str(ROOT / "configs/arithmetic_tiny_adamw.yaml"), *override])


def test_cli_error_message_without_traceback(capsys):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "logra_lightning",
            "fit",
            "--config",
            str(ROOT / "configs/arithmetic_tiny_adamw.yaml"),
            "--data.batch_size",
            "-3",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "logra: error: data.batch_size=-3: must be an integer >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n  {cmd} " in out for cmd in ("fit", "validate", "test", "plan", "export", "serve"))
    assert "predict" not in out
    with pytest.raises(SystemExit) as err:
        main([])
    assert err.value.code == 2 and "a command is required" in capsys.readouterr().err


def test_predict_is_not_offered(capsys):
    with pytest.raises(SystemExit):
        main(["predict", "--config", str(ROOT / "configs/arithmetic_tiny_adamw.yaml")])
    assert "invalid choice: 'predict'" in capsys.readouterr().err


def test_test_and_validate_evaluate_the_checkpoint_not_the_base_model(tmp_path, tiny_policy_path):
    """An engine with its own weights (as vLLM has) is loaded with the checkpoint's before it evaluates."""
    import torch

    config = str(ROOT / "configs/arithmetic_tiny_adamw.yaml")
    own_engine = ["--model.engine", "logra_lightning.rollout.HFEngineSpec", "--model.engine.copy_weights", "true"]
    fit = main(
        ["fit", "--config", config, *tiny_budget(tmp_path), "--model.optimizer.init_args.lr", "3e-2", *own_engine]
    )
    ckpt = str(tmp_path / "trained.ckpt")
    fit.trainer.save_checkpoint(ckpt)
    trained = {n: p.detach().clone() for n, p in fit.model.policy.named_parameters()}
    small = ["--data.val.init_args.test_size", "16", "--trainer.logger.init_args.save_dir", str(tmp_path / "eval")]
    for command, key in (("test", "test/accuracy"), ("validate", "val/accuracy")):
        cli = main([command, "--config", config, *small, *own_engine, "--ckpt_path", ckpt])
        engine = dict(cli.model.engine.model.named_parameters())
        for name, p in trained.items():
            torch.testing.assert_close(engine[name], p, rtol=0, atol=0, msg=name)
        assert 0.0 <= cli.trainer.callback_metrics[key].item() <= 1.0
