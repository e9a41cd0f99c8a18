"""One offline GPU check: dense AdamW vs LoGRA on real Qwen2.5 shapes, the vLLM engine on the same GPU.

    scripts/gpu_check.sh                  # CUDA machine: installs CUDA torch + vLLM if needed, ~10 min
    scripts/gpu_check.sh --dry-run        # CPU: same code path, tiny shapes, fp32, vLLM CPU engine
    scripts/gpu_check.sh --summarize benchmarks/results/gpu_check.json

(``gpu_check.sh`` picks the interpreter and installs; it runs ``python scripts/gpu_check.py run ...``.)

For each model of :data:`gpu_check_models.MODELS` (Qwen2.5-0.5B, Qwen2.5-1.5B, a 4-layer
Qwen2.5-7B), built locally with random weights, and each optimizer (``torch.optim.AdamW``,
``logra_lightning.optim.LoGRA``), one *part* runs ``logra fit`` (``cli.run``) on a generated
config: a few GRPO steps with ``KLStepControl`` (realized KL measured every step),
``LowRankWeightSync`` and ``MemoryMonitor``, rollouts from a vLLM engine colocated on the
trainer's GPU (``gpu_memory_utilization``). It prints, and writes to one JSON
(``benchmarks/results/gpu_check.json``; the dry run writes under ``/tmp`` unless ``--out``):
peak memory per phase, ``logra plan``'s prediction for the same setting and measured/predicted,
seconds per step, sync bytes and seconds, engine-vs-trainer logprob drift, predicted vs
realized KL. Every part runs in its own process group with a timeout (killed whole, engine
included); a part that fails or times out is recorded with its error and the rest go on.
``--engine hf`` (what ``gpu_check.sh`` falls back to where vLLM cannot be installed) runs the same
parts with the trainer's own HF ``generate`` on a synced copy of the weights.

The numbers (what is compared with what, and why) are explained in ``gpu_check_report.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_check_measure import DeviceUsageSampler, machine_info, read_scalars
from gpu_check_report import (
    GB,
    check_report,
    format_summary,
    make_report,
    plan_command,
    plan_setup_kwargs,
    predict,
    summarize_part,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

OPTIMIZERS = {
    "adamw": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-4, "weight_decay": 0.0}},
    "logra": {
        "class_path": "logra_lightning.optim.LoGRA",
        "init_args": {"lr": 1e-4, "rank": None, "update_proj_gap": 50, "weight_decay": 0.0},
    },
}

#: Sizes of a run. ``cuda``: the real check; ``dry``: the CPU rehearsal of the same code path.
SETTINGS: dict[str, dict[str, Any]] = {
    "cuda": dict(
        device="cuda",
        precision="bf16-mixed",
        engine_dtype="bfloat16",
        model_dtype="bfloat16",
        steps=3,
        batch_size=8,
        group_size=8,
        max_new_tokens=128,
        micro_batch_size=16,
        rank=64,
        max_model_len=256,
        gpu_memory_utilization=0.25,
        kv_cache_space_gb=None,
        torch_threads=None,
        target_kl=1e-3,
        sample_tokens=256,
        finish_fraction=0.3,
        dry_hidden=None,
        budget_s=600,
        build_timeout_s=180,
        part_timeout_s=150,
        min_part_s=45,
    ),
    "dry": dict(
        device="cpu",
        precision="32-true",
        engine_dtype="float32",
        model_dtype="float32",
        steps=2,
        batch_size=2,
        group_size=4,
        max_new_tokens=16,
        micro_batch_size=8,
        rank=8,
        max_model_len=64,
        gpu_memory_utilization=0.5,
        kv_cache_space_gb=0.25,
        torch_threads=1,
        target_kl=1e-3,
        sample_tokens=64,
        finish_fraction=0.5,
        dry_hidden={"qwen2.5-0.5b": 128, "qwen2.5-1.5b": 192, "qwen2.5-7b-4l": 256},
        budget_s=1500,
        build_timeout_s=120,
        part_timeout_s=300,
        min_part_s=60,
    ),
}


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
        engine = {
            "class_path": "logra_lightning.rollout.VLLMEngineSpec",
            "init_args": {
                "dtype": s["engine_dtype"],
                "max_model_len": s["max_model_len"],
                "enforce_eager": True,
                "gpu_memory_utilization": s["gpu_memory_utilization"],
                "kv_cache_space_gb": s["kv_cache_space_gb"],
            },
        }
    else:  # the fallback where vLLM cannot be installed: the trainer's own HF generate, a synced copy
        engine = {"class_path": "logra_lightning.rollout.HFEngineSpec", "init_args": {"copy_weights": True}}
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "gpu" if s["device"] == "cuda" else "cpu",
            "devices": 1,
            "precision": s["precision"],
            "max_steps": s["steps"],
            "num_sanity_val_steps": 0,
            "limit_val_batches": 0,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "log_every_n_steps": 1,
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": run_dir, "name": f"{model}-{optimizer}", "version": 0},
            },
            "callbacks": [
                {
                    "class_path": "logra_lightning.callbacks.KLStepControl",
                    "init_args": {
                        "target_kl": s["target_kl"],
                        "min_scale": 0.0,
                        "sample_tokens": s["sample_tokens"],
                        "measure_every": 1,
                    },
                },
                {"class_path": "logra_lightning.callbacks.LowRankWeightSync", "init_args": {"full_sync_every": 0}},
                {"class_path": "logra_lightning.callbacks.MemoryMonitor"},
            ],
        },
        "model": {
            "model": model_dir,
            "group_size": s["group_size"],
            "max_new_tokens": s["max_new_tokens"],
            "temperature": 1.0,
            "micro_batch_size": s["micro_batch_size"],
            "activation_checkpointing": True,
            "torch_threads": s["torch_threads"],
            "max_consecutive_skips": 3,
            "reward": {"class_path": "gpu_check_models.DigitShareReward"},
            "engine": engine,
            "optimizer": opt,
        },
        "data": {
            "train": {
                "class_path": "logra_lightning.data.ArithmeticSource",
                "init_args": {"split": "train", "max_digits": 2, "ops": "+", "test_size": 16, "seed": 0},
            },
            "val": None,
            "batch_size": s["batch_size"],
        },
    }


# ------------------------------------------------------------------------------- subprocesses
def run_limited(cmd: list[str], timeout: float, log: Path, env: dict | None = None) -> tuple[str, float]:
    """Run ``cmd`` in its own process group with output to ``log``; kill the whole group at ``timeout``.

    Returns ``(status, seconds)``: ``"ok"``, ``"failed (exit N)"`` or ``"timeout"``.
    """
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT, env={**os.environ, **(env or {})}
        )
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
            wanted = {
                "shape": shape,
                "max_new_tokens": s["max_new_tokens"],
                "finish_fraction": s["finish_fraction"],
                "dtype": s["model_dtype"],
            }
            if all(old.get(k) == v for k, v in wanted.items()):
                info = {**old, "reused": True}  # built by an earlier run with the same settings
            else:
                info = build_model_dir(
                    path,
                    shape,
                    max_new_tokens=s["max_new_tokens"],
                    dtype=s["model_dtype"],
                    device=s["device"],
                    finish_fraction=s["finish_fraction"],
                )
            out["models"][model] = {"status": "ok", "path": str(path), **info}
        except Exception as e:  # noqa: BLE001 - recorded, the other models still build
            out["models"][model] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        if s["device"] == "cuda":
            torch.cuda.empty_cache()
        Path(spec["out"]).write_text(json.dumps(out, indent=2))


def worker_fit(spec: dict) -> None:
    """Subprocess: ``logra fit`` on the part's generated config, then its summary as JSON."""
    import torch
    import yaml

    from logra_lightning.callbacks import KLStepControl
    from logra_lightning.cli import run as logra

    torch.multiprocessing.set_start_method("spawn", force=True)  # as `logra` itself; vLLM's workers spawn
    run_dir = Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = fit_config(spec["model"], spec["optimizer"], spec["settings"], spec["model_dir"], str(run_dir))
    cfg_path = run_dir / "fit_config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    device = spec["settings"]["device"]
    with DeviceUsageSampler(device) as sampler:
        cli = logra(["fit", "--config", str(cfg_path)])
    control = next(cb for cb in cli.trainer.callbacks if isinstance(cb, KLStepControl))
    history = [{k: v for k, v in r.items() if isinstance(v, (int, float, bool)) or v is None} for r in control.history]
    result = {
        "log_dir": cli.trainer.log_dir,
        "scalars": read_scalars(cli.trainer.log_dir),
        "kl_history": history,
        "device_used_peak_gb": sampler.peak / GB if sampler.peak else None,
    }
    Path(spec["out"]).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------ driver
def _user_args(argv: list[str]) -> list[str]:
    """The command line as a user would type it again (without the shell's ``--deadline``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--deadline":
            skip = True
        elif not a.startswith("--deadline="):
            out.append(a)
    return out


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
    out = (
        Path(args.out)
        if args.out
        else (
            ROOT / "benchmarks" / "results" / "gpu_check.json"
            if mode == "cuda"
            else Path(tempfile.gettempdir()) / "gpu_check_dry" / "gpu_check.json"
        )
    )
    work = Path(args.work or (ROOT / "runs" / "gpu_check" if mode == "cuda" else out.parent / f"{out.stem}_work"))
    work.mkdir(parents=True, exist_ok=True)
    shapes = {m: model_shape(m, s) for m in args.models}
    print(
        f"gpu_check: {mode} run, models {', '.join(args.models)}, optimizers {', '.join(args.optimizers)}, "
        f"{s['steps']} steps each; work dir {work}; budget {deadline - time.time():.0f} s",
        flush=True,
    )

    status, seconds, built, log = _worker(
        "build",
        {"name": "build", "settings": s, "shapes": shapes, "models_dir": str(work / "models")},
        work,
        min(s["build_timeout_s"], deadline - time.time()),
    )
    built = built or {"machine": {"device": s["device"]}, "models": {}}
    for m in args.models:
        built["models"].setdefault(
            m, {"status": "failed", "error": f"model build {status} after {seconds:.0f} s; log {log}:\n{_tail(log)}"}
        )
    print(f"gpu_check: models built in {seconds:.0f} s ({status})", flush=True)
    machine = built["machine"]
    runs = []
    for model in args.models:
        for opt in args.optimizers:
            run = {"model": model, "optimizer": opt}
            left = deadline - time.time() - 5
            mb = built["models"][model]
            if mb["status"] != "ok":
                runs.append(
                    {**run, "status": "skipped", "wall_seconds": 0.0, "error": f"model not built: {mb['error']}"}
                )
                continue
            if left < s["min_part_s"]:
                runs.append(
                    {
                        **run,
                        "status": "skipped",
                        "wall_seconds": 0.0,
                        "error": f"not started: {max(left, 0):.0f} s left of the time budget",
                    }
                )
                continue
            print(f"gpu_check: {model} / {opt} ...", flush=True)
            spec = {
                "name": f"{model}-{opt}",
                "model": model,
                "optimizer": opt,
                "settings": s,
                "model_dir": mb["path"],
                "run_dir": str(work / "runs"),
            }
            status, seconds, result, log = _worker("fit", spec, work, min(s["part_timeout_s"], left))
            run["wall_seconds"] = seconds
            if status != "ok":
                why = "timed out" if status == "timeout" else status
                runs.append(
                    {**run, "status": status, "error": f"{why} after {seconds:.0f} s; log {log}:\n{_tail(log)}"}
                )
                print(f"gpu_check: {model} / {opt}: {why}", flush=True)
                continue
            setup_kw = plan_setup_kwargs(s, machine.get("device_memory_gb") or 80.0)
            engine_budget = (
                s["gpu_memory_utilization"] * machine.get("device_memory_gb", 0)
                if s["device"] == "cuda" and s["engine"] == "vllm"
                else 0.0
            )
            try:
                summary = summarize_part(
                    result["scalars"],
                    result["kl_history"],
                    predict(shapes[model], opt, setup_kw, s["engine"]),
                    result["device_used_peak_gb"],
                    engine_budget,
                )
            except Exception as e:  # noqa: BLE001 - a part whose numbers cannot be read is a failed part
                runs.append({**run, "status": "failed (summary)", "error": f"{type(e).__name__}: {e}; log {log}"})
                continue
            runs.append(
                {
                    **run,
                    "status": "ok",
                    **summary,
                    "plan_command": plan_command(mb["path"], setup_kw),
                    "log_dir": result["log_dir"],
                }
            )
    machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]  # a shared machine times slower
    install = {
        "seconds": float(os.environ["GPU_CHECK_INSTALL_SECONDS"])
        if os.environ.get("GPU_CHECK_INSTALL_SECONDS")
        else None,
        "note": os.environ.get("GPU_CHECK_INSTALL_NOTE", ""),
    }
    report = make_report(
        mode,
        start,
        time.time() - float(os.environ.get("GPU_CHECK_START", start)),
        machine,
        s,
        install,
        {m: {"shape": shapes[m], **built["models"][m]} for m in args.models},
        runs,
        command=" ".join(["scripts/gpu_check.sh", *_user_args(sys.argv[2:])]),
    )
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
    run.add_argument(
        "--engine",
        default="vllm",
        choices=("vllm", "hf"),
        help="rollout engine: vLLM colocated (the check), or HF generate where vLLM cannot be installed",
    )
    run.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu_check.json; dry: /tmp)")
    run.add_argument(
        "--work", default=None, help="models, logs and run dirs (default runs/gpu_check; dry: beside --out)"
    )
    run.add_argument("--budget-s", type=float, default=None, help="time for the whole check (600 s on CUDA)")
    run.add_argument("--deadline", type=float, default=None, help="absolute end time (epoch s), set by gpu_check.sh")
    for kind in ("build", "fit"):
        sub.add_parser(kind, help=f"internal: the {kind} worker").add_argument("spec")
    sub.add_parser("summarize", help="print the summary of a written JSON").add_argument("json")
    return ap


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_limited, which kills the running part's group


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "run":
        signal.signal(signal.SIGTERM, _terminated)  # e.g. the outer `timeout` of gpu_check.sh
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
