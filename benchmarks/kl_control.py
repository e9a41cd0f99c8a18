"""Stability at a high learning rate: LoGRA at 10x the demo lr, with and without ``KLStepControl``; its overhead.

Run (full: three ``logra fit`` runs of the config's length per seed, seeds 0 1 2, two at a time,
then one 60-step demo run alone):

    .venv/bin/python -m benchmarks.kl_control
    .venv/bin/python -m benchmarks.kl_control --steps 100             # as `make bench` runs it
    .venv/bin/python -m benchmarks.kl_control --lr 3e-5 --steps 300 --target-kl 1e-3 --seeds 0 1
    .venv/bin/python -m benchmarks.kl_control --quick          # 4 steps each, 64 held-out prompts (CI)

The issue-4 runs, each a real ``logra fit`` in its own process on the arithmetic RL task:

* ``default_lr``: LoGRA at the demo's lr, no control;
* ``high_lr``: LoGRA at ``--lr-multiplier`` (10) x that lr, no control;
* ``high_lr_kl_control``: the same with the demo's ``KLStepControl`` (``target_kl`` T,
  ``min_scale``, ``sample_tokens``);
* ``demo_overhead``: ``logra fit --config configs/arithmetic_tiny.yaml`` as shipped (its own
  ``KLStepControl``, vLLM engine, low-rank weight sync) for ``--overhead-steps`` steps, to time
  the control.

Where the settings come from (nothing is hard-coded): the three stability runs use the HF-engine
LoGRA config (``--config``, default ``configs/arithmetic_tiny_logra.yaml``: rank,
``update_proj_gap``, task, budget); the default lr and the ``KLStepControl`` arguments come from
the demo config (``--demo-config``, default ``configs/arithmetic_tiny.yaml``), so the control is
measured as the demo ships it. Departures, so that all three stability runs are measured the
same way:

1. ``measure_every`` is 1 (every step; the demo measures every 5th), so every step has a
   realized KL.
2. The two runs "without control" carry ``KLStepControl`` with ``min_scale = max_scale = 1``
   (the step scale is always 1, so the update is the optimizer's own), which logs
   ``kl/predicted`` and ``kl/realized`` without changing the step beyond the rounding of the
   probe's ``+eps``/``-eps`` weight perturbation.

The stability runs use one torch thread each (``--model.torch_threads 1``, as ``quality.py``) and
run ``--jobs`` (2) at a time, so their s/step columns are under that load; the overhead run runs
alone with the demo's threads. Accuracy is compared per row as the mean over seeds (with min and
max): "no worse" means the controlled high-lr mean is at least the default-lr mean.

Reported per run: the held-out accuracy curve, the per-step ``kl/realized``, ``kl/predicted``
(calibrated) and raw prediction, step scale; the share of measured steps with realized KL
<= 1.5 T (target >= 95% with control); median |log(realized / raw prediction)| (target <= log 1.5);
median step seconds. Overhead (``demo_overhead``): per step, the callback logs
``kl/control_seconds`` (wall time it added) next to the module's ``perf/step_seconds`` (which
includes it); ``overhead_share = median(control) / median(step - control)`` over the steps after
the first ``--overhead-warmup`` (5; 0 with ``--quick``), target <= 5% (issue 18; it was 15%); the mean
``overhead_share_mean = mean(control) / mean(step - control)`` counts the measured steps' extra forward
too. That one is a timing:
run it on a quiet machine (the load is recorded with every run).
Results: ``benchmarks/results/kl_control[_quick].json``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import (
    CONFIGS,
    RESULTS,
    WORK_DIR,
    budget_args,
    config_callbacks,
    config_defaults,
    load_average,
    logra_fit,
    machine_info,
    write_result,
)
from benchmarks.quality import QUICK
from benchmarks.report import Report, clip, command_head, load_text, met, num, pct
from benchmarks.report import rows_table as table

CONTROL = "logra_lightning.callbacks.KLStepControl"
TARGETS = {
    "realized_within_1.5T_share_min": 0.95,
    "median_abs_log_ratio_max": math.log(1.5),
    "overhead_share_max": 0.05,
}
OVERHEAD = {"steps": 60, "warmup": 5}  # --quick: QUICK["steps"] steps, no warm-up skipped
KEEP = (
    "val/accuracy",
    "kl/realized",
    "kl/predicted",
    "kl/predicted_unscaled",
    "kl/step_scale",
    "kl/calibration",
    "kl/control_seconds",
    "reward/mean",
)


def _yaml(path: str | Path) -> dict:
    import yaml

    return yaml.safe_load(Path(path).read_text()) or {}


def logra_init_args(path: str | Path) -> dict:
    """``init_args`` of the config's optimizer when it is LoGRA (else empty)."""
    opt = (_yaml(path).get("model", {}) or {}).get("optimizer", {}) or {}
    return opt.get("init_args", {}) if "LoGRA" in str(opt.get("class_path", "")) else {}


def control_init_args(path: str | Path) -> dict:
    """``init_args`` of the config's ``KLStepControl``, with the callback's defaults filled in for
    ``min_scale``, ``max_scale`` and ``sample_tokens``.

    Raises:
        SystemExit: the config has no ``KLStepControl`` to take the settings from.
    """
    from logra_lightning.callbacks import KLStepControl

    found = next(
        (
            c.get("init_args", {}) or {}
            for c in config_callbacks(path, drop=())
            if str(c.get("class_path", "")).endswith("KLStepControl")
        ),
        None,
    )
    if found is None or "target_kl" not in found:
        raise SystemExit(
            f"{path} has no KLStepControl callback with a target_kl to take the control settings "
            "from; pass --demo-config with one"
        )
    params = inspect.signature(KLStepControl).parameters
    return {**{k: params[k].default for k in ("min_scale", "max_scale", "sample_tokens")}, **found}


def kl_summary(scalars: dict, target: float) -> dict:
    """Share of measured steps within 1.5 T, max realized, median |log(realized / raw prediction)|."""
    realized = {int(s): v for s, v in scalars.get("kl/realized", [])}
    pred = {int(s): v for s, v in scalars.get("kl/predicted", [])}
    cal = {int(s): v for s, v in scalars.get("kl/calibration", [])}
    out: dict = {"measured_steps": len(realized)}
    if realized:
        vals = list(realized.values())
        out["realized_within_1.5T_share"] = sum(v <= 1.5 * target for v in vals) / len(vals)
        out["realized_max"] = max(vals)
        out["realized_median"] = statistics.median(vals)
    logs = [
        abs(math.log(r / (pred[s] / cal[s])))
        for s, r in realized.items()
        if s in pred and s in cal and r > 0 and pred[s] > 0 and cal[s] > 0
    ]
    if logs:
        out["median_abs_log_realized_over_raw_predicted"] = statistics.median(logs)
    return out


def accuracy_summary(runs: list[dict]) -> dict:
    """Final held-out accuracy per row over seeds (mean, min, max, n), and the controlled high-lr
    row against the default-lr row: the difference of the means in points, the per-seed paired
    differences (same seed = same data order and init) with their standard error, and the strict
    verdict ``controlled mean >= default mean`` (None when either row has no finished run)."""
    rows: dict[str, dict[int, float]] = {}
    for r in runs:
        if r["ok"] and r["row"] != "demo_overhead":
            rows.setdefault(r["row"], {})[r["seed"]] = r["accuracy_after"]
    out: dict = {
        row: {"mean": statistics.fmean(v.values()), "min": min(v.values()), "max": max(v.values()), "n": len(v)}
        for row, v in rows.items()
    }
    ctrl, base = rows.get("high_lr_kl_control"), rows.get("default_lr")
    if not (ctrl and base):
        out["controlled_no_worse_than_default"] = None
        return out
    paired = [100 * (ctrl[s] - base[s]) for s in sorted(set(ctrl) & set(base))]
    out["controlled_vs_default"] = {
        "mean_difference_points": 100 * (out["high_lr_kl_control"]["mean"] - out["default_lr"]["mean"]),
        "paired_difference_points": paired,
        "paired_standard_error_points": statistics.stdev(paired) / math.sqrt(len(paired)) if len(paired) > 1 else None,
    }
    out["controlled_no_worse_than_default"] = out["high_lr_kl_control"]["mean"] >= out["default_lr"]["mean"]
    return out


def overhead_summary(scalars: dict, warmup: int) -> dict:
    """Median step and control seconds over the steps after the first ``warmup``, and their ratio.

    ``overhead_share = median(kl/control_seconds) / median(perf/step_seconds - kl/control_seconds)``:
    the time the control adds relative to a step without it. Steps are paired by logged step.
    """
    control = {int(s): v for s, v in scalars.get("kl/control_seconds", [])}
    step = {int(s): v for s, v in scalars.get("perf/step_seconds", [])}
    steps = sorted(set(control) & set(step))[warmup:]
    out: dict = {"steps_used": len(steps), "warmup_steps_skipped": warmup}
    if steps:
        without = statistics.median(step[s] - control[s] for s in steps)
        out.update(
            step_seconds_median=statistics.median(step[s] for s in steps),
            control_seconds_median=statistics.median(control[s] for s in steps),
            step_seconds_without_control_median=without,
        )
        out["overhead_share"] = out["control_seconds_median"] / without if without > 0 else None
        mean_control = statistics.fmean(control[s] for s in steps)
        mean_without = statistics.fmean(step[s] - control[s] for s in steps)
        out["control_seconds_mean"] = mean_control
        out["overhead_share_mean"] = mean_control / mean_without if mean_without > 0 else None
    return out


def record(row: str, seed: int, lr: float, res: dict, target: float | None, callbacks: list[dict] | None) -> dict:
    """The results entry of one ``logra fit``: accuracy, KL curves and (with a ``target``) summary, step seconds."""
    run = {
        "row": row,
        "seed": seed,
        "lr": lr,
        "callbacks": callbacks,
        "ok": res["ok"],
        "seconds": res["seconds"],
        "load_before": res["load_before"],
        "load_after": res["load_after"],
        "command": res["command"],
    }
    if not res["ok"]:
        return {**run, "error": res["error"]}
    sc = res["scalars"]
    return {
        **run,
        "accuracy_before": res["summary"]["accuracy_before"],
        "accuracy_after": res["summary"]["accuracy_after"],
        "curves": {k: [[int(s), v] for s, v in sc.get(k, [])] for k in KEEP},
        **({"kl": kl_summary(sc, target)} if target is not None else {}),
        "step_seconds_median": statistics.median(v for _, v in sc["perf/step_seconds"]),
    }


def _print(run: dict) -> None:
    if not run["ok"]:
        print(f"{run['row']} seed {run['seed']}: FAILED {run['error'][-300:]}", flush=True)
        return
    extra = run.get("overhead", run.get("kl"))
    print(
        f"{run['row']} seed {run['seed']}: acc {run['accuracy_before']:.3f} -> {run['accuracy_after']:.3f}, {extra}",
        flush=True,
    )


def _budget(steps: int, val_every: int, quick: bool) -> list[str]:
    return budget_args(steps, val_every, QUICK["test_size"] if quick else None)


# The README section and the plot of this script's results (benchmarks/report.py says how they are used).


def section(res: dict) -> tuple[list[str], dict]:
    """Per run: accuracy, realized vs predicted KL, step time; then the accuracy, targets and overhead verdicts."""
    st = res["settings"]
    out = [
        command_head(res, end=False) + " "
        f"Config `{st['config']}`, LoGRA {json.dumps(st['logra'])}, default lr {st['default_lr']:g}, high lr "
        f"{st['high_lr']:g}, target_kl T = {st['target_kl']:g}, min_scale {st['min_scale']}, measure_every "
        f"{st['measure_every']}, {st['steps']} steps"
        + (f"; lr and control settings from `{st['demo_config']}`." if st.get("demo_config") else "."),
        "",
    ]
    rows = []
    for r in res["runs"]:
        if not r["ok"]:
            rows.append([r["row"], str(r["seed"]), f"{r['lr']:g}", "failed: " + clip(r["error"], 120)] + [""] * 5)
            continue
        k = r.get("kl", {"measured_steps": "–"})  # demo_overhead: timing only
        rows.append(
            [
                r["row"],
                str(r["seed"]),
                f"{r['lr']:g}",
                f"{pct(r['accuracy_before'])} → {pct(r['accuracy_after'])}",
                str(k["measured_steps"]),
                pct(k.get("realized_within_1.5T_share")),
                num(k.get("realized_max"), ".2e"),
                num(k.get("median_abs_log_realized_over_raw_predicted"), ".2f"),
                num(r["step_seconds_median"], ".2f"),
            ]
        )
    out += table(
        [
            "run",
            "seed",
            "lr",
            "held-out accuracy",
            "measured steps",
            "realized ≤ 1.5 T",
            "max realized KL",
            "median abs log(realized / raw predicted)",
            "s/step",
        ],
        rows,
    ) + [""]
    return out + _accuracy_lines(res) + _target_lines(res) + _overhead_lines(res), {}


def _accuracy_lines(res: dict) -> list[str]:
    """Final held-out accuracy per row over the seeds, and the "no worse than the default lr" verdict."""
    acc = res.get("accuracy")  # kl_control.accuracy_summary of the runs in the table above
    if not acc:
        return []
    parts = [
        f"{row} {pct(a['mean'])} (min {pct(a['min'])}, max {pct(a['max'])}, {a['n']} seeds)"
        for row, a in acc.items()
        if isinstance(a, dict) and "mean" in a
    ]
    if not parts:
        return []
    verdict, diff = acc["controlled_no_worse_than_default"], acc.get("controlled_vs_default")
    text = "not measured" if verdict is None else met(verdict)
    if diff:
        se = diff["paired_standard_error_points"]
        text += (
            f": {diff['mean_difference_points']:+.2f} points; paired by seed "
            + " / ".join(f"{d:+.1f}" for d in diff["paired_difference_points"])
            + (f" (standard error {se:.2f})" if se is not None else "")
        )
    return [
        f"Held-out accuracy at the end, mean over seeds: {'; '.join(parts)}. Target: the controlled high-lr mean is "
        f"no worse than the default-lr mean → {text}.",
        "",
    ]


def _target_lines(res: dict) -> list[str]:
    """The controlled runs' share within 1.5 T against its target; every run's prediction error against log 1.5."""
    t = {"realized_within_1.5T_share_min": 0.95, "median_abs_log_ratio_max": math.log(1.5), **res.get("targets", {})}
    ok = [r for r in res["runs"] if r["ok"] and "kl" in r]
    share = [
        f"{r['row']} seed {r['seed']} {pct(r['kl']['realized_within_1.5T_share'])} "
        f"({met(r['kl']['realized_within_1.5T_share'] >= t['realized_within_1.5T_share_min'])})"
        for r in ok
        if r["row"] == "high_lr_kl_control" and "realized_within_1.5T_share" in r["kl"]
    ]
    pred = [
        f"{r['row']} {r['kl']['median_abs_log_realized_over_raw_predicted']:.2f} "
        f"({met(r['kl']['median_abs_log_realized_over_raw_predicted'] <= t['median_abs_log_ratio_max'])})"
        for r in ok
        if "median_abs_log_realized_over_raw_predicted" in r["kl"]
    ]
    return [
        f"Targets: with control at the high lr, realized KL ≤ 1.5 T on ≥ {pct(t['realized_within_1.5T_share_min'], 0)} "
        f"of measured steps → {', '.join(share) or 'not measured'}; prediction quality, median |log(realized / raw "
        f"predicted)| ≤ log 1.5 = {t['median_abs_log_ratio_max']:.3f} → {', '.join(pred) or 'not measured'}.",
        "",
    ]


def _overhead_lines(res: dict) -> list[str]:
    """The ``demo_overhead`` run: time the control adds per step, against its target share."""
    run = next((r for r in res["runs"] if r["row"] == "demo_overhead"), None)
    if run is None:
        return ["_Control overhead not measured in this result_ (the `demo_overhead` run is newer than it).", ""]
    if not run["ok"] or "overhead_share" not in run.get("overhead", {}):
        return [
            f"Control overhead: the `demo_overhead` run failed: {clip(run.get('error', 'no steps logged'), 200)}",
            "",
        ]
    o, st = run["overhead"], res["settings"]
    limit = res["targets"]["overhead_share_max"]
    return [
        f"Control overhead (`demo_overhead`: `{st.get('demo_config')}` as shipped, {st['overhead_steps']} steps, "
        f"medians over {o['steps_used']} steps after the first {o['warmup_steps_skipped']}; load at start "
        f"{load_text(run['load_before'])}): step {o['step_seconds_median']:.3f} s, of which the control "
        f"{o['control_seconds_median']:.3f} s → overhead **{pct(o['overhead_share'])}** of a step without it "
        f"(≤ {pct(limit, 0)}: {met(o['overhead_share'] <= limit)}).",
        "",
    ]


def plot(res: dict, plt):
    """Realized KL, held-out accuracy and step scale per step, one line per run."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    target = res["settings"]["target_kl"]
    colors, labelled = {}, set()  # one colour per row, one legend entry per row; seeds share it
    for run in res["runs"]:
        if not run["ok"] or "kl" not in run:  # demo_overhead is a timing run (kl_control.py)
            continue
        color = colors.setdefault(run["row"], f"C{len(colors)}")
        label = None if run["row"] in labelled else f"{run['row']} (lr {run['lr']:g})"
        labelled.add(run["row"])
        style = dict(color=color, label=label, alpha=0.8)
        c = run["curves"]
        if c.get("kl/realized"):
            axes[0].plot(*zip(*c["kl/realized"]), lw=0.8, **style)
        if c.get("val/accuracy"):
            axes[1].plot(*zip(*[(s, 100 * v) for s, v in c["val/accuracy"]]), marker="o", ms=3, **style)
        if c.get("kl/step_scale"):
            axes[2].plot(*zip(*c["kl/step_scale"]), lw=0.8, **style)
    axes[0].axhline(target, color="gray", ls="--", lw=0.8, label="target T")
    axes[0].axhline(1.5 * target, color="red", ls=":", lw=0.8, label="1.5 T")
    axes[0].set_yscale("log")
    axes[0].set_title("realized per-token KL of each step", fontsize=9)
    axes[1].set_title("held-out greedy accuracy (%)", fontsize=9)
    axes[2].set_title("step scale eta (1 = no control)", fontsize=9)
    fig.suptitle(f"seeds {res['settings'].get('seeds')}: one line per seed", fontsize=9)
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.legend(fontsize=7)
    return fig


REPORTS = {"kl_control": Report("KL step control at a high learning rate", section, plot)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 steps per run, 64 held-out prompts")
    ap.add_argument(
        "--config",
        default=str(CONFIGS / "arithmetic_tiny_logra.yaml"),
        help="the RL config of the stability runs (LoGRA rank/update_proj_gap, task, budget)",
    )
    ap.add_argument(
        "--demo-config",
        default=str(CONFIGS / "arithmetic_tiny.yaml"),
        help="config with the default lr and the KLStepControl settings; the overhead run runs it",
    )
    ap.add_argument("--lr", type=float, default=None, help="the default lr (default: the demo config's LoGRA lr)")
    ap.add_argument("--lr-multiplier", type=float, default=10.0)
    ap.add_argument("--target-kl", type=float, default=None, help="default: the demo config's")
    ap.add_argument("--min-scale", type=float, default=None, help="default: the demo config's")
    ap.add_argument("--sample-tokens", type=int, default=None, help="default: the demo config's")
    ap.add_argument("--measure-every", type=int, default=1, help="of the stability runs (the demo's is left as is)")
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's max_steps)")
    ap.add_argument("--val-every", type=int, default=None)
    ap.add_argument("--seeds", type=int, nargs="*", default=None, help="default 0 1 2 (--quick: 0)")
    ap.add_argument(
        "--jobs", type=int, default=None, help="stability runs at once, 1 torch thread each (default 2; --quick 1)"
    )
    ap.add_argument(
        "--overhead-steps", type=int, default=None, help=f"default {OVERHEAD['steps']} ({QUICK['steps']} quick)"
    )
    ap.add_argument(
        "--overhead-warmup",
        type=int,
        default=None,
        help=f"first steps left out of the overhead medians (default {OVERHEAD['warmup']}, 0 quick)",
    )
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/kl_control[_quick].json)")
    ap.add_argument("--work-dir", default=str(WORK_DIR / "kl_control"))
    args = ap.parse_args(argv)
    base, demo = config_defaults(args.config), config_defaults(args.demo_config)
    logra = logra_init_args(args.config)
    lr = args.lr or logra_init_args(args.demo_config).get("lr") or logra.get("lr") or base["lr"]
    opt_args = {"rank": logra.get("rank", 8), "update_proj_gap": logra.get("update_proj_gap", 50)}
    demo_control = control_init_args(args.demo_config)
    overrides = {"target_kl": args.target_kl, "min_scale": args.min_scale, "sample_tokens": args.sample_tokens}
    control_args = {
        **demo_control,
        **{k: v for k, v in overrides.items() if v is not None},
        "measure_every": args.measure_every,
    }
    target, min_scale = float(control_args["target_kl"]), float(control_args["min_scale"])
    steps = args.steps or (QUICK["steps"] if args.quick else base["max_steps"])
    val_every = args.val_every or (QUICK["val_every"] if args.quick else base["val_check_interval"])
    overhead_steps = args.overhead_steps or (QUICK["steps"] if args.quick else OVERHEAD["steps"])
    warmup = args.overhead_warmup if args.overhead_warmup is not None else (0 if args.quick else OVERHEAD["warmup"])
    others = config_callbacks(args.config, drop=("ModelCheckpoint", "KLStepControl"))

    def control(lo: float, hi: float) -> list[dict]:
        return others + [{"class_path": CONTROL, "init_args": {**control_args, "min_scale": lo, "max_scale": hi}}]

    high = lr * args.lr_multiplier
    plan = {
        "default_lr": (lr, control(1.0, 1.0)),
        "high_lr": (high, control(1.0, 1.0)),
        "high_lr_kl_control": (high, control(min_scale, control_args["max_scale"])),
    }
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    jobs = args.jobs if args.jobs is not None else (1 if args.quick else 2)
    if jobs < 1:
        raise SystemExit(f"Invalid --jobs: {jobs} (must be >= 1)")

    def stability_run(seed: int, row: str) -> dict:
        row_lr, callbacks = plan[row]
        optimizer = {"class_path": "logra_lightning.optim.LoGRA", "init_args": {"lr": row_lr, **opt_args}}
        seeded = [
            *_budget(steps, val_every, args.quick),
            "--seed_everything",
            str(seed),
            "--data.seed",
            str(seed),
            "--model.torch_threads",
            "1",
        ]
        res = logra_fit(
            f"{row}_seed{seed}",
            args.config,
            seeded,
            optimizer=optimizer,
            callbacks=callbacks,
            work_dir=Path(args.work_dir),
        )
        run = record(row, seed, row_lr, res, target, callbacks)
        _print(run)
        return run

    started, load_start = time.time(), load_average()
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # threads only wait on the `logra fit` processes
        runs = list(pool.map(lambda p: stability_run(*p), [(seed, row) for seed in seeds for row in plan]))
    # the demo as shipped: its own optimizer, KLStepControl (measure_every included), engine and sync
    res = logra_fit(
        "demo_overhead",
        args.demo_config,
        _budget(overhead_steps, demo["val_check_interval"], args.quick),
        work_dir=Path(args.work_dir),
    )
    # no KL summary: with measure_every > 1 the TensorBoard log repeats the last kl/realized on
    # the steps in between, so the realized-KL statistics of this run would count stale values
    run = record("demo_overhead", demo["seed"], demo["lr"], res, None, None)
    if run["ok"]:
        run["overhead"] = overhead_summary(res["scalars"], warmup)
    runs.append(run)
    _print(run)
    result = {
        "command": "python -m benchmarks.kl_control " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(),
        "load_start": load_start,
        "load_end": load_average(),
        "wall_seconds": round(time.time() - started, 1),
        "settings": {
            "config": base["config"],
            "demo_config": demo["config"],
            "default_lr": lr,
            "high_lr": high,
            "lr_multiplier": args.lr_multiplier,
            "target_kl": target,
            "min_scale": min_scale,
            "sample_tokens": control_args["sample_tokens"],
            "measure_every": args.measure_every,
            "steps": steps,
            "val_check_interval": min(val_every, steps),
            "seeds": seeds,
            "jobs": jobs,
            "logra": opt_args,
            "control": control_args,
            "demo_control": demo_control,
            "overhead_steps": overhead_steps,
            "overhead_warmup_steps": warmup,
        },
        "targets": TARGETS,
        "accuracy": accuracy_summary(runs),
        "runs": runs,
    }
    write_result(Path(args.out) if args.out else RESULTS / f"kl_control{'_quick' if args.quick else ''}.json", result)
    return result


if __name__ == "__main__":
    main()
