"""perf/mfu's arithmetic, and the speed switches of PolicyGradientModule (bf16-mixed, compile, attention kernel).

Run: ``.venv/bin/python -m pytest tests/test_throughput.py -q``
"""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from logra_lightning.data import ArithmeticSource, PromptDataModule
from logra_lightning.errors import ConfigError
from logra_lightning.models.architectures import tiny_hf_config
from logra_lightning.optim import LoGRA
from logra_lightning.rl.module import PolicyGradientModule
from logra_lightning.rl.throughput import ModelDims, measure_peak_flops, training_dtype

# the policy is the warmed-up builtin:arithmetic-tiny, which the fixture builds once (conftest: the run order)
pytestmark = pytest.mark.usefixtures("tiny_policy_path")


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
@pytest.mark.parametrize("tied", [True, False])
def test_model_dims_count_the_decoder_matmuls_and_the_head(architecture, tied):
    h, i, layers, heads, kv, vocab = 64, 96, 3, 4, 2, 200
    cfg = tiny_hf_config(
        architecture,
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=i,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        eos_token_id=1,
        pad_token_id=0,
    )
    dims = ModelDims.of(AutoModelForCausalLM.from_config(cfg))
    kv_width = kv * (h // heads)
    per_layer = 2 * h * h + 2 * kv_width * h + 3 * h * i  # q, o; k, v; gate, up, down
    assert dims == ModelDims(matmul_params=layers * per_layer, head_params=vocab * h, layers=layers, attention_width=h)


def test_training_flops_frozen_weights_skip_their_gradients():
    dims = ModelDims(matmul_params=10, head_params=3, layers=1, attention_width=2)
    attention = 6 * 1 * 2 * (4 * 4)
    assert dims.training_flops([4], 2) == 6 * (10 * 4 + 3 * 2) + attention
    assert dims.training_flops([4], 2, weight_grads=False) == 4 * (10 * 4 + 3 * 2) + attention


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("bf16-mixed", torch.bfloat16), ("bf16-true", torch.bfloat16), ("16-mixed", torch.float16),
     ("32-true", torch.float32), ("64-true", torch.float64), (None, torch.float32)],
)  # fmt: skip
def test_training_dtype_follows_lightning_precision(precision, dtype):
    assert training_dtype(precision, torch.float32) is dtype


def test_the_peak_probe_runs_in_its_own_dtype_inside_autocast(monkeypatch):
    # the first step measures the peak inside Lightning's autocast, which would run a float32 probe in bf16
    dtypes, matmul = [], torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: dtypes.append((out := matmul(a, b)).dtype) or out)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measure_peak_flops(torch.float32, size=32, seconds=0.0)
    assert dtypes and set(dtypes) == {torch.float32}


def tiny_module(**kwargs) -> PolicyGradientModule:
    return PolicyGradientModule(
        "builtin:arithmetic-tiny",
        optimizer=partial(LoGRA, lr=1e-3, rank=8),
        group_size=4,
        max_new_tokens=5,
        sampling_seed=0,
        **kwargs,
    )


class Metrics(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def test_bf16_mixed_compiled_eager_attention_trains_and_reports_mfu():
    """The real-model configs' speed settings on the built-in policy: LoGRA moves the weights, which stay fp32,
    and perf/mfu is the training phase's FLOPs over the measured peak."""
    module = tiny_module(attn_implementation="eager", compile=True, micro_batch_size=8)
    metrics = Metrics()
    trainer = L.Trainer(
        max_steps=2,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[metrics],
    )
    module.setup("fit")
    assert module.policy.config._attn_implementation == "eager"
    start = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    trainer.fit(module, PromptDataModule(ArithmeticSource("train"), None, batch_size=4))
    moved = [n for n, p in module.policy.named_parameters() if not torch.equal(p, start[n])]
    assert moved and all(p.dtype == torch.float32 for p in module.policy.parameters())
    assert len(metrics.steps) == 2
    for step in metrics.steps:
        peak = step["perf/peak_tflops"] * 1e12
        flops = step["perf/mfu"] * peak * step["perf/time/forward_backward"]
        # 16 sequences of the step: FLOPs at least 6 * decoder matmul weights * tokens (one token each at least)
        assert flops >= 6 * module._dims.matmul_params * 16
        assert 0 < step["perf/mfu"] < 1


def test_bad_attention_kernel_names_the_key():
    module = tiny_module(attn_implementation="no_such_kernel")
    with pytest.raises(ConfigError, match=r"model.attn_implementation='no_such_kernel'"):
        module.setup("fit")


def test_compile_on_several_processes_is_refused_before_a_model_is_built():
    module = tiny_module(compile=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    module.trainer = trainer
    with pytest.raises(ConfigError, match=r"model.compile=true is supported on one process only"):
        module.setup("fit")
    assert module.policy is None


def test_peak_flops_must_be_positive():
    with pytest.raises(ConfigError, match=r"model.peak_flops=0"):
        tiny_module(peak_flops=0)
