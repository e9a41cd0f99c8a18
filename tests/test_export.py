"""The trained policy as a Hugging Face directory: ``logra fit --export`` and ``logra export``, round trips.

One short ``logra fit`` (2 RL steps on the raw built-in tiny policy, HF engine) exports at the end
of fit and leaves a ``.ckpt``; the tests check that the exported directory holds the trainer's
exact weights, that transformers and a real vLLM CPU engine load it as it is and give the
trainer's greedy answers, that ``logra export`` writes the same directory from the ``.ckpt`` and
from a distributed (FSDP2-format) checkpoint, and that bad paths fail with one clear line.

Run: ``.venv/bin/python -m pytest tests/test_export.py -q`` (about 1 min; the vLLM test starts one
engine, 20-50 s on CPU). ``-m slow`` adds the export of a real 2-process FSDP2 run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import types
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy_answers, tiny_run, vllm_greedy_answers  # tests/conftest.py
from safetensors.torch import load_file

from logra_lightning.cli import run as logra
from logra_lightning.errors import ConfigError
from logra_lightning.io.export import MARKER, export_checkpoint, read_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "arithmetic_tiny_adamw.yaml")
HAS_VLLM = importlib.util.find_spec("vllm") is not None
FILES = {
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER,
}
PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3, 40, 7) for b in range(1, 60, 9)]  # 42


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> types.SimpleNamespace:
    """``logra fit --export`` for 2 steps; the trainer's policy, its greedy answers and a .ckpt of it."""
    tmp = tmp_path_factory.mktemp("export_run")
    cli = logra(
        [
            "fit",
            "--config",
            CONFIG,
            "--model.model",
            "builtin:arithmetic-tiny-raw",
            *tiny_run(tmp),
            "--data.val.init_args.test_size",
            "16",
            "--export",
            str(tmp / "export"),
        ]
    )
    ckpt = tmp / "final.ckpt"
    cli.trainer.save_checkpoint(ckpt)
    bar = cli.trainer.progress_bar_callback.train_progress_bar
    policy, tok = cli.model.policy.eval(), cli.model.tokenizer
    return types.SimpleNamespace(
        tmp=tmp,
        export=tmp / "export",
        ckpt=ckpt,
        policy=policy,
        tok=tok,
        bar=bar,
        bar_class=type(cli.trainer.progress_bar_callback).__name__,
        weights={k: v.detach().clone() for k, v in policy.state_dict().items()},
        answers=hf_greedy_answers(policy, tok, [r["prompt"] for r in PROMPTS]),
    )


def test_fit_export_holds_the_trainers_weights(run):
    assert len(set(run.answers)) > 5  # the comparisons below are of varied answers, not one repeated string
    assert FILES <= {p.name for p in run.export.iterdir()}
    exported = load_file(run.export / "model.safetensors")
    assert set(exported) == set(run.weights)
    assert all(torch.equal(exported[k], run.weights[k]) for k in exported)
    info = json.loads((run.export / MARKER).read_text())
    assert info["base_model"] == "builtin:arithmetic-tiny-raw" and info["global_step"] == 2
    assert json.loads((run.export / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_progress_bar_counts_rl_steps_and_shows_reward(run):
    assert run.bar_class == "StepProgressBar"
    assert (run.bar.n, run.bar.total, run.bar.desc.rstrip(": ")) == (2, 2, "RL step")  # not "Epoch 0/-2"
    assert "reward=" in run.bar.postfix and "accuracy=" in run.bar.postfix and "v_num" not in run.bar.postfix


def test_transformers_loads_the_export_and_answers_like_the_trainer(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run.export)  # plain transformers, no logra code
    tok = AutoTokenizer.from_pretrained(run.export)
    assert [tok.encode(r["prompt"]) for r in PROMPTS] == [run.tok.encode(r["prompt"]) for r in PROMPTS]
    assert hf_greedy_answers(model, run.tok, [r["prompt"] for r in PROMPTS]) == run.answers


def test_logra_export_from_the_ckpt_matches_the_fit_export(run, tmp_path):
    assert logra(["export", "--ckpt_path", str(run.ckpt), "--out", str(tmp_path / "out")]) == 0
    a, b = load_file(run.export / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        (run.export / "config.json").read_text()
    )
    # an earlier export is replaced; bf16 on request
    export_checkpoint(run.ckpt, tmp_path / "out", dtype="bfloat16")
    assert load_file(tmp_path / "out" / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16


def test_the_checkpoint_still_resumes(run, tmp_path):
    """The start-up checks of --ckpt_path let a whole checkpoint through to Lightning."""
    cli = logra(
        [
            "fit",
            "--config",
            CONFIG,
            "--ckpt_path",
            str(run.ckpt),
            *tiny_run(tmp_path, 3),
            "--data.val.init_args.test_size",
            "16",
        ]
    )
    assert cli.trainer.global_step == 3 and cli.model.hparams.model == "builtin:arithmetic-tiny-raw"  # from the ckpt


def test_logra_export_from_a_distributed_checkpoint(run, tmp_path):
    """The layout ModelParallelStrategy writes: DCP shards of {"state_dict", "optimizer_0"} plus meta.pt."""
    import torch.distributed.checkpoint as dcp

    ckpt = torch.load(run.ckpt, map_location="cpu", weights_only=True)
    dist_dir = tmp_path / "last.ckpt"
    dcp.save(
        {"state_dict": ckpt.pop("state_dict"), "optimizer_0": ckpt.pop("optimizer_states")[0]},
        checkpoint_id=str(dist_dir),
    )
    torch.save(ckpt, dist_dir / "meta.pt")
    weights, hparams = read_checkpoint(dist_dir)
    assert hparams["model"] == "builtin:arithmetic-tiny-raw" and hparams["global_step"] == 2
    assert all(torch.equal(weights[k], run.weights[k]) for k in run.weights)
    logra(["export", "--ckpt_path", str(dist_dir), "--out", str(tmp_path / "out")])
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(out[k], run.weights[k]) for k in out)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda t: (t / "x.txt").write_text("x") and t / "x.txt", r"--out='.*x.txt': is a file"),
        (lambda t: (t / "keep.txt").write_text("mine") and t, r"holds other files \(keep.txt\).*choose a new or empty"),
    ],
)
def test_export_refuses_a_target_that_holds_other_things(run, tmp_path, make, match):
    out = make(tmp_path)
    with pytest.raises(ConfigError, match=match):
        logra(["export", "--ckpt_path", str(run.ckpt), "--out", str(out)])
    assert not (tmp_path / "keep.txt").exists() or (tmp_path / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "args, match",
    [
        (
            ["--ckpt_path", "/nonexistent/last.ckpt", "--out", "OUT"],
            r"--ckpt_path /nonexistent/last.ckpt: no such file",
        ),
        (["--out", "OUT"], r"logra export: the following arguments are required: --ckpt_path"),
        (
            ["--ckpt_path", "CKPT", "--out", "OUT", "--base_model", "/nonexistent/base"],
            r"base model='/nonexistent/base': no such",
        ),
        (["--ckpt_path", "CKPT", "--out", "OUT", "--dtype", "int8"], r"argument --dtype: invalid choice"),
        (["--ckpt_path", "best", "--out", "OUT"], r"logra export --ckpt_path best: also give the fit's --config"),
        (["--ckpt_path", "last", "--config", "nope.yaml", "--out", "OUT"], r"--config nope.yaml: no such file"),
    ],
)
def test_export_errors_name_the_argument(run, tmp_path, args, match):
    args = [str(run.ckpt) if a == "CKPT" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    with pytest.raises(ConfigError, match=match):
        logra(["export", *args])
    assert not (tmp_path / "out").exists()


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_loads_the_export_and_answers_like_the_trainer(run):
    """A plain ``vllm.LLM(model=DIR)`` (its own tokenizer, text prompts), as ``vllm serve DIR`` would load it."""
    answers = vllm_greedy_answers(run.export, [r["prompt"] for r in PROMPTS])
    assert answers == run.answers


@pytest.mark.slow
def test_export_of_a_real_fsdp2_run(tmp_path):
    """2 CPU processes (configs/arithmetic_fsdp.yaml) write a distributed checkpoint and, with ``--export``,
    the gathered policy; ``logra export`` of the checkpoint gives the same weights."""
    from tests.test_fsdp_lightning import logra_command, run_lightning, tiny_budget

    run_lightning(
        [
            *logra_command(),
            "fit",
            "--config",
            str(ROOT / "configs" / "arithmetic_fsdp.yaml"),
            *tiny_budget(tmp_path, 2),
            "--export",
            str(tmp_path / "fit_export"),
        ]
    )
    (ckpt,) = tmp_path.glob("arithmetic_fsdp/version_*/checkpoints/last.ckpt")
    assert ckpt.is_dir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [*logra_command(), "export", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    weights, _ = read_checkpoint(ckpt)
    assert all(torch.equal(p, weights[n]) for n, p in model.state_dict().items())
    gathered = load_file(tmp_path / "fit_export" / "model.safetensors")  # ExportPolicy under FSDP2, rank 0 wrote it
    assert set(gathered) <= set(weights) and all(torch.equal(gathered[k], weights[k]) for k in gathered)
