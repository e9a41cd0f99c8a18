"""LoRA (PEFT) through ``logra fit``: the low-rank update of a merged weight, names, exports, start-up errors.

The unit tests use a real PEFT-wrapped tiny Qwen2; the end-to-end test runs ``cli.run(["fit", ...])``
with LoRA on the warmed-up tiny policy and the real vLLM CPU engine kept in sync by the low-rank
updates (engine-vs-trainer drift <= 1e-4), exports the run and loads the export in plain transformers.

Run: ``.venv/bin/python -m pytest tests/test_lora.py -q`` (about 1-2 min; ``-m slow`` adds vLLM
loading the export and a run with KL step control).
"""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import conftest  # tests/conftest.py
import pytest
import torch
from conftest import hf_greedy_answers, tiny_run, vllm_greedy_answers
from safetensors.torch import load_file

from logra_lightning.cli import run
from logra_lightning.errors import ConfigError
from logra_lightning.models.lora import LoRA, base_param_name, lora_delta_factors, merge_lora_state_dict

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "arithmetic_tiny_lora.yaml")
HAS_VLLM = importlib.util.find_spec("vllm") is not None
PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3, 40, 7) for b in range(1, 60, 9)]  # 42


def tiny_qwen2(seed: int = 0):
    return conftest.tiny_qwen2(seed, tie_word_embeddings=False)


def merged(policy, lora: LoRA) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in lora.merged_state_dict(dict(policy.named_parameters())).items()}


def test_delta_factors_are_the_merged_weight_change():
    g = torch.Generator().manual_seed(0)
    a0, b0, a1, b1 = (torch.randn(*s, generator=g, dtype=torch.float64) for s in [(3, 7), (5, 3), (3, 7), (5, 3)])
    left, right = lora_delta_factors(a0, b0, a1, b1, 0.25)
    assert left.shape == (5, 6) and right.shape == (6, 7)
    torch.testing.assert_close(left @ right, 0.25 * (b1 @ a1 - b0 @ a0), rtol=0, atol=1e-12)


def test_optimizer_updates_equal_the_merged_weight_difference():
    """Three AdamW steps on a real PEFT policy: base + sum of popped updates == merged weights after, to 1e-6."""
    lora = LoRA(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    policy = lora.attach(tiny_qwen2())
    opt = lora.wrap_optimizer(
        torch.optim.AdamW([(n, p) for n, p in policy.named_parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    )
    opt.record_updates = True
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    before = merged(policy, lora)
    for _step in range(3):
        opt.zero_grad()
        policy(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    steps = opt.pop_applied_updates()
    assert [len(s) for s in steps] == [6, 0, 0] and opt.pop_applied_updates() == []  # 2 layers x 3 modules, once
    after = merged(policy, lora)
    for u in steps[0]:
        name = base_param_name(u.name)
        assert u.c == 1.0 and u.left.shape[1] == 8 and u.right.shape == (8, before[name].shape[1])
        torch.testing.assert_close(before[name] + u.left @ u.right, after[name], rtol=0, atol=1e-6)
        assert (after[name] - before[name]).abs().max() > 1e-4  # the weights moved: the check above can fail
    # PEFT's own delta agrees with the merge
    layer = policy.model.layers[1].self_attn.v_proj
    w0 = layer.base_layer.weight.detach()
    torch.testing.assert_close(after["model.layers.1.self_attn.v_proj.weight"], w0 + layer.get_delta_weight("default"))
    assert opt.dense_param_names() == [] and opt.row_shard(layer.base_layer.weight) is None


def test_merged_state_dict_is_a_plain_model_with_the_same_outputs():
    lora = LoRA(
        rank=2, alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    policy = lora.attach(tiny_qwen2())
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # B starts at 0: make the adapter matter
    plain = tiny_qwen2(seed=1)
    state = lora.merged_state_dict(policy.state_dict())
    assert set(state) == set(plain.state_dict())
    plain.load_state_dict(state, strict=True)
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, policy(ids).logits, rtol=1e-5, atol=1e-5)
        base_only = tiny_qwen2()(ids).logits
    assert (base_only - policy(ids).logits).abs().max() > 1e-3
    # get_peft_model's names (with "base_model.model.") merge to the same thing
    prefixed = {f"base_model.model.{k}": v for k, v in policy.state_dict().items()}
    assert all(torch.equal(merge_lora_state_dict(prefixed, 2.0)[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="need A, B and the base"):
        merge_lora_state_dict({"x.lora_A.default.weight": torch.zeros(1, 2)}, 1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=0), r"model.adapter.init_args.rank=0: allowed integers >= 1"),
        (dict(alpha=-1), r"alpha=-1: allowed numbers > 0"),
        (dict(dropout=1.0), r"dropout=1.0: allowed values in \[0, 1\)"),
        (dict(target_modules=[]), r"target_modules=\[\]: allowed a non-empty list"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LoRA(**kwargs)


def test_target_modules_that_match_nothing_or_are_not_linear():
    with pytest.raises(ConfigError, match=r"target_modules=\['qq_proj'\]"):
        LoRA(target_modules=["qq_proj"]).attach(tiny_qwen2())
    with pytest.raises(ConfigError, match="embed_tokens is a Embedding, not a linear layer"):
        LoRA(target_modules=["embed_tokens"]).attach(tiny_qwen2())


# ------------------------------------------------------------- end to end, real vLLM
def _scalars(log_dir: str) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_policy_path) -> types.SimpleNamespace:
    """``logra fit`` of the LoRA config for 4 steps with vLLM, exported at the end, plus a .ckpt of it."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    tmp = tmp_path_factory.mktemp("lora_run")
    cli = run(
        [
            "fit",
            "--config",
            CONFIG,
            *tiny_run(tmp, 4, batch_size=8, group_size=None),
            "--data.val.init_args.test_size",
            "16",
            "--model.optimizer.init_args.lr",
            "3e-3",
            "--export",
            str(tmp / "export"),
        ]
    )
    ckpt = tmp / "final.ckpt"
    cli.trainer.save_checkpoint(ckpt)
    policy, tok = cli.model.policy.eval(), cli.model.tokenizer
    sync = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "LowRankWeightSync")
    return types.SimpleNamespace(
        tmp=tmp,
        export=tmp / "export",
        ckpt=ckpt,
        policy=policy,
        tok=tok,
        sync=sync,
        scalars=_scalars(cli.trainer.log_dir),
        merged=cli.model.adapter.merged_state_dict(policy.state_dict()),
        answers=hf_greedy_answers(policy, tok, [r["prompt"] for r in PROMPTS]),
    )


@pytest.mark.vllm
def test_vllm_engine_follows_the_merged_policy(lora_run, tiny_policy_path):
    s = lora_run.scalars
    assert lora_run.sync.full_syncs == 1 and lora_run.sync.lowrank_syncs == 4
    drift = s["sync/logprob_abs_diff_max"]
    assert len(drift) == 4 and max(drift) <= 1e-4, drift
    low_rank_bytes = s["sync/bytes"][-1]  # rank-2r factors of 7 matrices x layers
    assert low_rank_bytes < 0.5 * s["sync/dense_bytes"][-1]
    base = load_file(Path(tiny_policy_path) / "model.safetensors")
    moved = max((lora_run.merged[k] - v).abs().max().item() for k, v in base.items() if k in lora_run.merged)
    assert moved > 1e-4, "the policy did not move: the drift check above would pass trivially"


@pytest.mark.vllm
def test_export_of_a_lora_run_is_a_plain_model(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    exported = load_file(lora_run.export / "model.safetensors")
    assert not any("lora" in k or "base_layer" in k for k in exported)
    assert set(exported) == set(lora_run.merged) and all(torch.equal(exported[k], lora_run.merged[k]) for k in exported)
    model = AutoModelForCausalLM.from_pretrained(lora_run.export)  # plain transformers, no peft, no logra code
    assert hf_greedy_answers(model, lora_run.tok, [r["prompt"] for r in PROMPTS]) == lora_run.answers
    # logra export from the checkpoint merges the same way
    assert run(["export", "--ckpt_path", str(lora_run.ckpt), "--out", str(tmp_path / "out")]) == 0
    again = load_file(tmp_path / "out" / "model.safetensors")
    assert set(again) == set(exported) and all(torch.equal(again[k], exported[k]) for k in again)
    hp = torch.load(lora_run.ckpt, weights_only=True)["hyper_parameters"]["adapter"]
    assert hp == {
        "class_path": "logra_lightning.models.LoRA",
        "init_args": {
            "rank": 16,
            "alpha": 32.0,
            "dropout": 0.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        },
    }


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_loads_the_lora_export(lora_run):
    answers = vllm_greedy_answers(lora_run.export, [r["prompt"] for r in PROMPTS])
    assert answers == lora_run.answers


@pytest.mark.slow
def test_lora_with_kl_control_and_resume(tmp_path, tiny_policy_path):
    """KLStepControl rescales LoRA steps (snapshot path); an HF engine with its own copy stays in sync; resume works."""
    control = json.dumps(
        [
            {
                "class_path": "logra_lightning.callbacks.KLStepControl",
                "init_args": {"target_kl": 1e-4, "measure_every": 1},
            },
            {"class_path": "logra_lightning.callbacks.LowRankWeightSync"},
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"save_last": True, "every_n_train_steps": 2},
            },
        ]
    )
    common = [
        "--config",
        CONFIG,
        "--model.engine",
        "logra_lightning.rollout.HFEngineSpec",
        "--model.engine.copy_weights",
        "true",
        "--trainer.callbacks",
        control,
        "--trainer.val_check_interval",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--data.val.init_args.test_size",
        "16",
        "--data.batch_size",
        "8",
        "--model.optimizer.init_args.lr",
        "3e-2",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
    ]
    cli = run(["fit", *common, "--trainer.max_steps", "4"])
    s = _scalars(cli.trainer.log_dir)
    assert max(s["sync/logprob_abs_diff_max"]) <= 1e-4
    assert min(s["kl/step_scale"]) < 1.0  # lr 3e-2 is far above the target: the control scaled the steps
    resumed = run(["fit", *common, "--trainer.max_steps", "6", "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 6 and isinstance(resumed.model.adapter, LoRA)
    assert max(_scalars(resumed.trainer.log_dir)["sync/logprob_abs_diff_max"]) <= 1e-4
