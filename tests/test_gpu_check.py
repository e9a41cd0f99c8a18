"""scripts/gpu_check.{sh,py}: the CPU-side logic of the offline GPU check, and its dry run end to end.

Fast tests: model shapes (real parameter counts, scaled-down shapes vLLM accepts), the built model
(loads, padded tokenizer, EOS as likely as asked), the generated ``logra fit`` config (parses and
instantiates), the plan comparison, the per-part summary, the report schema, timeouts, and the
shell entry failing fast without a GPU. Slow: ``scripts/gpu_check.sh --dry-run`` on one model,
both optimizers (~3 min on the 2-core machine).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gpu_check
import gpu_check_models as gm
import gpu_check_report as rep
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
BASH = shutil.which("bash") or "/bin/bash"


DRY = gpu_check.SETTINGS["dry"]


def run_script(*args: str, path: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {}), "PATH": path if path is not None else os.environ["PATH"]}
    return subprocess.run([BASH, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


# ------------------------------------------------------------------------------ shell entry
def test_fails_fast_without_nvidia_smi(tmp_path):
    bin_dir = tmp_path / "bin"  # only the tools the script needs before its GPU check, no nvidia-smi
    bin_dir.mkdir()
    for tool in ("dirname", "env", "date"):
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    start = time.monotonic()
    result = run_script(path=str(bin_dir), env={"GPU_CHECK_DRY": "0"})
    assert time.monotonic() - start < 5
    assert result.returncode == 1
    assert "no NVIDIA GPU on this machine (nvidia-smi not found); use --dry-run" in result.stderr


def test_dry_run_without_the_venv_says_what_to_do(tmp_path):
    result = run_script("--dry-run", env={"GPU_CHECK_PYTHON": str(tmp_path / "nope" / "python")})
    assert result.returncode == 1 and "run 'make venv' first" in result.stderr


def test_a_python_without_cuda_is_refused_before_anything_runs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"  # a GPU that torch cannot see (this machine's CPU-only torch)
    fake.write_text("#!/bin/sh\necho 'GPU 0: Fake GPU'\n")
    fake.chmod(0o755)
    if torch.cuda.is_available():
        pytest.skip("this test needs a torch that sees no GPU")
    python = sys.executable
    result = run_script(path=f"{bin_dir}:{os.environ['PATH']}", env={"GPU_CHECK_PYTHON": python, "GPU_CHECK_DRY": "0"})
    assert result.returncode == 1
    assert f"GPU_CHECK_PYTHON={python}: torch {torch.__version__} sees no CUDA GPU" in result.stderr


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for python on a CUDA machine without the index: vLLM cannot be installed, the package can.
here=$(cd "$(dirname "$0")/.." && pwd)
case "$1" in
  -)  [[ -f "$here/installed" && ( "$2" == cuda-novllm || -f "$here/vllm" ) ]] && exit 0; echo "no vllm" >&2; exit 1 ;;
  -c) exit 0 ;;
  -m) if [[ "$2" == venv ]]; then mkdir -p "$4/bin" && cp "$0" "$4/bin/python"; exit 0; fi
      if [[ " $* " == *" vllm=="* ]]; then
          [[ -n "${FAKE_INDEX:-}" ]] || { echo "ERROR: No matching distribution found for vllm" >&2; exit 1; }
          touch "$here/vllm"
      fi
      touch "$here/installed"; exit 0 ;;
  scripts/gpu_check.py) shift; echo "$@" > "$FAKE_ARGS"; exit 0 ;;
esac
exit 2
"""


def test_where_vllm_cannot_be_installed_it_falls_back_to_the_hf_engine(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("nvidia-smi", "#!/bin/sh\necho 'GPU 0: Fake GPU'\n"), ("python3.13", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "GPU_CHECK_DRY": "0",
        "GPU_CHECK_VENV": str(tmp_path / "c" / "venv"),
        "GPU_CHECK_VENV_HF": str(tmp_path / "c" / "venv-hf"),
        "FAKE_ARGS": str(tmp_path / "args"),
    }
    path = f"{bin_dir}:{os.environ['PATH']}"
    first = run_script("--models", "qwen2.5-0.5b", path=path, env=env)
    assert first.returncode == 0, first.stderr
    assert "vLLM could not be installed" in first.stderr and "No matching distribution found for vllm" in first.stderr
    assert "installed in" in first.stdout and "(hf engine)" in first.stdout
    args = (tmp_path / "args").read_text().split()
    assert args[:3] == ["run", "--engine", "hf"] and args[-2:] == ["--models", "qwen2.5-0.5b"]
    assert (tmp_path / "c" / "venv-hf" / ".gpu_check_hf_fallback").is_file()
    second = run_script(path=path, env=env)  # reuses the fallback install, does not try vLLM again
    assert second.returncode == 0 and "vLLM could not be installed" not in second.stderr
    assert (tmp_path / "args").read_text().split()[:3] == ["run", "--engine", "hf"]
    strict = run_script(path=path, env={**env, "GPU_CHECK_ENGINE": "vllm"})
    assert strict.returncode == 1 and "vLLM could not be installed" in strict.stderr


def test_with_the_index_it_installs_vllm_once(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("nvidia-smi", "#!/bin/sh\necho 'GPU 0: Fake GPU'\n"), ("python3.13", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "GPU_CHECK_DRY": "0",
        "GPU_CHECK_VENV": str(tmp_path / "c" / "venv"),
        "FAKE_INDEX": "1",
        "GPU_CHECK_VENV_HF": str(tmp_path / "c" / "venv-hf"),
        "FAKE_ARGS": str(tmp_path / "args"),
    }
    path = f"{bin_dir}:{os.environ['PATH']}"
    first = run_script(path=path, env=env)
    assert first.returncode == 0, first.stderr
    assert "installing vllm==0.32.0" in first.stdout and "(vllm engine)" in first.stdout
    assert (tmp_path / "args").read_text().split()[:3] == ["run", "--engine", "vllm"]
    second = run_script(path=path, env=env)
    assert second.returncode == 0 and "installing" not in second.stdout  # already importable: no install


def test_summarize_without_a_file_says_how_to_call_it():
    result = run_script("--summarize")
    assert result.returncode == 1 and "usage:" in result.stderr


# ---------------------------------------------------------------------------------- shapes
def test_real_shapes_have_the_real_parameter_counts():
    from logra_lightning.models.shapes import architecture_from_config

    counts = {m: architecture_from_config(gm.real_shape(m)).num_params() for m in gm.MODELS}
    assert counts["qwen2.5-0.5b"] == 494_032_768  # Qwen/Qwen2.5-0.5B
    assert counts["qwen2.5-1.5b"] == 1_543_714_304  # Qwen/Qwen2.5-1.5B
    seven = architecture_from_config(gm.real_shape("qwen2.5-7b-4l"))
    assert (seven.num_layers, seven.hidden_size, seven.intermediate_size, seven.tie_word_embeddings) == (
        4,
        3584,
        18944,
        False,
    )
    with pytest.raises(ValueError, match="unknown model 'qwen9'.*allowed: qwen2.5-0.5b"):
        gm.real_shape("qwen9")


@pytest.mark.parametrize("model", list(gm.MODELS))
def test_dry_shapes_keep_the_architecture_at_a_size_vllm_cpu_runs(model):
    real = gm.real_shape(model)
    dry = gpu_check.model_shape(model, DRY)
    assert dry["hidden_size"] == DRY["dry_hidden"][model]
    assert dry["hidden_size"] // dry["num_attention_heads"] == 64  # vLLM's CPU backend rejects small heads
    assert (
        dry["num_attention_heads"] % dry["num_key_value_heads"] == 0
        and dry["num_key_value_heads"] < dry["num_attention_heads"]
    )  # still grouped-query attention
    assert dry["tie_word_embeddings"] == real["tie_word_embeddings"] and dry["model_type"] == "qwen2"
    ratio = real["intermediate_size"] / real["hidden_size"]
    assert abs(dry["intermediate_size"] / dry["hidden_size"] - ratio) < 0.15
    assert gpu_check.model_shape(model, gpu_check.SETTINGS["cuda"]) == real
    with pytest.raises(ValueError, match="hidden_size=100 must be a multiple of 64"):
        gm.dry_shape(real, hidden_size=100)


def test_solve_eos_bias_hits_the_target_probability():
    g = torch.Generator().manual_seed(0)
    eos, lse = torch.randn(500, generator=g), torch.randn(500, generator=g) + 8.0
    feature = torch.rand(500, generator=g) + 0.5
    b = gm.solve_eos_bias(eos, lse, feature, target=0.01)
    assert torch.sigmoid(eos + b * feature - lse).mean().item() == pytest.approx(0.01, rel=1e-6)
    with pytest.raises(ValueError, match="not reachable"):
        gm.solve_eos_bias(eos, lse, torch.zeros(500), target=0.5)


def test_built_model_loads_with_padded_vocab_and_likely_eos(tmp_path):
    from logra_lightning.models import load_policy

    shape = gpu_check.model_shape("qwen2.5-0.5b", DRY)
    info = gm.build_model_dir(tmp_path / "m", shape, max_new_tokens=16, finish_fraction=0.3)
    model, tok = load_policy(str(tmp_path / "m"))
    assert len(tok) == shape["vocab_size"] == model.config.vocab_size
    assert tok.decode(tok.encode("37+48=")) == "37+48="
    assert tok.decode([len(tok) - 1]) == f"<|f{len(tok) - 1}|>"  # filler ids decode (the reward sees them)
    assert info["params"] == sum(p.numel() for p in model.parameters())
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    ids = torch.randint(3, shape["vocab_size"], (16, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        p_eos = model(input_ids=ids).logits.softmax(-1)[..., tok.eos_token_id].mean().item()  # fresh draws
    assert p_eos == pytest.approx(gm.eos_probability(0.3, 16), rel=0.5)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["eos_token_id"] == tok.eos_token_id and cfg["hidden_size"] == 128


def test_digit_share_reward():
    assert gm.DigitShareReward()(["", "", ""], ["<|f123|>", "", "ab"], ["", "", ""]) == [3 / 8, 0.0, 0.0]


# -------------------------------------------------------------------------------- config
@pytest.mark.parametrize("optimizer", list(gpu_check.OPTIMIZERS))
def test_fit_config_passes_validation_and_instantiates(tmp_path, optimizer):
    import yaml

    from logra_lightning.cli.lightning_cli import LograCLI
    from logra_lightning.config.checks import validate_fit_config

    shape = gpu_check.model_shape("qwen2.5-0.5b", DRY)
    gm.build_model_dir(tmp_path / "m", shape, max_new_tokens=DRY["max_new_tokens"])
    cfg = gpu_check.fit_config("qwen2.5-0.5b", optimizer, DRY, str(tmp_path / "m"), str(tmp_path / "runs"))
    validate_fit_config(cfg)
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = LograCLI(args=["--config", str(path)], run=False)
    assert type(cli.model.reward_fn).__name__ == "DigitShareReward"
    assert type(cli.model.engine_spec).__name__ == "VLLMEngineSpec"
    assert cli.model.engine_spec.options["kv_cache_space_gb"] == DRY["kv_cache_space_gb"]
    assert cli.trainer.max_steps == DRY["steps"] and cli.trainer.checkpoint_callback is None
    names = {type(cb).__name__ for cb in cli.trainer.callbacks}
    assert {"KLStepControl", "LowRankWeightSync", "MemoryMonitor"} <= names
    opt_cfg = cfg["model"]["optimizer"]
    assert opt_cfg["class_path"].endswith("LoGRA" if optimizer == "logra" else "AdamW")
    assert opt_cfg["init_args"].get("rank") == (DRY["rank"] if optimizer == "logra" else None)
    cuda = gpu_check.fit_config("qwen2.5-0.5b", optimizer, gpu_check.SETTINGS["cuda"], "m", "r")
    assert cuda["trainer"]["accelerator"] == "gpu" and cuda["trainer"]["precision"] == "bf16-mixed"
    assert cuda["model"]["engine"]["init_args"]["gpu_memory_utilization"] == 0.25
    assert cuda["model"]["engine"]["init_args"]["dtype"] == "bfloat16"


def test_hf_engine_fallback_config(tmp_path):
    cfg = gpu_check.fit_config("qwen2.5-0.5b", "logra", {**DRY, "engine": "hf"}, "m", "r")
    assert cfg["model"]["engine"] == {
        "class_path": "logra_lightning.rollout.HFEngineSpec",
        "init_args": {"copy_weights": True},
    }
    kw = rep.plan_setup_kwargs(gpu_check.SETTINGS["cuda"], 150.0)
    shape = gm.real_shape("qwen2.5-0.5b")
    hf, vllm = rep.predict(shape, "logra", kw, "hf"), rep.predict(shape, "logra", kw)
    assert hf["forward_backward_gb"] - vllm["forward_backward_gb"] == pytest.approx(hf["params_gb"])  # fp32 copy


# ---------------------------------------------------------------------------------- plan
def test_prediction_is_the_planner_without_the_engine_and_with_the_kl_snapshot():
    from logra_lightning.models.shapes import architecture_from_config
    from logra_lightning.plan import PlanSetup, plan

    s = gpu_check.SETTINGS["cuda"]
    kw = rep.plan_setup_kwargs(s, device_memory_gb=150.0)
    assert (kw["batch"], kw["seq_len"], kw["rollout_batch"]) == (16, 6 + 128, 64)
    assert kw["precision"] == "bf16-mixed" and kw["adamw_impl"] == "foreach" and kw["colocate_engine"]
    shape = gm.real_shape("qwen2.5-0.5b")
    full = plan(architecture_from_config(shape), PlanSetup(**kw))["optimizers"]
    adamw, logra = (rep.predict(shape, o, kw) for o in ("adamw", "logra"))
    assert adamw["params_gb"] == pytest.approx(494_032_768 * 4 / 1e9)
    assert adamw["optimizer_state_gb"] > 10 * logra["optimizer_state_gb"]
    step = full["adamw"]["phases"]["optimizer_step"]
    trainer = step["total"] - step["engine_weights"] - step["kv_cache"] - step["reserve"]
    assert adamw["optimizer_gb"] == pytest.approx((trainer + step["params"]) / 1e9)  # + KL snapshot copy
    assert logra["kl_snapshot_gb"] == 0.0 and adamw["kl_snapshot_gb"] == pytest.approx(adamw["params_gb"])
    assert logra["peak_gb_with_engine"] == pytest.approx(full["logra"]["peak_bytes"] / 1e9)
    assert logra["breakdown_gb"]["total"] == pytest.approx(logra["peak_gb_with_engine"])
    cmd = rep.plan_command("/m", kw)
    assert cmd.startswith("logra plan --model /m --gpus 1") and "--colocate-engine --rollout-batch 64" in cmd


# ------------------------------------------------------------------------------- summary
def fake_series(steps: int = 3) -> dict:
    s: dict[str, list] = {}

    def log(key, step, value):
        s.setdefault(key, []).append((step, value))

    log("sync/bytes", 0, 4e6)  # the full sync at fit start
    log("sync/seconds", 0, 0.5)
    for i in range(steps):
        log("perf/step_seconds", i, 9.0 if i == 0 else 1.0 + i)
        for ph, gb in (("rollout", 1.0), ("forward_backward", 3.0 + i), ("optimizer", 2.0), ("weight_sync", 1.5)):
            log(f"memory/{ph}/peak_gb", i, gb)
        log("memory/forward_backward/reserved_gb", i, 6.0)
        log("memory/params_gb", i, 2.0)
        log("memory/grads_gb", i, 0.01)
        log("memory/optimizer_state_gb", i, 0.4)
        log("sync/bytes", i, 4e5)
        log("sync/seconds", i, 0.1)
        log("sync/dense_bytes", i, 4e6)
        log("sync/full_syncs", i, 1.0)
        log("sync/logprob_abs_diff_mean", i, 1e-3)
        log("sync/logprob_abs_diff_max", i, 1e-2)
        log("reward/mean", i, 0.5)
        log("completion/clipped_ratio", i, 0.75)
    return s


def fake_prediction() -> dict:
    return {
        "forward_backward_gb": 4.0,
        "optimizer_gb": 2.5,
        "params_gb": 2.0,
        "grads_gb": 0.01,
        "optimizer_state_gb": 0.5,
        "reserve_gb": 2.0,
        "peak_gb_with_engine": 9.0,
        "peak_phase": "loss_backward",
        "fits": True,
        "kl_snapshot_gb": 0.0,
        "engine_weights_gb": 1.0,
        "kv_cache_gb": 0.1,
    }


def test_summarize_part_reads_the_numbers_right():
    history = [
        {"step": 0, "eta": 1.0, "predicted_raw": 1e-4, "predicted": 1e-4, "realized": 2e-4},
        {"step": 1, "eta": 0.5, "predicted_raw": 1e-3, "predicted": 1e-3, "realized": 1e-3},
        {"step": 2, "eta": 0.5, "predicted_raw": 0.0, "predicted": 0.0, "realized": None},
    ]
    out = rep.summarize_part(fake_series(), history, fake_prediction(), device_used_peak_gb=20.0, engine_budget_gb=10.0)
    assert out["steps"] == 3
    assert out["seconds_per_step"]["median"] == 2.5 and out["seconds_per_step"]["first"] == 9.0  # first excluded
    assert out["memory_peak_gb"] == {"rollout": 1.0, "forward_backward": 5.0, "optimizer": 2.0, "weight_sync": 1.5}
    assert out["memory_exact_gb"] == {"params_gb": 2.0, "grads_gb": 0.01, "optimizer_state_gb": 0.4}
    assert out["memory_reserved_gb"] == {"forward_backward": 6.0}
    sync = out["sync"]
    assert sync["initial_full_sync_bytes"] == 4e6 and sync["step_bytes"] == [4e5] * 3
    assert sync["lowrank_over_dense"] == pytest.approx(0.1) and sync["initial_full_sync_seconds"] == 0.5
    assert out["drift"]["logprob_abs_diff_max"] == [1e-2] * 3
    assert out["kl"]["median_abs_log_realized_over_predicted"] == pytest.approx(math.log(2) / 2)
    r = out["measured_over_predicted"]
    assert r["forward_backward"] == pytest.approx(5.0 / 4.0) and r["optimizer"] == pytest.approx(0.8)
    assert r["params"] == 1.0 and r["optimizer_state"] == pytest.approx(0.8)
    assert r["device_total"] == pytest.approx(20.0 / (4.0 + 10.0 + 2.0))
    assert out["completion_clipped_ratio"] == [0.75] * 3


def report(runs):
    machine = {"device_name": "NVIDIA H200", "device_memory_gb": 150.0, "torch": "2.13.0", "vllm": "0.32.0"}
    return rep.make_report(
        "cuda",
        0.0,
        321.0,
        machine,
        gpu_check.SETTINGS["cuda"],
        {"seconds": 120.0},
        {},
        runs,
        command="scripts/gpu_check.sh",
    )


def ok_run(model="qwen2.5-0.5b", optimizer="logra"):
    history = [{"step": 0, "eta": 1.0, "predicted_raw": 1e-4, "predicted": 1e-4, "realized": 1.1e-4}]
    return {
        "model": model,
        "optimizer": optimizer,
        "status": "ok",
        "wall_seconds": 50.0,
        **rep.summarize_part(fake_series(), history, fake_prediction(), 20.0, 10.0),
        "plan_command": "logra plan --model m",
    }


def test_report_schema_summary_and_json_round_trip(tmp_path):
    failed = {
        "model": "qwen2.5-7b-4l",
        "optimizer": "adamw",
        "status": "timeout",
        "wall_seconds": 150.0,
        "error": "timed out after 150 s; log x.log:\nCUDA out of memory",
    }
    good = report([ok_run(), ok_run(optimizer="adamw")])
    assert good["ok"] and rep.check_report(good) == []
    path = tmp_path / "r.json"
    path.write_text(json.dumps(good))
    assert rep.check_report(json.loads(path.read_text())) == []
    text = rep.format_summary(good)
    assert "NVIDIA H200" in text and "qwen2.5-0.5b / logra: ok" in text and "2.50 s/step" in text
    assert "measured/plan 1.250" in text and "gpu_check: all parts ran" in text and "(reserved 6.00)" in text
    assert "1.00e-04 -> 1.10e-04" in text
    bad = report([ok_run(), failed])
    assert not bad["ok"] and rep.check_report(bad) == []
    assert "FAILED parts: qwen2.5-7b-4l/adamw" in rep.format_summary(bad)
    assert "CUDA out of memory" in rep.format_summary(bad)
    broken = report([ok_run()])
    del broken["runs"][0]["memory_peak_gb"]["weight_sync"], broken["runs"][0]["kl"]
    broken["ok"] = False
    problems = rep.check_report(broken)
    assert "runs[0] (qwen2.5-0.5b/logra): missing 'kl'" in problems
    assert "runs[0]: no memory peak for phase(s) weight_sync" in problems
    assert "'ok' does not match the runs' statuses" in problems


def test_summarize_command_prints_a_written_report(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report([ok_run()])))
    result = run_script("--summarize", str(path))
    assert result.returncode == 0, result.stderr
    assert "qwen2.5-0.5b / logra: ok" in result.stdout


def test_a_part_past_its_time_is_killed_with_its_children(tmp_path):
    cmd = [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"]
    start = time.monotonic()
    status, seconds = gpu_check.run_limited(cmd, timeout=1.0, log=tmp_path / "log")
    assert status == "timeout" and time.monotonic() - start < 10
    assert (
        gpu_check.run_limited([sys.executable, "-c", "raise SystemExit(3)"], 10, tmp_path / "l2")[0]
        == "failed (exit 3)"
    )


# ------------------------------------------------------------------------------ end to end
@pytest.mark.slow
@pytest.mark.vllm
def test_dry_run_end_to_end(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "gpu_check.json"
    start = time.monotonic()
    result = subprocess.run(
        [BASH, str(SCRIPT), "--dry-run", "--models", "qwen2.5-0.5b", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert rep.check_report(doc) == [] and doc["ok"] and doc["mode"] == "dry-run (cpu)"
    assert doc["wall_seconds"] <= time.monotonic() - start + 1
    runs = {r["optimizer"]: r for r in doc["runs"]}
    assert set(runs) == {"adamw", "logra"}
    for run in runs.values():
        assert run["steps"] == DRY["steps"] and len(run["kl"]["steps"]) == DRY["steps"]
        assert all(k["realized"] is not None for k in run["kl"]["steps"])  # measured every step
        assert run["measured_over_predicted"]["params"] == pytest.approx(1.0)  # exact accounting matches the plan
        assert max(run["drift"]["logprob_abs_diff_max"]) < 1e-3  # fp32 engine follows the trainer
    logra, adamw = runs["logra"]["sync"], runs["adamw"]["sync"]
    assert logra["lowrank_over_dense"] < 0.5 and adamw["lowrank_over_dense"] == pytest.approx(1.0)
    assert "gpu_check: all parts ran" in result.stdout


@pytest.mark.slow
def test_dry_run_with_the_hf_engine_fallback(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_check.py"),
            "run",
            "--dry-run",
            "--engine",
            "hf",
            "--models",
            "qwen2.5-7b-4l",
            "--out",
            str(out),
            "--deadline",
            "9999999999",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert rep.check_report(doc) == [] and doc["settings"]["engine"] == "hf"
    assert "--deadline" not in doc["command"] and "--engine hf" in doc["command"]
    assert {r["optimizer"]: r["status"] for r in doc["runs"]} == {"adamw": "ok", "logra": "ok"}
