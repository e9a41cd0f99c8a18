"""`logra plan`: its formulas against real tensors, the CLI, and its error messages.

The exact-accounting tests build small real HF models from configs, take one real step with
``torch.optim.AdamW`` or LoGRA, and compare the planner's parameter / gradient / optimizer-state
bytes with the sums over the actual tensors (target 2%; they agree to the byte), on one process
and per rank on a real 2-process FSDP2 run (gloo, ~10 s). Saved activations are counted tensor
by tensor with ``saved_tensors_hooks``. Peak memory against measured RSS lives in
``benchmarks/real_shapes_memory.py`` (and, across three sizes, in the archived ``plan_vs_measured`` results).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from ranks import init_gloo, spawn_ranks
from transformers import AutoConfig, AutoModelForCausalLM

from logra_lightning.models.shapes import architecture_from_config, load_architecture, shipped_shapes
from logra_lightning.optim import LoGRA, logra_param_groups
from logra_lightning.plan import (
    PlanError,
    PlanSetup,
    engine_bytes,
    layer_activation_bytes,
    main,
    plan,
    plan_optimizer,
    saved_activation_bytes,
)
from logra_lightning.plan.optimizers import _lowrank_layout

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
FAMILIES = {
    "qwen2_tied": dict(BASE, model_type="qwen2", tie_word_embeddings=True),
    "qwen2_untied": dict(BASE, model_type="qwen2", tie_word_embeddings=False),
    "llama_biases": dict(BASE, model_type="llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    "qwen3_head_dim": dict(BASE, model_type="qwen3", head_dim=32, tie_word_embeddings=True),
    "mistral_window": dict(BASE, model_type="mistral", sliding_window=16, tie_word_embeddings=False),
    "gemma3_text": dict(BASE, model_type="gemma3_text", head_dim=16, sliding_window=16, tie_word_embeddings=True),
    # Phi-3's default pad/bos/eos ids (32000, 1, 32000) are outside the tiny vocabulary
    "phi3": dict(BASE, model_type="phi3", tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "qwen3_moe": dict(
        BASE,
        model_type="qwen3_moe",
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        tie_word_embeddings=False,
    ),
}


def _matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """What LoGRA sees: a 3-D expert weight ``[E, m, n]`` is one ``[E * m, n]`` matrix."""
    return math.prod(shape[:-1]), shape[-1]


def _build(cfg: dict, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    torch.manual_seed(0)
    config = AutoConfig.for_model(cfg["model_type"], **kwargs, use_cache=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype).train()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: 1 thread is much faster on the shared 2 cores
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------ shapes vs real models
@pytest.mark.parametrize("family", FAMILIES)
def test_param_count_and_lowrank_split_match_the_real_model(family):
    cfg = FAMILIES[family]
    model = _build(cfg)
    arch = architecture_from_config(cfg)
    assert arch.num_params() == sum(p.numel() for p in model.parameters())
    lowrank = [g for g in logra_param_groups(model, rank=4) if g.get("rank")]
    got = sorted(_matrix_shape(p.shape) for g in lowrank for p in g["params"])
    want = sorted((m.rows, m.cols) for m in arch.matrices() for _ in range(m.count))
    assert got == want


@pytest.mark.parametrize("family", FAMILIES)
def test_matrix_and_router_names_and_shapes_match_named_parameters(family):
    """Every >= 2-D HF parameter is one of ``matrices()`` (by name and shape) or a dense router in ``vectors()``."""
    cfg = FAMILIES[family]
    model = _build(cfg)
    arch = architecture_from_config(cfg)
    got = Counter(
        (re.sub(r"\.\d+\.", ".*.", n), _matrix_shape(p.shape)) for n, p in model.named_parameters() if p.ndim >= 2
    )
    want = Counter({(m.name, (m.rows, m.cols)): m.count for m in arch.matrices()})
    names = {m.name for m in arch.matrices()}
    assert Counter({k: v for k, v in got.items() if k[0] in names}) == want
    dense = {n: (size, count) for n, size, count, _ in arch.vectors()}
    rest = {name: (math.prod(shape), count) for (name, shape), count in got.items() if name not in names}
    assert rest == {n: dense[n] for n in rest}
    assert bool(rest) == (family == "qwen3_moe")  # only the MoE router is a dense matrix


@pytest.mark.parametrize("optimizer", ["adamw", "logra"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-true"])
@pytest.mark.parametrize("family", ["qwen2_tied", "qwen2_untied", "llama_biases", "phi3", "qwen3_moe"])
def test_param_grad_state_bytes_match_tensors_after_a_real_step(optimizer, precision, family):
    cfg = FAMILIES[family]
    model = _build(cfg, torch.bfloat16 if precision == "bf16-true" else torch.float32)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = LoGRA(logra_param_groups(model, rank=8, update_proj_gap=10), lr=1e-3)
    ids = torch.randint(0, cfg["vocab_size"], (2, 16))
    logits = model(input_ids=ids).logits
    torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).mean().backward()
    params = list(model.parameters())
    grads = sum(_nbytes(p.grad) for p in params if p.grad is not None)
    opt.step()
    state = sum(_nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))

    setup = PlanSetup(gpus=1, rank=8, batch=2, seq_len=16, precision=precision, reserve_gb=0)
    pred = plan_optimizer(architecture_from_config(cfg), setup, optimizer)["phases"]["optimizer_step"]
    assert pred["params"] == pytest.approx(sum(map(_nbytes, params)), rel=0.02)
    assert pred["grads"] == pytest.approx(grads, rel=0.02)
    assert pred["optimizer_state"] == pytest.approx(state, rel=0.02)
    if optimizer == "logra":  # low-rank gradients were sketched and freed in backward
        assert grads < 0.05 * sum(map(_nbytes, params))


@pytest.mark.parametrize("precision", ["fp32", "bf16-true"])
@pytest.mark.parametrize("family", ["qwen2_tied", "qwen3_head_dim", "gemma3_text", "phi3", "qwen3_moe"])
def test_saved_activation_formula_matches_autograd(precision, family):
    """Every tensor autograd saves in forward (no checkpointing), counted once per storage."""
    cfg = FAMILIES[family]
    model = _build(cfg, torch.bfloat16 if precision == "bf16-true" else torch.float32)
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    batch, seq = 2, 32
    ids = torch.randint(0, cfg["vocab_size"], (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    setup = PlanSetup(batch=batch, seq_len=seq, precision=precision)
    arch = architecture_from_config(cfg)
    predicted = saved_activation_bytes(arch, setup, checkpointing=False)
    predicted += batch * seq * 4 * cfg["vocab_size"]  # the saved fp32 log-softmax output
    if family == "gemma3_text":  # sliding windows make HF's SDPA build a mask and repeat the KV heads
        predicted += batch * seq * arch.num_layers * 2 * setup.compute_bytes * (arch.q_dim - arch.kv_dim)
    assert predicted == pytest.approx(sum(seen.values()), rel=0.03)


# --------------------------------------------------------------------------------- shipped shapes
@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("qwen2.5-0.5b", 0.494),
        ("qwen2.5-7b", 7.616),
        ("gemma-3-27b", 27.01),
        ("llama-3-8b", 8.03),
        ("qwen3-8b", 8.19),
        ("mistral-7b", 7.25),
        ("qwen3-30b-a3b", 30.5),
        ("phi-3-mini", 3.82),
    ],
)
def test_shipped_shapes_have_the_published_sizes(name, billions):
    assert name in shipped_shapes()
    assert load_architecture(name).num_params() / 1e9 == pytest.approx(billions, rel=0.005)


def test_moe_plan_counts_every_expert_and_sketches_experts_on_the_right():
    arch = load_architecture("qwen3-30b-a3b")
    experts = [m for m in arch.matrices() if m.expert]
    assert [(m.rows, m.cols) for m in experts] == [(128 * 2 * 768, 2048), (128 * 2048, 768)]
    active = arch.num_params() - sum(m.rows * m.cols * m.count for m in experts) * (1 - 8 / 128)
    assert active / 1e9 == pytest.approx(3.3, rel=0.02)  # "A3B": ~3.3B active per token
    r = 256
    for m in experts:  # rows > cols, yet right: basis [n, r], exp_avg [E m, r], second moment [E m] + [r]
        lay = _lowrank_layout(m, r, r + 8, 1)
        assert (lay["basis"], lay["exp_avg"], lay["second"]) == (m.cols * r, m.rows * r, m.rows + r)
        assert _lowrank_layout(m, r, r + 8, 1, "full")["second"] == m.rows * r
    weights, _ = engine_bytes(arch, PlanSetup(colocate_engine=True, rank=r))
    assert weights == 2 * arch.num_params()  # the engine holds all 128 experts in bf16
    # activations follow k * moe_intermediate_size, not the (unused) dense intermediate_size
    wider = architecture_from_config(
        dict(json.loads(Path(_shape_file("qwen3-30b-a3b")).read_text()), intermediate_size=99999)
    )
    assert layer_activation_bytes(wider, 2) == layer_activation_bytes(arch, 2)
    assert wider.num_params() == arch.num_params()


def test_moe_logra_state_prediction_matches_the_optimizer_with_right_sketched_experts():
    cfg = FAMILIES["qwen3_moe"]
    model = _build(cfg)
    opt = LoGRA(logra_param_groups(model, rank=8, update_proj_gap=10), lr=1e-3)
    ids = torch.randint(0, cfg["vocab_size"], (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # the dense group's AdamW state exists after the first step
    names = {id(p): n for n, p in model.named_parameters()}
    experts = {names[id(p)]: st for p, st in opt.state.items() if p.ndim == 3}
    assert len(experts) == 2 * cfg["num_hidden_layers"]
    for name, st in experts.items():
        e, m, n = model.get_parameter(name).shape
        assert tuple(st["basis"].shape) == (n, 8)  # right: Q is [n, r], shared by the experts
        assert tuple(st["exp_avg"].shape) == (e * m, 8)
    arch = architecture_from_config(cfg)
    pred = plan_optimizer(arch, PlanSetup(rank=8, precision="fp32", reserve_gb=0), "logra")
    state = sum(_nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    assert pred["phases"]["optimizer_step"]["optimizer_state"] == state


def test_sharding_divides_params_and_logra_state_by_gpus():
    arch = load_architecture("qwen2.5-7b")
    one, eight = (plan(arch, PlanSetup(gpus=n, rank=128)) for n in (1, 8))
    for opt in ("adamw", "logra"):
        p1, p8 = (r["optimizers"][opt]["phases"]["optimizer_step"] for r in (one, eight))
        assert p8["params"] == pytest.approx(p1["params"] / 8, rel=1e-3)
        assert p8["optimizer_state"] < p1["optimizer_state"] / 2
    adamw, logra = (eight["optimizers"][k]["phases"]["optimizer_step"] for k in ("adamw", "logra"))
    assert logra["optimizer_state"] < 0.2 * adamw["optimizer_state"]
    assert logra["grads"] < 0.001 * adamw["grads"]


def test_gemma_27b_on_8x80gb_headline():
    """The README numbers: bf16-mixed, checkpointing, 1 x 4096 tokens per GPU, rank 256."""
    arch = load_architecture("gemma-3-27b")
    base = dict(gpus=8, gpu_memory_gb=80, rank=256, batch=1, seq_len=4096, precision="bf16-mixed")
    whole = plan(arch, PlanSetup(**base, lm_head_chunk=0))["optimizers"]  # the logits held whole
    assert whole["adamw"]["fits"] and whole["logra"]["fits"]
    assert whole["adamw"]["peak_bytes"] / 2**30 == pytest.approx(66.9, abs=0.5)
    assert whole["logra"]["peak_bytes"] / 2**30 == pytest.approx(36.1, abs=0.5)
    alone = plan(arch, PlanSetup(**base))["optimizers"]  # chunked LM head (the default)
    assert alone["adamw"]["peak_bytes"] / 2**30 == pytest.approx(64.9, abs=0.5)
    assert alone["logra"]["peak_bytes"] / 2**30 == pytest.approx(27.1, abs=0.5)
    colocated = plan(arch, PlanSetup(**base, colocate_engine=True, engine_tp=4, rollout_batch=8))["optimizers"]
    assert not colocated["adamw"]["fits"] and colocated["logra"]["fits"]


def test_the_papers_setting_fits_for_logra_with_the_chunked_head(capsys):
    """``logra plan --model gemma-3-27b --gpus 8 --gpu-memory-gb 80 --rank 256 --batch 1 --seq-len 4096
    --precision bf16-mixed --colocate-engine``: the engine on every GPU (tp=1); whole logits do not fit."""
    args = "--model gemma-3-27b --gpus 8 --gpu-memory-gb 80 --rank 256 --batch 1 --seq-len 4096"
    args += " --precision bf16-mixed --colocate-engine --json"
    main(args.split())
    logra = json.loads(capsys.readouterr().out)["optimizers"]["logra"]
    assert logra["fits"] and logra["headroom_bytes"] / 2**30 == pytest.approx(1.9, abs=0.1)
    main([*args.split(), "--lm-head-chunk", "0"])
    whole = json.loads(capsys.readouterr().out)["optimizers"]["logra"]
    assert not whole["fits"] and whole["headroom_bytes"] / 2**30 == pytest.approx(-7.2, abs=0.1)


def test_token_budget_sets_the_tokens_per_micro_batch():
    """``--micro-batch-tokens``: as many whole sequences as fit, at least one; activations scale with them."""
    assert PlanSetup(batch=8, seq_len=1024, micro_batch_tokens=4096).tokens == 4096
    assert PlanSetup(batch=8, seq_len=1024, micro_batch_tokens=5000).tokens == 4096
    assert PlanSetup(batch=8, seq_len=1024, micro_batch_tokens=100).tokens == 1024  # one sequence runs alone
    assert PlanSetup(batch=2, seq_len=1024, micro_batch_tokens=1 << 20).tokens == 2048
    arch = load_architecture("qwen2.5-0.5b")
    full, half = (
        plan(arch, PlanSetup(batch=8, seq_len=1024, rank=64, micro_batch_tokens=b))["optimizers"]["logra"]
        for b in (None, 4096)
    )
    assert half["phases"]["layer_backward"]["activations"] * 2 == full["phases"]["layer_backward"]["activations"]
    with pytest.raises(PlanError, match="micro_batch_tokens=0"):
        PlanSetup(micro_batch_tokens=0)
    with pytest.raises(PlanError, match="lm_head_chunk=-1"):
        PlanSetup(lm_head_chunk=-1)


def test_allocator_slack_scales_the_training_tensors_only():
    """The slack is a fraction of the training tensors at each phase; engine and reserve are not scaled."""
    arch = load_architecture("qwen2.5-0.5b")
    base = dict(gpus=2, rank=64, seq_len=512, colocate_engine=True)
    live, slack = (plan(arch, PlanSetup(**base, allocator_slack=s))["optimizers"] for s in (0.0, 0.25))
    for opt in ("adamw", "logra"):
        for phase, parts in live[opt]["phases"].items():
            tensors = sum(v for k, v in parts.items() if k not in ("engine_weights", "kv_cache", "reserve", "total"))
            assert parts["allocator_slack"] == 0
            assert slack[opt]["phases"][phase]["allocator_slack"] == round(0.25 * tensors)
            assert slack[opt]["phases"][phase]["total"] == parts["total"] + round(0.25 * tensors)


# ------------------------------------------------------------------------------------------- CLI
def test_cli_json_and_table(capsys):
    assert main(["--model", "qwen2.5-7b", "--gpus", "8", "--rank", "128", "--seq-len", "1024", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["setup"]["gpus"] == 8 and result["model"]["params"] == load_architecture("qwen2.5-7b").num_params()
    logra, adamw = result["optimizers"]["logra"], result["optimizers"]["adamw"]
    assert logra["peak_bytes"] < adamw["peak_bytes"] and logra["fits"] is True
    assert set(logra["phases"]) == {
        "loss_backward",
        "head_backward",
        "layer_backward",
        "embedding_backward",
        "optimizer_step",
    }

    main(["--model", "gemma-3-27b", "--gpus", "8", "--gpu-memory-gb", "40", "--seq-len", "4096"])
    table = capsys.readouterr().out
    for text in ("AdamW", "LoGRA r=256", "optimizer state", "peak total", "fits in 40 GiB?", "OOM", "not checkpointed"):
        assert text in table


def test_cli_reads_a_local_hf_directory(tmp_path, capsys):
    from transformers import Qwen2Config

    cfg = {k: v for k, v in FAMILIES["qwen2_untied"].items() if k != "model_type"}
    Qwen2Config(**cfg).save_pretrained(tmp_path)  # a real config.json with all HF's extra keys
    main(["--model", str(tmp_path), "--rank", "8", "--json"])
    params = json.loads(capsys.readouterr().out)["model"]["params"]
    assert params == architecture_from_config(FAMILIES["qwen2_untied"]).num_params()


def test_default_rank_fits_small_models(capsys):
    main(["--model", "qwen2.5-0.5b", "--json"])  # k_proj is [128, 896]: 256 would be invalid
    assert json.loads(capsys.readouterr().out)["setup"]["rank"] == 128


def _shape_file(name: str) -> str:
    from importlib import resources

    return str(resources.files("logra_lightning.models.shapes").joinpath(f"{name}.json"))


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_reads_a_saved_config_of_every_family(tmp_path, capsys, family):
    """``logra plan --model <dir>`` on the config.json transformers writes (all its extra keys)."""
    cfg = FAMILIES[family]
    AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"}).save_pretrained(
        tmp_path
    )
    assert main(["--model", str(tmp_path), "--rank", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"]["model_type"] == cfg["model_type"]
    assert result["model"]["params"] == sum(p.numel() for p in _build(cfg).parameters())


@pytest.mark.parametrize("name", ["llama-3-8b", "qwen3-8b", "mistral-7b", "phi-3-mini", "qwen3-30b-a3b"])
def test_cli_plans_the_new_shipped_shapes(capsys, name):
    assert main(["--model", name, "--gpus", "8", "--seq-len", "4096"]) == 0
    table = capsys.readouterr().out
    assert table.startswith(f"{name}: {load_architecture(name).num_params() / 1e9:.2f}B params")
    assert ("128 experts, 8 per token" in table) == (name == "qwen3-30b-a3b")


def _write(tmp_path, family="qwen2_tied", **changes) -> str:
    cfg = dict(FAMILIES[family], **changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (lambda p: ["--model", _write(p, num_experts=8)], "num_experts=8"),
        (lambda p: ["--model", _write(p, moe_intermediate_size=64)], "moe_intermediate_size"),
        (lambda p: ["--model", _write(p, "qwen3_moe", decoder_sparse_step=2)], "decoder_sparse_step=2"),
        (lambda p: ["--model", _write(p, "qwen3_moe", mlp_only_layers=[0])], "mlp_only_layers=[0]"),
        (
            lambda p: ["--model", _write(p, "qwen3_moe", shared_expert_intermediate_size=64)],
            "shared_expert_intermediate_size=64",
        ),
        (lambda p: ["--model", _write(p, "qwen3_moe", model_type="qwen2_moe")], "its shared experts are not modelled"),
        (lambda p: ["--model", _write(p, "qwen3_moe", num_experts_per_tok=8)], "num_experts_per_tok=8"),
        (lambda p: ["--model", _write(p, "qwen3_moe", num_experts=None)], "'num_experts' is missing"),
        (lambda p: ["--model", _write(p, "phi3", num_experts=4)], "num_experts=4"),
        (lambda p: ["--model", _write(p, hidden_size=None)], "'hidden_size' is missing"),
        (lambda p: ["--model", _write(p, num_hidden_layers=0)], "num_hidden_layers=0"),
        (lambda p: ["--model", _write(p, model_type="mamba")], "model_type='mamba'"),
        (lambda p: ["--model", _write(p, num_key_value_heads=3)], "num_key_value_heads=3"),
        (lambda p: ["--model", "qwen2.5-7b", "--gpus", "0"], "gpus=0"),
        (lambda p: ["--model", "qwen2.5-0.5b", "--rank", "1024"], "rank=1024 is larger than min(m, n)=128 of"),
        (lambda p: ["--model", "qwen2.5-0.5b", "--rank", "200"], "k_proj"),
        (lambda p: ["--model", "qwen2.5-7b", "--batch", "0"], "batch=0"),
        (lambda p: ["--model", "qwen2.5-7b", "--allocator-slack", "-0.1"], "allocator_slack=-0.1"),
        (lambda p: ["--model", "qwen2.5-7b", "--colocate-engine", "--engine-tp", "3", "--gpus", "8"], "engine_tp=3"),
        (lambda p: ["--model", "no-such-model"], "qwen2.5-0.5b"),
        (lambda p: ["--model", str(p)], "without config.json"),
    ],
)
def test_invalid_inputs_exit_2_naming_the_field(tmp_path, capsys, args, expected):
    with pytest.raises(SystemExit) as exc:
        main(args(tmp_path))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "logra plan: error:" in err and expected in err


def test_per_rank_bytes_match_a_real_fsdp2_run(tmp_path):
    """Two gloo processes shard a tiny Qwen2 (uneven rows) with FSDP2 and take one real step."""

    cfg = dict(FAMILIES["qwen2_untied"], vocab_size=301, intermediate_size=150)
    spawn_ranks(_fsdp2_worker, (cfg, str(tmp_path)), nprocs=2)
    arch = architecture_from_config(cfg)
    got = json.loads((tmp_path / "rank0.json").read_text())  # rank 0 holds ceil(m / 2) rows: the most
    for opt in ("adamw", "logra"):
        pred = plan_optimizer(arch, PlanSetup(gpus=2, rank=8, precision="fp32"), opt)["phases"]["optimizer_step"]
        assert [pred["params"], pred["grads"], pred["optimizer_state"]] == got[opt]


def _fsdp2_worker(rank: int, cfg: dict, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from logra_lightning.models.fsdp import shard_policy
    from logra_lightning.optim import grad_bytes, optimizer_state_bytes, param_bytes

    torch.set_num_threads(1)
    init_gloo(rank, 2, out)
    mesh = init_device_mesh("cpu", (2,))
    result = {}
    for opt_name in ("adamw", "logra"):
        model = shard_policy(_build(cfg), mesh)
        if opt_name == "adamw":
            opt = torch.optim.AdamW(model.parameters())
        else:
            opt = LoGRA(logra_param_groups(model, rank=8, update_proj_gap=10), lr=1e-3)
        ids = torch.randint(0, cfg["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids, labels=ids).loss.backward()
        grads = grad_bytes(model)
        opt.step()
        result[opt_name] = [param_bytes(model), grads, optimizer_state_bytes(opt)]
    if rank == 0:
        (Path(out) / "rank0.json").write_text(json.dumps(result))


def test_plan_errors_are_value_errors():
    with pytest.raises(ValueError, match="precision='fp16'"):
        PlanSetup(precision="fp16")
    assert issubclass(PlanError, ValueError)
