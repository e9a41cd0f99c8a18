"""Every supported architecture: tiny local model, LoGRA steps, low-rank syncs into vLLM, drift <= 1e-4.

Each case runs :func:`benchmarks.architectures.run_arch` (a real ``PolicyGradientModule``
fit with LoGRA, a vLLM CPU engine and ``LowRankWeightSync``; about 40-60 s each here, most
of it vLLM's start-up). ``make test`` runs the two families whose names or layouts differ
most from the trainer's (Phi-3: HF-fused projections; Qwen3-MoE: 3-D experts, fused again by
vLLM); ``make test-all`` runs all seven. The recorded numbers: ``benchmarks/results/architectures.json``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from logra_lightning.errors import ConfigError
from logra_lightning.models import TinyModelConfig, build_tiny_model, load_policy
from logra_lightning.models.architectures import ARCHITECTURES, tiny_hf_config, untested_warning
from logra_lightning.optim import LoGRA
from logra_lightning.optim.groups import logra_param_groups
from logra_lightning.rollout.base import LowRankUpdate
from logra_lightning.rollout.checkpoint_names import CheckpointNames

ROOT = Path(__file__).resolve().parents[1]


HAS_VLLM = importlib.util.find_spec("vllm") is not None
FAST = ("phi3", "qwen3_moe")
DRIFT_LIMIT = 1e-4


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("archs")
    return {a: build_tiny_model(root / a, TinyModelConfig(architecture=a, num_layers=2)) for a in ARCHITECTURES}


# ------------------------------------------------------------------------- no engine
def test_every_family_builds_and_round_trips_through_the_checkpoint(tiny_dirs):
    """Saved and reloaded, each tiny model has the class, and the checkpoint layout CheckpointNames predicts."""
    from safetensors.torch import load_file

    for arch, path in tiny_dirs.items():
        model, _ = load_policy(path)
        assert type(model).__name__ == ARCHITECTURES[arch].hf_class
        names, saved = CheckpointNames(model), load_file(f"{path}/model.safetensors")
        converted = {n: t for name, p in model.named_parameters() for n, t in names.dense(name, p.detach())}
        assert converted.keys() == saved.keys(), arch
        assert all(torch.equal(converted[k], saved[k]) for k in saved), arch
        assert names.identity == (arch != "qwen3_moe")


def test_moe_lowrank_update_becomes_per_expert_checkpoint_updates(tiny_dirs):
    model, _ = load_policy(tiny_dirs["qwen3_moe"])
    names = CheckpointNames(model)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    w = dict(model.named_parameters())[name].detach()  # [E, 2I, H]
    g = torch.Generator().manual_seed(0)
    left, right = torch.randn(w.shape[0] * w.shape[1], 3, generator=g), torch.randn(3, w.shape[2], generator=g)
    new = dict(names.dense(name, (0.9 * w.reshape(-1, w.shape[2]) + left @ right).reshape(w.shape)))
    old = dict(names.dense(name, w))
    pieces = names.update(LowRankUpdate(name, 0.9, left, right))
    assert len(pieces) == 2 * w.shape[0]  # gate and up of every expert
    for u in pieces:
        torch.testing.assert_close(0.9 * old[u.name] + u.left @ u.right, new[u.name])


def test_param_groups_sketch_attention_mlp_experts_and_embeddings(tiny_dirs):
    for arch, path in tiny_dirs.items():
        model, _ = load_policy(path)
        groups = logra_param_groups(model, rank=4)
        lowrank = {n for g in groups if g.get("rank") for n in g["param_names"]}
        right = {n for g in groups if g.get("side") == "right" for n in g["param_names"]}
        dense = {n for g in groups if not g.get("rank") for n in g["param_names"]}
        assert "model.embed_tokens.weight" in right and "model.layers.0.self_attn.o_proj.weight" in lowrank, arch
        assert all(p.ndim == 1 or ".mlp.gate." in n for n, p in model.named_parameters() if n in dense), arch
        if arch == "qwen3_moe":
            assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"} <= right
            assert "model.layers.0.mlp.gate.weight" in dense  # the router stays dense
        if arch == "phi3":
            assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= lowrank


def test_logra_steps_on_3d_experts_match_their_recorded_factors(tiny_dirs):
    model, tok = load_policy(tiny_dirs["qwen3_moe"])
    opt = LoGRA(logra_param_groups(model, rank=4, update_proj_gap=2), lr=1e-2, weight_decay=0.01)
    opt.record_updates = True
    ids = torch.tensor([tok.encode("12+34=46"), tok.encode("51+17=68")])
    for _ in range(3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        params = dict(model.named_parameters())
        (updates,) = opt.pop_applied_updates()
        experts = [u for u in updates if params[u.name].ndim == 3]
        assert len(experts) == 4  # gate_up and down of both layers
        for u in updates:
            w0 = before[u.name].reshape(-1, before[u.name].shape[-1])
            torch.testing.assert_close(params[u.name].detach().reshape(w0.shape), u.c * w0 + u.left @ u.right)


def test_unknown_families_are_named():
    """An untested class is warned about (the engine's placement check is what refuses); a tiny build refuses."""
    assert "'GPT2LMHeadModel' has not been tested" in untested_warning("GPT2LMHeadModel")
    assert all(untested_warning(a.hf_class) is None for a in ARCHITECTURES.values())
    with pytest.raises(ConfigError, match="architecture='bert'"):
        tiny_hf_config(
            "bert",
            vocab_size=128,
            hidden_size=128,
            intermediate_size=256,
            num_layers=1,
            num_heads=2,
            num_kv_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            eos_token_id=1,
            pad_token_id=0,
        )


# ------------------------------------------------------------------ through vLLM
def _cases():
    for arch in ARCHITECTURES:
        marks = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")]
        if arch not in FAST:
            marks.append(pytest.mark.slow)
        yield pytest.param(arch, marks=marks, id=arch)


@pytest.mark.parametrize("arch", list(_cases()))
def test_lowrank_syncs_keep_vllm_on_the_trained_policy(arch, tmp_path):
    from benchmarks.architectures import run_arch

    rec = run_arch(arch, tmp_path, steps=3)
    assert rec["engine_init"]["unplaced"] == [] and rec["engine_init"]["model_class"] == ARCHITECTURES[arch].hf_class
    assert rec["full_syncs"] == 1 and rec["lowrank_syncs"] == 3 and rec["skipped_steps"] == 0
    assert rec["relative_weight_change_max"] > 1e-3, "the policy barely moved: the drift check would mean nothing"
    assert rec["drift_max"] <= DRIFT_LIMIT, rec
    assert rec["lowrank_sync_share"] < 0.5
    if arch == "qwen3_moe":
        assert rec["lowrank_3d_params"] == 4
