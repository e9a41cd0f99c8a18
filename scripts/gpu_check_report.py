"""The numbers of the GPU check: ``logra plan``'s prediction for a part, its summary, the report JSON.

Pure functions of plain values (logged scalars, ``KLStepControl.history``, the planner's output),
used by ``scripts/gpu_check.py`` and tested in ``tests/test_gpu_check.py`` without a run.

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
5. With the HF engine (``--engine hf``) the engine is an fp32 copy of the weights in the trainer
   process, added to the trainer's predicted phases; the device total has no engine share.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from logra_lightning.plan.memory import PHASES as PLAN_PHASES
from logra_lightning.rl.phases import PHASES

SCHEMA = "logra-gpu-check/1"
GB = 1e9  # MemoryMonitor's unit; every *_gb in the JSON is 1e9 bytes
BACKWARD_PHASES = tuple(p for p in PLAN_PHASES if p.endswith("_backward"))
PROMPT_TOKENS = 6  # "dd+dd=" with the character tokenizer: the longest arithmetic prompt (max_digits=2)


def plan_setup_kwargs(settings: dict[str, Any], device_memory_gb: float) -> dict[str, Any]:
    """``PlanSetup`` fields for the setting a part runs (see choice 2)."""
    s = settings
    return dict(
        gpus=1,
        gpu_memory_gb=device_memory_gb * GB / 2**30,
        rank=s["rank"],
        batch=s["micro_batch_size"],
        seq_len=PROMPT_TOKENS + s["max_new_tokens"],
        precision={"bf16-mixed": "bf16-mixed", "32-true": "fp32"}[s["precision"]],
        activation_checkpointing=True,
        colocate_engine=True,
        rollout_batch=s["batch_size"] * s["group_size"],
        adamw_impl="foreach" if s["device"] == "cuda" else "for-loop",
    )


def plan_command(model_dir: str, kw: dict[str, Any]) -> str:
    """The ``logra plan`` command line that prints the same prediction."""
    return (
        f"logra plan --model {model_dir} --gpus {kw['gpus']} --gpu-memory-gb {kw['gpu_memory_gb']:.1f} "
        f"--rank {kw['rank']} --batch {kw['batch']} --seq-len {kw['seq_len']} --precision {kw['precision']} "
        f"--activation-checkpointing --colocate-engine --rollout-batch {kw['rollout_batch']} "
        f"--adamw-impl {kw['adamw_impl']}"
    )


def predict(shape: dict[str, Any], optimizer: str, setup_kw: dict[str, Any], engine: str = "vllm") -> dict[str, Any]:
    """The planner's numbers for one part, in GB: trainer-only per MemoryMonitor phase (choice 1) and exact terms.

    With ``engine="hf"`` the engine is an fp32 copy of the weights inside the trainer process:
    that copy is added to the trainer's phases.
    """
    from logra_lightning.models.shapes import architecture_from_config
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
        "peak_gb_with_engine": result["peak_bytes"] / GB,
        "peak_phase": result["peak_phase"],
        "fits": result["fits"],
        "forward_backward_gb": max(trainer(p) for p in BACKWARD_PHASES) / GB,
        "optimizer_gb": (trainer("optimizer_step") + kl_snapshot) / GB,
        "kl_snapshot_gb": kl_snapshot / GB,
        "params_gb": step["params"] / GB,
        "grads_gb": step["grads"] / GB,
        "optimizer_state_gb": step["optimizer_state"] / GB,
        "reserve_gb": step["reserve"] / GB,
        "engine_weights_gb": step["engine_weights"] / GB,
        "kv_cache_gb": step["kv_cache"] / GB,
        "breakdown_gb": {k: v / GB for k, v in phases[result["peak_phase"]].items()},  # at the plan's peak phase
    }


def _values(series: dict[str, list], key: str) -> list[float]:
    return [float(v) for _, v in series.get(key, [])]


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or not predicted:
        return None
    return measured / predicted


def summarize_part(
    series: dict[str, list],
    kl_history: list[dict],
    prediction: dict[str, Any] | None,
    device_used_peak_gb: float | None = None,
    engine_budget_gb: float = 0.0,
) -> dict[str, Any]:
    """One part's numbers from its logged scalars (``{key: [(step, value), ...]}`` in logging order)
    and ``KLStepControl.history``; pure, so the JSON is testable without a run."""
    steps = _values(series, "perf/step_seconds")
    warm = steps[1:] or steps
    memory = {
        ph: max(_values(series, f"memory/{ph}/peak_gb")) for ph in PHASES if _values(series, f"memory/{ph}/peak_gb")
    }
    reserved = {ph: max(v) for ph in PHASES if (v := _values(series, f"memory/{ph}/reserved_gb"))}  # CUDA only
    exact = {
        k: _values(series, f"memory/{k}")[-1]
        for k in ("params_gb", "grads_gb", "optimizer_state_gb")
        if _values(series, f"memory/{k}")
    }
    sync_bytes, sync_s = _values(series, "sync/bytes"), _values(series, "sync/seconds")
    dense = _values(series, "sync/dense_bytes")
    full_syncs = _values(series, "sync/full_syncs")
    kl_steps = [
        {
            "step": int(r["step"]),
            "scale": r.get("eta"),
            "predicted_raw": r.get("predicted_raw"),
            "predicted": r.get("predicted"),
            "realized": r.get("realized"),
        }
        for r in kl_history
    ]
    logs = [
        abs(math.log(r["realized"] / r["predicted_raw"]))
        for r in kl_steps
        if r["realized"] and r["predicted_raw"] and r["realized"] > 0 and r["predicted_raw"] > 0
    ]
    out: dict[str, Any] = {
        "steps": len(kl_history),
        "batches": len(steps),  # optimizer steps; batches incl. skipped ones
        "seconds_per_step": {
            "median": statistics.median(warm) if warm else None,
            "first": steps[0] if steps else None,
            "all": steps,
        },
        "memory_peak_gb": memory,
        "memory_reserved_gb": reserved,
        "memory_exact_gb": exact,
        "sync": {
            "initial_full_sync_bytes": sync_bytes[0] if sync_bytes else None,
            "step_bytes": sync_bytes[1:],
            "step_seconds": sync_s[1:],
            "initial_full_sync_seconds": sync_s[0] if sync_s else None,
            "dense_bytes": dense[-1] if dense else None,
            "full_syncs": full_syncs[-1] if full_syncs else None,
            "lowrank_over_dense": (statistics.mean(sync_bytes[1:]) / dense[-1])
            if len(sync_bytes) > 1 and dense and dense[-1]
            else None,
        },
        "drift": {
            "logprob_abs_diff_mean": _values(series, "sync/logprob_abs_diff_mean"),
            "logprob_abs_diff_max": _values(series, "sync/logprob_abs_diff_max"),
        },
        "kl": {"steps": kl_steps, "median_abs_log_realized_over_predicted": statistics.median(logs) if logs else None},
        "reward_mean": _values(series, "reward/mean"),
        "completion_clipped_ratio": _values(series, "completion/clipped_ratio"),
        "skipped": {
            "steps": (_values(series, "health/skipped_steps") or [0.0])[-1],
            "batches": (_values(series, "health/skipped_batches") or [0.0])[-1],
        },
        "device_used_peak_gb": device_used_peak_gb,
    }
    if prediction is not None:
        out["plan"] = prediction
        out["measured_over_predicted"] = {
            "forward_backward": _ratio(memory.get("forward_backward"), prediction["forward_backward_gb"]),
            "optimizer": _ratio(memory.get("optimizer"), prediction["optimizer_gb"]),
            "params": _ratio(exact.get("params_gb"), prediction["params_gb"]),
            "grads": _ratio(exact.get("grads_gb"), prediction["grads_gb"]),
            "optimizer_state": _ratio(exact.get("optimizer_state_gb"), prediction["optimizer_state_gb"]),
            "device_total": _ratio(
                device_used_peak_gb,
                max(prediction["forward_backward_gb"], prediction["optimizer_gb"])
                + engine_budget_gb
                + prediction["reserve_gb"],
            ),
        }
    return out


def make_report(
    mode: str,
    start: float,
    wall_seconds: float,
    machine: dict,
    settings: dict,
    install: dict,
    models: dict,
    runs: list[dict],
    command: str = "",
) -> dict[str, Any]:
    """The JSON document (schema :data:`SCHEMA`); ``ok`` when every part ran."""
    return {
        "schema": SCHEMA,
        "mode": "cuda" if mode == "cuda" else "dry-run (cpu)",
        "ok": bool(runs) and all(r["status"] == "ok" for r in runs),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
        "wall_seconds": wall_seconds,
        "command": command,
        "machine": machine,
        "settings": settings,
        "install": install,
        "models": models,
        "runs": runs,
    }


REQUIRED = {
    "top": ("schema", "mode", "ok", "wall_seconds", "machine", "settings", "install", "models", "runs"),
    "run": ("model", "optimizer", "status", "wall_seconds"),
    "ok_run": (
        "steps",
        "seconds_per_step",
        "memory_peak_gb",
        "memory_exact_gb",
        "sync",
        "drift",
        "kl",
        "plan",
        "measured_over_predicted",
        "plan_command",
    ),
}


def check_report(report: dict[str, Any]) -> list[str]:
    """What is missing or inconsistent in a report (an empty list: it is complete)."""
    problems = [f"missing key {k!r}" for k in REQUIRED["top"] if k not in report]
    if report.get("schema") != SCHEMA:
        problems.append(f"schema is {report.get('schema')!r}, expected {SCHEMA!r}")
    for i, run in enumerate(report.get("runs", [])):
        keys = REQUIRED["run"] + (REQUIRED["ok_run"] if run.get("status") == "ok" else ("error",))
        problems += [
            f"runs[{i}] ({run.get('model')}/{run.get('optimizer')}): missing {k!r}" for k in keys if k not in run
        ]
        if run.get("status") == "ok":
            missing = [
                ph
                for ph in ("rollout", "forward_backward", "optimizer", "weight_sync")
                if ph not in run.get("memory_peak_gb", {})
            ]
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
    lines = [
        f"gpu_check ({report['mode']}, {report['settings'].get('engine', 'vllm')} engine): "
        f"{m.get('device_name')} ({_fmt(m.get('device_memory_gb'), '.1f')} GB), "
        f"torch {m.get('torch')}, vllm {m.get('vllm')}; {report['wall_seconds']:.0f} s wall "
        f"(install {_fmt(report['install'].get('seconds'), '.0f')} s)"
    ]
    for run in report["runs"]:
        head = f"\n== {run['model']} / {run['optimizer']}: {run['status']} ({run['wall_seconds']:.0f} s)"
        if run["status"] != "ok":
            lines += [head, f"   {run.get('error', '')}"]
            continue
        p, r, s, kl = run["plan"], run["measured_over_predicted"], run["sync"], run["kl"]
        mem, ex = run["memory_peak_gb"], run["memory_exact_gb"]
        skipped = int(run["skipped"]["batches"] + run["skipped"]["steps"])
        lines.append(
            head
            + f", {run['steps']} steps"
            + (f" ({skipped} skipped)" if skipped else "")
            + f", {_fmt(run['seconds_per_step']['median'])} s/step (first "
            f"{_fmt(run['seconds_per_step']['first'])} s); completions cut at max_new_tokens: "
            + ", ".join(f"{x:.0%}" for x in run["completion_clipped_ratio"])
        )
        reserved = run.get("memory_reserved_gb") or {}
        lines.append(
            "   peak GB per phase: "
            + ", ".join(f"{k} {v:.2f}" for k, v in mem.items())
            + (" (reserved " + ", ".join(f"{v:.2f}" for v in reserved.values()) + ")" if reserved else "")
            + f"; whole device {_fmt(run.get('device_used_peak_gb'))}"
        )
        lines.append(
            f"   plan (trainer): forward_backward {p['forward_backward_gb']:.2f} -> measured/plan "
            f"{_fmt(r['forward_backward'], '.3f')}; optimizer {p['optimizer_gb']:.2f} -> "
            f"{_fmt(r['optimizer'], '.3f')}; with engine {p['peak_gb_with_engine']:.2f} "
            f"({'fits' if p['fits'] else 'OOM'}); device total {_fmt(r['device_total'], '.3f')}"
        )
        lines.append(
            f"   exact GB: params {_fmt(ex.get('params_gb'))} ({_fmt(r['params'], '.4f')}), grads "
            f"{_fmt(ex.get('grads_gb'), '.4f')} ({_fmt(r['grads'], '.4f')}), optimizer state "
            f"{_fmt(ex.get('optimizer_state_gb'))} ({_fmt(r['optimizer_state'], '.4f')}) [measured/plan]"
        )
        step_mb = [b / 1e6 for b in s["step_bytes"]]
        lines.append(
            f"   sync: initial full {_fmt((s['initial_full_sync_bytes'] or 0) / 1e6, '.1f')} MB in "
            f"{_fmt(s['initial_full_sync_seconds'])} s; per step "
            f"{', '.join(f'{b:.1f}' for b in step_mb)} MB in "
            f"{', '.join(f'{x:.2f}' for x in s['step_seconds'])} s "
            f"(low-rank/dense {_fmt(s['lowrank_over_dense'], '.3f')})"
        )
        d = run["drift"]
        lines.append(
            f"   drift |engine - trainer| logprob: mean {', '.join(f'{x:.2e}' for x in d['logprob_abs_diff_mean'])}"
            f"; max {', '.join(f'{x:.2e}' for x in d['logprob_abs_diff_max'])}"
        )
        kls = "; ".join(
            f"{_fmt(k['predicted_raw'], '.2e')} -> {_fmt(k['realized'], '.2e')} (scale {_fmt(k['scale'], '.3f')})"
            for k in kl["steps"]
        )
        lines.append(
            f"   KL predicted -> realized: {kls}; median |log(realized/predicted)| "
            f"{_fmt(kl['median_abs_log_realized_over_predicted'], '.3f')}"
        )
    bad = [f"{r['model']}/{r['optimizer']}" for r in report["runs"] if r["status"] != "ok"]
    lines.append(
        "\ngpu_check: all parts ran" if report["ok"] else f"\ngpu_check: FAILED parts: {', '.join(bad) or 'none ran'}"
    )
    return "\n".join(lines)
