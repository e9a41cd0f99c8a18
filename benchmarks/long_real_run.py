"""Issue 41's long runs on the real model: LoGRA, AdamW and LoRA (and a second LoGRA seed) over 1,100 RL steps.

Run (hours: each row is a ``logra fit`` of SmolLM2-135M-Instruct, continued where it stopped):

    .venv/bin/python -m benchmarks.long_real_run                      # each row up to its steps, then the report
    .venv/bin/python -m benchmarks.long_real_run --rows logra --steps logra=600   # one row, to step 600 for now
    .venv/bin/python -m benchmarks.long_real_run --report-only        # read the logs there are, run nothing
    .venv/bin/python -m benchmarks.long_real_run --report-only --work-dir /elsewhere/runs --out /tmp/r.json
    .venv/bin/python -m benchmarks.long_real_run --quick              # synthetic logs of two sittings (seconds)

Rows (:data:`ROWS`): ``logra`` (``configs/smollm2_long.yaml``, 1,100 steps), ``adamw`` and ``lora`` (its
counterparts, 300), ``logra_seed1`` (the LoGRA config with ``--seed_everything 1``, logged as
``smollm2_long_seed1``, 300), ``logra_seed1_cut0`` (the same with ``--model.truncated_reward 0``: a completion cut
at the length limit scores 0, ``smollm2_long_seed1_cut0``, 300), ``logra_cut0`` (seed 0 with it,
``smollm2_long_cut0``, 1,100: the LoGRA run again, with the kernel caches bounded from step 0), ``logra_cut0_run3``
(the same run under its own name, ``smollm2_long_cut0_run3``, 1,100: ``logra_cut0``'s logs are gone). A row short of
its steps runs ``logra fit --config C --trainer.max_steps N`` (with ``--ckpt_path last`` when its run has a
checkpoint) in a subprocess that logs to ``<work-dir>/<run>/fit_*.log``; the runs write where the configs do
(``runs/<run>/version_N``), not to the benchmark cache. Each sitting is a new ``version_N``:
``benchmarks/run_curves.py`` reads them in order, a later one winning from its first step (docs/long_run.md), and
the row keeps its sittings ``{version, first_step, last_step, resumed_from_step}``.

Per row: per-step series of :data:`TAGS` (``[[step, value], ...]``, 4 significant digits), held-out accuracy
(base at step 0, best, last, gain), skipped steps and batches, the share of completions cut at the length limit
over the last 100 batches, realized KL within 2x of the config's target, RSS slopes,
weight drift, median s/step and training memory. The summary holds issue 41's "Done when" checks
(:func:`done_when`): each ``pass``, ``fail`` or ``not measured`` (its inputs are not in the logs yet; never a
pass). ``--quick`` writes synthetic event files and reads them: it checks the reader, the report and the figure,
not the runs.

Definitions:

1. Trainer RSS: ``memory/forward_backward/current_gb``, the trainer's RSS after backward. Of the four phases'
   ``current_gb`` it is the only one without a ~0.1 GB bump every 5th step (KL control's ``measure_every``), so
   a slope reads growth, not that rhythm. Engine RSS: ``memory/engine_rss_gb`` (the vLLM processes).
2. RSS slope: least squares over the steps in the second half of those reached, one intercept per sitting (a
   resumed sitting is a fresh process whose RSS starts over), in MB per 100 steps, leaving out each sitting's first
   :data:`WARMUP_STEPS`: a fresh process's RSS rises over them and is flat after (the LoGRA run's resumed sittings:
   trainer +20-30 MB in ~10 steps, engine +25-35 MB in 30-50). ``*_with_warmup`` keeps them.
3. Training memory, as ``benchmarks/trl_grpo.py`` defines it: the trainer's peak RSS during training minus its
   RSS after imports, before the model is built. A step's peak is its phases' largest ``memory/<phase>/peak_gb``
   (``MemoryMonitor`` resets the kernel's high-water mark at each phase); the RSS before the model is measured
   once in a fresh process that imports what ``logra fit`` has imported by then (:func:`rss_before_model`), on
   the machine that reads the row's logs, and kept in the row (``rss_before_model_bytes``): it differs by
   machine, and rows kept from the results file may come from another.
4. The accuracy checks compare evaluations after RL began (step > 0) at the steps both runs logged; the gain
   is the last evaluation minus the one at step 0, not measured before an evaluation after step 0.
5. ``logra_steps`` compares with the issue's 1,100, whatever ``--steps`` asked of this sitting.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import yaml

from benchmarks.common import CONFIGS, ROOT, fit_env, run_logged
from benchmarks.harness import QUICK_RESULTS, Benchmark, bench, flat, load, main, out_path
from benchmarks.kl_control import control_init_args
from benchmarks.report import OPS, Col, pct
from benchmarks.run_curves import (
    PHASES,
    by_sitting,
    kl_within_2x,
    moving_mean,
    read_run,
    rises,
    slope_per_100,
    step_peaks,
    steps_reached,
)


class Run(NamedTuple):
    config: str
    steps: int  # the default of --steps
    args: tuple[str, ...] = ()
    name: str | None = None  # the logger's name; None: the config's


ROWS = {
    "logra": Run("smollm2_long.yaml", 1100),
    "adamw": Run("smollm2_long_adamw.yaml", 300),
    "lora": Run("smollm2_long_lora.yaml", 300),
    "logra_seed1": Run("smollm2_long.yaml", 300, ("--seed_everything", "1"), "smollm2_long_seed1"),
    "logra_seed1_cut0": Run(
        "smollm2_long.yaml", 300, ("--seed_everything", "1", "--model.truncated_reward", "0"), "smollm2_long_seed1_cut0"
    ),
    "logra_cut0": Run("smollm2_long.yaml", 1100, ("--model.truncated_reward", "0"), "smollm2_long_cut0"),
    "logra_cut0_run3": Run("smollm2_long.yaml", 1100, ("--model.truncated_reward", "0"), "smollm2_long_cut0_run3"),
}
TRAINER_RSS, ENGINE_RSS, DRIFT = "memory/forward_backward/current_gb", "memory/engine_rss_gb", "sync/weight_drift_max"
WARMUP_STEPS = 50  # a sitting's first steps, left out of the RSS slopes (module docstring: definition 2)
CLIPPED = "completion/clipped_ratio"  # the share of a batch's completions cut at max_new_tokens
STEP_PEAK = "memory/step_peak_gb"  # derived: a step's largest memory/<phase>/peak_gb (run_curves.step_peaks)
TAGS = (  # kept per step in the results (what the checks and the figure read)
    *("val/accuracy", "reward/mean", "policy/entropy", "health/skipped_steps", "health/skipped_batches"),
    *("kl/realized", "kl/step_scale", "sync/logprob_abs_diff_mean", DRIFT, TRAINER_RSS, ENGINE_RSS),
    *("perf/step_seconds", CLIPPED),
)
READ = (*TAGS, *(f"memory/{p}/peak_gb" for p in PHASES))  # read from the event files
STATUSES = ("pass", "fail", "not measured")
TARGETS = {  # issue 41's "Done when", on LoGRA's run: check -> (op, bound)
    "logra_steps": (">=", 1100),
    "logra_skipped": ("<=", 0.01),
    "logra_drift": ("<=", 1e-4),
    "logra_trainer_rss": ("<=", 1.0),
    "logra_engine_rss": ("<=", 1.0),
    "logra_kl_within_2x": (">=", 0.95),
    "accuracy_vs_adamw": (">=", -2.0),
    "best_vs_adamw": (">=", -1.0),
    "logra_gain": (">=", 15.0),
    "memory_vs_adamw": ("<=", 0.5),
}


# ------------------------------------------------------------------------------ the metrics and checks
def row_metrics(
    curves: dict[str, list], sittings: list[dict], target_kl: float, baseline: int | None, warmup: int = WARMUP_STEPS
) -> dict:
    """A row's metrics from its stitched curves (module docstring: definitions)."""
    reached, val = steps_reached(curves), curves.get("val/accuracy", [])
    half = reached / 2  # RSS slopes: the second half of the steps
    base = next((v for s, v in val if s == 0), None)
    skipped = rises(curves.get("health/skipped_steps", []))
    share, kl_median = kl_within_2x([v for _, v in curves.get("kl/realized", [])], target_kl)
    drift, peaks = curves.get(DRIFT, []), step_peaks(curves)
    return {
        "steps_reached": reached,
        "sittings": sittings,
        "skipped_steps": len(skipped),
        "skipped_fraction": len(skipped) / reached if reached else None,
        "skipped_at": sorted(set(skipped)),
        "skipped_batches": len(rises(curves.get("health/skipped_batches", []))),
        "clipped_ratio_last_100": statistics.fmean(v for _, v in cut[-100:]) if (cut := curves.get(CLIPPED)) else None,
        "accuracy_base": base,
        "accuracy_best": max((v for _, v in val), default=None),
        "accuracy_last": val[-1][1] if val else None,
        "accuracy_gain": val[-1][1] - base if base is not None and val[-1][0] > 0 else None,  # after RL began
        "kl_target": target_kl,
        "kl_measured": len(curves.get("kl/realized", [])),
        "kl_within_2x_share": share,
        "kl_realized_median": kl_median,
        **{
            f"{who}_rss_slope_mb_per_100{tail}": slope_per_100(by_sitting(curves.get(tag, []), sittings, half, w))
            for who, tag in (("trainer", TRAINER_RSS), ("engine", ENGINE_RSS))
            for tail, w in (("", warmup), ("_with_warmup", 0))
        },
        "weight_drift_max": max((v for _, v in drift), default=None),
        "weight_drift_steps": len(drift),
        "step_seconds_median": statistics.median(v for _, v in curves["perf/step_seconds"]) if reached else None,
        "rss_before_model_bytes": baseline,
        "training_memory_bytes": round(max(peaks.values()) * 1e9 - baseline)
        if peaks and baseline is not None
        else None,
        "series": {
            t: [[s, float(f"{v:.4g}")] for s, v in series]
            for t, series in ({**curves, STEP_PEAK: sorted(peaks.items())}).items()
            if t in (*TAGS, STEP_PEAK) and series
        },
    }


def check(name: str, what: str, value: float | None, op: str, bound: float) -> dict:
    """A "Done when" check: ``what op bound``, ``not measured`` where the logs do not hold ``value``."""
    status = "not measured" if value is None else ("pass" if OPS[op](value, bound) else "fail")
    value = float(f"{value:.4g}") if isinstance(value, float) else value
    return {"check": name, "compares": f"{what} {op} {bound:g}", "value": value, "status": status}


def done_when(rows: dict[str, dict], s: dict) -> list[dict]:
    """Issue 41's "Done when" checks (``s["targets"]``) over the rows' metrics (``{row: metrics}``, rows with logs)."""
    lo, ad = rows.get("logra", {}), rows.get("adamw", {})
    acc = [{st: v for st, v in r.get("series", {}).get("val/accuracy", []) if st > 0} for r in (lo, ad)]
    common = sorted(acc[0].keys() & acc[1].keys())
    bests = [max(a[x] for x in common) for a in acc] if common else None
    gain = lo.get("accuracy_gain")
    mem = [dict(r.get("series", {}).get(STEP_PEAK, [])) for r in (lo, ad)]
    base = [r.get("rss_before_model_bytes", s.get("rss_before_model_bytes")) for r in (lo, ad)]  # each row's own
    shared = sorted(mem[0].keys() & mem[1].keys()) if None not in base else []
    slope = f"RSS slope over the second half of the steps (each sitting's first {WARMUP_STEPS} out), MB / 100 steps"
    found = {  # name: (what LoGRA's run gives, its value)
        "logra_steps": ("steps reached", lo.get("steps_reached")),
        "logra_skipped": ("skipped steps / steps reached", lo.get("skipped_fraction")),
        "logra_drift": (
            f"max {DRIFT} over the {lo.get('weight_drift_steps', 0)} of {lo.get('steps_reached', 0)} steps logging it",
            lo.get("weight_drift_max"),
        ),
        "logra_trainer_rss": (f"trainer {slope} ({TRAINER_RSS})", lo.get("trainer_rss_slope_mb_per_100")),
        "logra_engine_rss": (f"engine {slope} ({ENGINE_RSS})", lo.get("engine_rss_slope_mb_per_100")),
        "logra_kl_within_2x": (
            f"share of the {lo.get('kl_measured', 0)} kl/realized within 2x of the target {lo.get('kl_target')}",
            lo.get("kl_within_2x_share"),
        ),
        "accuracy_vs_adamw": (
            f"min of (LoGRA - AdamW) over the {len(common)} evaluations after step 0 both logged, points",
            min((100 * (acc[0][x] - acc[1][x]) for x in common), default=None),
        ),
        "best_vs_adamw": (
            f"best - AdamW's best over the {len(common)} evaluations after step 0 both logged, points",
            bests and 100 * (bests[0] - bests[1]),
        ),
        "logra_gain": ("last held-out accuracy - the base model's (step 0), points", gain and 100 * gain),
        "memory_vs_adamw": (
            f"max of training memory / AdamW's over the {len(shared)} steps both logged",
            max(((mem[0][x] * 1e9 - base[0]) / (mem[1][x] * 1e9 - base[1]) for x in shared), default=None),
        ),
    }
    return [check(name, what, value, *s["targets"][name]) for name, (what, value) in found.items()]


# ------------------------------------------------------------------------------ the runs and their logs
def run_name(run: Run) -> str:
    cfg = yaml.safe_load((CONFIGS / run.config).read_text())
    return run.name or cfg["trainer"]["logger"]["init_args"]["name"]


def fit_command(run: Run, work: Path, steps: int) -> list[str]:
    """``logra fit`` of a row up to ``steps``, resumed from its newest ``last.ckpt`` when there is one."""
    name = run_name(run)
    cmd = [sys.executable, "-m", "logra_lightning", "fit", "--config", str(CONFIGS / run.config), *run.args]
    cmd += ["--trainer.logger.init_args.save_dir", str(work), "--trainer.logger.init_args.name", name]
    cmd += ["--trainer.max_steps", str(steps)]
    return cmd + (["--ckpt_path", "last"] if any((work / name).glob("version_*/checkpoints/last*.ckpt")) else [])


def rss_before_model() -> int:
    """The trainer's RSS before it builds the model: a fresh process that imports what ``logra fit`` has by then
    (``benchmarks/trainer_memory.py`` takes the same baseline in ``setup``, with vLLM imported first)."""
    code = (
        "import vllm, lightning, reasoning_gym, transformers.models.llama.modeling_llama, logra_lightning.cli\n"
        "from logra_lightning.optim import host_memory; print(host_memory.rss())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return int(out.stdout.split()[-1])


def write_example_logs(work: Path) -> None:
    """Synthetic event files for ``--quick``: per row two sittings (steps 0-11, then resumed at 8 up to 19)."""
    from torch.utils.tensorboard import SummaryWriter

    for i, run in enumerate(ROWS.values()):
        for version, steps in ((0, range(12)), (1, range(8, 20))):
            with SummaryWriter(work / run_name(run) / f"version_{version}") as w:
                for s in steps:
                    for tag in READ:
                        if tag not in (DRIFT, ENGINE_RSS) or version:  # the new tags: later sittings only
                            w.add_scalar(tag, 0.0 if "skipped" in tag else 1.0 + 0.01 * s + 0.1 * i + 0.05 * version, s)
                    w.add_scalar("kl/realized", 3e-4 * (1 + 0.1 * (s % 3)), s)
                    w.add_scalar("val/accuracy", 0.05 + 0.01 * s * (i + 1), s)


# ------------------------------------------------------------------------------ the benchmark
def _accuracy(r: dict) -> str:
    return f"{pct(r['accuracy_base'])} → {pct(r['accuracy_last'])} ({pct(r['accuracy_best'])})"


def _seconds(r: dict) -> str:
    each = " / ".join(f"{x:.1f}" for st in r["sittings"] if (x := st.get("step_seconds_median")) is not None)
    if r["step_seconds_median"] is None:
        return "–"
    return f"{r['step_seconds_median']:.1f}" + (f" ({each})" if each else "")


def _slopes(r: dict) -> str:
    slopes = (r["trainer_rss_slope_mb_per_100"], r["engine_rss_slope_mb_per_100"])
    return " / ".join("–" if v is None else f"{v:.1f}" for v in slopes)


PANELS = (  # title, tags (solid, dashed)
    ("held-out greedy accuracy (%)", ("val/accuracy",)),
    ("reward (mean over 25 steps)", ("reward/mean",)),
    ("realized KL (target dashed, 2x band dotted)", ("kl/realized",)),
    ("policy entropy", ("policy/entropy",)),
    ("max |engine - trainer| weight", (DRIFT,)),
    ("RSS GB: trainer (solid), engine (dashed)", (TRAINER_RSS, ENGINE_RSS)),
    ("seconds per step", ("perf/step_seconds",)),
    ("completions cut at the length limit (mean over 25 steps)", (CLIPPED,)),
    ("skipped steps (solid), batches (dashed), cumulative", ("health/skipped_steps", "health/skipped_batches")),
)


@bench("long_real_run", title="Long real-model runs: LoGRA, AdamW and LoRA over 1,100 RL steps", quick=[])
class LongRealRun(Benchmark):
    flags = {"rows": list(ROWS), "work_dir": str(ROOT / "runs")}
    columns = [
        Col("row", "name"),
        Col("steps (sittings)", lambda r: f"{r['steps_reached']} ({len(r['sittings'])})"),
        Col("held-out accuracy: base → last (best)", _accuracy),
        Col("skipped steps / batches", lambda r: f"{r['skipped_steps']} / {r['skipped_batches']}"),
        Col("cut at the limit, last 100 batches", "clipped_ratio_last_100", "pct0"),
        Col("realized KL within 2× target", "kl_within_2x_share", "pct0"),
        Col("trainer / engine RSS slope, MB per 100 steps", _slopes),
        Col("max weight drift", "weight_drift_max", ".1e"),
        Col("s/step (median; per sitting)", _seconds),
        Col("training memory MB", "training_memory_bytes", "mb0"),
    ]

    def add_arguments(self, ap) -> None:
        ap.add_argument("--steps", nargs="*", default=[], metavar="ROW=N", help="a row's steps (default: ROWS)")
        ap.add_argument("--report-only", action="store_true", help="read the logs there are; run nothing")
        ap.add_argument("--rss-before-model-mb", type=float, help="default: measured (rss_before_model)")

    def settings(self, args) -> dict:
        steps = dict(kv.split("=", 1) for kv in args.steps)
        unknown = sorted({*args.rows, *steps} - set(ROWS))
        if unknown:
            raise SystemExit(f"unknown rows {unknown} in --rows/--steps (allowed: {', '.join(ROWS)})")
        rows = {
            name: {"config": f"configs/{r.config}", "args": list(r.args), "run": run_name(r)}
            | {"steps": int(steps.get(name, r.steps))}
            for name, r in ROWS.items()
        }
        return {
            "rows": rows,
            "work_dir": str(QUICK_RESULTS / "long_real_run_runs" if args.quick else Path(args.work_dir)),
            "report_only": args.report_only or args.quick,
            "tags": {"trainer_rss": TRAINER_RSS, "engine_rss": ENGINE_RSS, "drift": DRIFT},
            "targets": TARGETS,
        }

    def run(self, args, settings: dict) -> list[dict]:
        work = Path(settings["work_dir"])
        if args.quick:
            shutil.rmtree(work, ignore_errors=True)
            write_example_logs(work)
        mb = 500.0 if args.quick else args.rss_before_model_mb  # quick: a round baseline for synthetic memory
        settings["rss_before_model_bytes"] = rss_before_model() if mb is None else round(mb * 1e6)
        # A row whose logs are not on this machine (a workspace does not outlive its sessions) keeps the row the
        # results file holds, so recording one row's sitting does not drop the others.
        out = out_path(self, args)
        before = {r["name"]: r for r in (load(out.stem, out.parent) or {}).get("rows", [])}
        rows, settings["kept_from_results"], settings["not_run"] = [], [], []
        for name in args.rows:
            got = self.row(name, settings, work)
            if got is None and name in before:
                got = before[name]
                settings["kept_from_results"].append(name)
            if got is None:
                settings["not_run"].append(name)
            else:
                rows.append(got)
        return rows

    def row(self, name: str, settings: dict, work: Path) -> dict | None:
        """Row ``name``: its run continued up to its steps (unless ``report_only``), then read; ``None`` when it has
        no logs and nothing failed (a row not run yet is not a measurement)."""
        spec, error = settings["rows"][name], None
        run_dir = work / spec["run"]
        if not settings["report_only"] and steps_reached(read_run(run_dir, list(READ))[0]) < spec["steps"]:
            cmd = fit_command(ROWS[name], work, spec["steps"])
            log = run_dir / f"fit_{time.strftime('%Y%m%d_%H%M%S')}.log"
            rc = run_logged(cmd, log, env=fit_env())["rc"]
            spec.setdefault("commands", []).append(" ".join(cmd[1:]))
            error = None if rc == 0 else f"logra fit exited {rc} (log: {log})"
        curves, sittings = read_run(run_dir, list(READ))
        if not curves and error is None:
            return None
        if not curves:
            return {"name": name, "ok": False, "error": f"{error}; no event files in {run_dir}", "metrics": {}}
        target = control_init_args(ROOT / spec["config"])["target_kl"]
        metrics = row_metrics(curves, sittings, target, settings["rss_before_model_bytes"])
        return {"name": name, "ok": error is None, "error": error, "metrics": {"run_dir": str(run_dir), **metrics}}

    def summarize(self, settings: dict, rows: list[dict]) -> dict:
        checks = done_when({r["name"]: r["metrics"] for r in rows if r["metrics"]}, settings)
        return {"checks": checks, "counts": {k: sum(c["status"] == k for c in checks) for k in STATUSES}}

    def describe(self, res: dict) -> str:
        n, st = res["summary"]["counts"], res["settings"]
        text = "SmolLM2-135M-Instruct on chain_sum (`configs/smollm2_long*.yaml`), each row stitched from its "
        text += f"sittings; issue 41's checks: {n['pass']} pass, {n['fail']} fail, {n['not measured']} not measured "
        text += "(`summary.checks`)."
        if st.get("not_run"):
            text += f" Not run yet: {', '.join(st['not_run'])}."
        if st.get("kept_from_results"):
            text += " Rows as an earlier report recorded them (their logs are not on the machine that wrote this one): "
            text += f"{', '.join(st['kept_from_results'])}."
        return text

    def plot(self, res: dict, plt):
        """:data:`PANELS` against the step, one colour per row; a dotted line where a row's sitting resumed."""
        fig, axes = plt.subplots(5, 2, figsize=(12, 15), sharex=True)
        for i, r in enumerate(flat(row) for row in res["rows"] if row["metrics"]):
            for ax, (_, tags) in zip(axes.flat, PANELS):
                for tag, ls in zip(tags, ("-", "--")):
                    if not r["series"].get(tag):
                        continue
                    x, y = zip(*r["series"][tag])  # [steps], [values]
                    y = [100 * v for v in y] if tag == "val/accuracy" else y
                    y = moving_mean(list(y), 25) if tag in ("reward/mean", CLIPPED) else y
                    marker, label = ("o" if tag == "val/accuracy" else None), (r["name"] if ls == "-" else None)
                    ax.plot(x, y, ls=ls, color=f"C{i}", lw=0.9, marker=marker, ms=3, label=label)
                for st in r["sittings"]:
                    if st["resumed_from_step"] is not None:
                        ax.axvline(st["resumed_from_step"], color=f"C{i}", ls=":", lw=0.8)
            for f, ls in ((0.5, ":"), (1, "--"), (2, ":")):
                axes.flat[2].axhline(f * r["kl_target"], color="gray", ls=ls, lw=0.8)
        for ax, (title, tags) in zip(axes.flat, PANELS):
            ax.set_title(title, fontsize=9)
            if tags[0] in ("kl/realized", DRIFT) and ax.has_data():
                ax.set_yscale("log")
        axes.flat[0].legend(fontsize=7)
        axes.flat[-1].set_visible(len(PANELS) == axes.size)
        for ax in axes[-1]:
            ax.set_xlabel("RL step (dotted: a sitting resumed)")
        fig.suptitle("Long real-model runs (issue 41)", fontsize=10)
        return fig


if __name__ == "__main__":
    main(LongRealRun)
