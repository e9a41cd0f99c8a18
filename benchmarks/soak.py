"""The soak: 1,100 RL steps of the demo config with flat memory, low engine drift and no skipped step.

Run (about 20 min on the 2-core machine; resumable):

    .venv/bin/python -m benchmarks.soak                      # 1,100 steps of configs/arithmetic_tiny.yaml
    .venv/bin/python -m benchmarks.soak --resume             # continue an interrupted run from its last checkpoint
    .venv/bin/python -m benchmarks.soak --steps 300 --out benchmarks/results/soak_300.json   # a short look
    .venv/bin/python -m benchmarks.soak --quick --steps 4   # a smoke run

``logra fit --config configs/arithmetic_tiny.yaml`` as shipped (vLLM engine, low-rank weight sync
after every step, ``KLStepControl``, held-out evaluation every 50 steps) with one more callback,
:class:`SoakProbe`, which after every training step appends to ``samples.jsonl``: the RSS of the
trainer process and of every vLLM process (``VLLM::EngineCore``, ``VLLM::Worker``), the engine's
drift (``|engine - trainer|`` logprob of the step's sampled tokens, mean and max), the realized KL
(every ``measure_every`` steps) and the skipped-step count. A checkpoint every 100 steps makes the
run resumable; a resumed run is a new *segment* (fresh processes, so its RSS starts over), recorded
as such, and the slopes are taken over the second half of the run within its last segment only.

Summary (``benchmarks/results/soak.json``):

* ``trainer_rss_slope_mb_per_100`` / ``engine_rss_slope_mb_per_100``: least-squares slope of the
  RSS (MB; the engine: all vLLM processes together) over the second half of the steps, per 100 steps
  (target <= 1 for both);
* ``max_drift``: the largest per-step max ``|engine - trainer|`` logprob (target <= 1e-4);
* ``skipped``: steps skipped by the fault policy (target 0); plus the growth before the second
  half and the RSS at a few steps.

The variants ``soak_300_onednn_cache_{default,64}`` and ``soak_1100_no_trim`` are runs without the engine's
bounded oneDNN kernel cache and without its heap trim after each sync (docs/results.md reads them).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from benchmarks.common import CONFIGS, WORK_DIR, config_callbacks, config_defaults, pythonpath, run_logged
from benchmarks.harness import Benchmark, bench, main
from benchmarks.report import load_text, met, num, rows_table
from benchmarks.run_curves import slope_per_100
from logra_lightning.optim.host_memory import CPU_KERNEL_CACHES

MB = 1 << 20
TARGETS = {"rss_slope_mb_per_100_max": 1.0, "max_drift_max": 1e-4, "skipped_max": 0}
CHECKPOINT_EVERY = 100


def _rss_mb(proc) -> float:
    return proc.memory_info().rss / MB


class SoakProbe(Callback):
    """After every training step, append one JSON line of memory, drift, KL and skips to ``out``.

    Args:
        out: the JSON-lines file (appended to; created with its folder).
        segment: which run of the soak this is (0, then 1, 2, ... after each resume).
    """

    def __init__(self, out: str, segment: int = 0) -> None:
        self.out = Path(out)
        self.segment = segment
        self._start = time.time()
        self._last_kl: dict | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        import psutil

        me = psutil.Process()
        engine, other = {}, {}
        for child in me.children(recursive=True):
            try:
                name, rss = child.name(), _rss_mb(child)
            except psutil.Error:
                continue
            (engine if name.startswith("VLLM::") else other)[f"{name}:{child.pid}"] = round(rss, 1)
        gap = getattr(pl_module, "engine_logprob_gap", None)
        kl = next((cb for cb in trainer.callbacks if hasattr(cb, "history") and hasattr(cb, "target_kl")), None)
        last = kl.history[-1] if kl is not None and kl.history else None
        realized = None
        if last is not None and last is not self._last_kl:  # a record of this step (measured every few steps)
            self._last_kl, realized = last, last.get("realized")
        faults = getattr(pl_module, "faults", None)
        row = {
            "step": trainer.global_step,
            "segment": self.segment,
            "seconds": round(time.time() - self._start, 2),
            "trainer_rss_mb": round(_rss_mb(me), 1),
            "engine_rss_mb": round(sum(engine.values()), 1),
            "engine_processes": engine,
            "other_children": other,
            "drift_mean": None if gap is None else float(gap[0]),
            "drift_max": None if gap is None else float(gap[1]),
            "kl_realized": realized,
            "skipped_steps": getattr(faults, "skipped_steps", None),
            "skipped_batches": getattr(faults, "skipped_batches", None),
        }
        self.out.parent.mkdir(parents=True, exist_ok=True)
        with open(self.out, "a") as f:
            f.write(json.dumps(row) + "\n")


# ------------------------------------------------------------------------------ the run
def read_samples(path: Path) -> list[dict]:
    """The probe's rows; for a step recorded twice (re-run after a resume) the later row wins."""
    if not path.is_file():
        return []
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


def summarize(samples: list[dict], steps: int) -> dict[str, Any]:
    """The summary the issue asks for, plus where the memory was at a few steps."""
    if not samples:
        return {"steps": 0}
    half = steps // 2
    last_segment = samples[-1]["segment"]
    second = [r for r in samples if r["step"] >= half and r["segment"] == last_segment]
    first_of_second = second[0] if second else None
    drifts = [r["drift_max"] for r in samples if r["drift_max"] is not None]
    kls = [r["kl_realized"] for r in samples if r["kl_realized"] is not None]

    def slope(who: str) -> float | None:  # least squares over the second half, MB per 100 steps
        points = [(r["step"], r[f"{who}_rss_mb"]) for r in second]
        return slope_per_100([points] if points else [], scale=1.0)

    at = {}
    for s in sorted({1, 50, 100, 200, half, steps}):
        row = next((r for r in samples if r["step"] >= s), None)
        if row is not None:
            at[str(row["step"])] = {"trainer": row["trainer_rss_mb"], "engine": row["engine_rss_mb"]}
    return {
        "steps": samples[-1]["step"],
        "trainer_rss_slope_mb_per_100": slope("trainer"),
        "engine_rss_slope_mb_per_100": slope("engine"),
        "max_drift": max(drifts) if drifts else None,
        "mean_drift": sum(r["drift_mean"] for r in samples if r["drift_mean"] is not None) / max(1, len(drifts)),
        "skipped": samples[-1]["skipped_steps"],
        "skipped_batches": samples[-1]["skipped_batches"],
        "max_kl_realized": max(kls) if kls else None,
        "kl_measurements": len(kls),
        "segments": last_segment + 1,
        "second_half_in_one_segment": bool(second)
        and all(r["segment"] == last_segment for r in samples if r["step"] >= half),
        "growth_before_second_half_mb": None
        if first_of_second is None
        else {
            "trainer": round(first_of_second["trainer_rss_mb"] - samples[0]["trainer_rss_mb"], 1),
            "engine": round(first_of_second["engine_rss_mb"] - samples[0]["engine_rss_mb"], 1),
        },
        "rss_mb_at_step": at,
    }


def fit_command(config: str, steps: int, work_dir: Path, samples: Path, segment: int, resume: bool) -> list[str]:
    probe = {"class_path": "benchmarks.soak.SoakProbe", "init_args": {"out": str(samples), "segment": segment}}
    ckpt = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"every_n_train_steps": CHECKPOINT_EVERY, "save_last": True, "save_top_k": 0},
    }
    callbacks = [*config_callbacks(config), probe, ckpt]
    cmd = [sys.executable, "-m", "logra_lightning", "fit", "--config", str(config), "--trainer.max_steps", str(steps)]
    cmd += ["--trainer.logger.init_args.save_dir", str(work_dir), "--trainer.logger.init_args.name", "soak"]
    return cmd + ["--trainer.callbacks", json.dumps(callbacks)] + (["--ckpt_path", "last"] if resume else [])


@bench(
    "soak",
    title="Soak: 1,100 RL steps",
    quick=["--steps", "4"],
    variants=("soak_1100_no_trim", "soak_300_onednn_cache_64", "soak_300_onednn_cache_default"),
)
class Soak(Benchmark):
    flags = {"config": str(CONFIGS / "arithmetic_tiny.yaml"), "steps": 1100, "work_dir": str(WORK_DIR / "soak")}

    def add_arguments(self, ap) -> None:
        ap.add_argument("--resume", action="store_true", help="continue the run in --work-dir from its last checkpoint")

    def settings(self, args) -> dict:
        return {
            **config_defaults(args.config),
            "steps": args.steps,
            "checkpoint_every": CHECKPOINT_EVERY,
            "env": {k: os.environ.get(k) for k in (*CPU_KERNEL_CACHES, "VLLM_CPU_KVCACHE_SPACE")},
            "targets": TARGETS,
        }

    def run(self, args, settings: dict) -> list[dict]:
        """One segment of ``logra fit`` (the whole run, or what is left of it with ``--resume``)."""
        work = Path(args.work_dir)
        samples_path = work / "samples.jsonl"
        if not args.resume:
            shutil.rmtree(work, ignore_errors=True)
        previous = read_samples(samples_path)
        segment = previous[-1]["segment"] + 1 if previous else 0
        cmd = fit_command(args.config, args.steps, work, samples_path, segment, resume=bool(previous))
        env = {"PYTHONPATH": pythonpath(), "TOKENIZERS_PARALLELISM": "false"}
        rc = run_logged(cmd, work / f"segment{segment}.log", env=env)["rc"]
        settings.update(fit_command=" ".join(cmd[1:]), returncode=rc)
        self.samples = read_samples(samples_path)
        error = None if rc == 0 else f"logra fit exited {rc} (log: {work / f'segment{segment}.log'})"
        return [
            {"name": f"step{r['step']}", "ok": error is None, "error": error, "metrics": _plain(r)}
            for r in self.samples
        ]

    def summarize(self, settings: dict, rows: list[dict]) -> dict:
        return summarize(self.samples, settings["steps"])

    def plot(self, res: dict, plt):
        samples = [r["metrics"] for r in res["rows"]]
        steps = [r["step"] for r in samples]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        ax1.plot(steps, [r["trainer_rss_mb"] for r in samples], label="trainer")
        ax1.plot(steps, [r["engine_rss_mb"] for r in samples], label="vLLM engine (all processes)")
        ax1.axvline(res["settings"]["steps"] / 2, color="grey", lw=0.8, ls=":")
        ax1.set_ylabel("RSS (MB)")
        ax1.legend()
        ax1.set_title(f"Soak: {res['settings']['config']}, {res['summary'].get('steps')} RL steps")
        ax2.semilogy(steps, [max(r["drift_max"] or 1e-12, 1e-12) for r in samples], label="drift (max |Δ logprob|)")
        kl = [(r["step"], r["kl_realized"]) for r in samples if r["kl_realized"]]
        if kl:
            ax2.semilogy([s for s, _ in kl], [v for _, v in kl], ".", ms=3, label="realized KL")
        ax2.axhline(TARGETS["max_drift_max"], color="red", lw=0.8, ls="--", label="drift target")
        ax2.set_xlabel("step")
        ax2.legend()
        return fig

    def section(self, res: dict) -> list[str]:
        s, tg, e, steps = res["summary"], res["settings"]["targets"], res["envelope"], res["settings"]["steps"]
        slopes = (s.get("trainer_rss_slope_mb_per_100"), s.get("engine_rss_slope_mb_per_100"))
        slope_ok = all(x is not None and x <= tg["rss_slope_mb_per_100_max"] for x in slopes)
        drift_ok = s.get("max_drift") is not None and s["max_drift"] <= tg["max_drift_max"]
        rows = [
            ["steps", str(s.get("steps")), f">= {steps}", met(s.get("steps", 0) >= steps)],
            ["trainer RSS slope, 2nd half (MB / 100 steps)", num(slopes[0]), "<= 1", met(slope_ok)],
            ["engine RSS slope, 2nd half (MB / 100 steps)", num(slopes[1]), "<= 1", met(slope_ok)],
            ["max drift (max abs logprob gap)", num(s.get("max_drift"), ".2e"), "<= 1e-4", met(drift_ok)],
            ["skipped steps", str(s.get("skipped")), "0", met(s.get("skipped") == 0)],
            ["max realized KL", num(s.get("max_kl_realized"), ".2e"), "", ""],
        ]
        return [
            f"Command: `{e['command']}` — {e['wall_seconds']:.0f} s, load {load_text(e['load_start'])} "
            f"at start, {load_text(e['load_end'])} at end; {s.get('segments')} segment(s).",
            "",
            *rows_table(["", "measured", "target", ""], rows),
            "",
            f"RSS (MB) at steps: {json.dumps(s.get('rss_mb_at_step'))}.",
            "",
        ]

    def headline(self, results: dict) -> list[str]:
        s = (results.get("soak") or {}).get("summary")
        if not s:
            return []
        return [
            f"- Soak, {s['steps']} RL steps of the demo (vLLM, low-rank sync every step, KL control): RSS slope over "
            f"the second half {num(s['trainer_rss_slope_mb_per_100'])} MB/100 steps (trainer), "
            f"{num(s['engine_rss_slope_mb_per_100'])} (engine); max drift {num(s['max_drift'], '.1e')}; "
            f"{s['skipped']} skipped steps ([soak](#soak-1100-rl-steps))."
        ]


def _plain(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if k != "other_children"}


if __name__ == "__main__":
    main(Soak)
