"""Stability at a high learning rate: LoGRA at 10x the demo lr, with and without ``KLStepControl``; its overhead.

Run (full: three ``logra fit`` runs of the config's length per seed, seeds 0 1 2, two at a time,
then one 60-step demo run alone):

    .venv/bin/python -m benchmarks.kl_control
    .venv/bin/python -m benchmarks.kl_control --steps 100             # as `make bench` runs it
    .venv/bin/python -m benchmarks.kl_control --lr 3e-5 --steps 300 --seeds 0 1
    .venv/bin/python -m benchmarks.kl_control --quick          # 4 steps each, 64 held-out prompts (CI)
    .venv/bin/python -m benchmarks.kl_control --overhead-only --demo-config configs/smollm2_chain_sum.yaml \
        --probes finite_difference jvp --overhead-steps 25 --out benchmarks/results/kl_control_overhead_smollm2.json

The runs, each a real ``logra fit`` on the arithmetic RL task: ``default_lr`` (LoGRA at the demo's
lr, no control), ``high_lr`` (10x that lr, no control), ``high_lr_kl_control``
(the same with the demo's ``KLStepControl``: ``target_kl`` T, ``min_scale``, ``sample_tokens``), one
torch thread each, ``--jobs`` at a time, on the HF-engine LoGRA config (``--config``: rank,
``update_proj_gap``, task, budget) with the lr and control settings of the demo config
(``--demo-config``); and ``demo_overhead``: the demo config as shipped (its control, vLLM engine,
low-rank sync) for 60 steps alone, to time the control (``--probes``: one such run per
``KLStepControl`` probe instead, ``overhead_<probe>``; ``--overhead-only``: these runs only).
Departures, so that the three stability runs are measured alike:

1. ``measure_every`` is 1 (the demo measures every 5th step), so every step has a realized KL.
2. The runs "without control" carry ``KLStepControl`` with ``min_scale = max_scale = 1``: it logs
   ``kl/predicted`` and ``kl/realized`` and leaves the step as the optimizer made it.

Reported per run: the held-out accuracy curve, realized and predicted KL per step, the share of
measured steps with realized KL <= 1.5 T (target >= 95% with control), median |log(realized / raw
prediction)| (target <= log 1.5). Accuracy per row is the mean over seeds: "no worse" means the
controlled high-lr mean is at least the default-lr mean. Overhead: ``overhead_share =
median(kl/control_seconds) / median(perf/step_seconds - kl/control_seconds)`` after the first
5 steps, target <= 5% (a timing: run it on a quiet machine). One results row per
run (``high_lr/seed0``); the summary is :func:`accuracy_summary`.
"""

from __future__ import annotations

import inspect
import json
import math
import statistics
from pathlib import Path

from benchmarks.common import (
    CONFIGS,
    ONE_TORCH_THREAD,
    QUICK_BUDGET,
    WORK_DIR,
    budget_args,
    config_callbacks,
    config_defaults,
    fit_metrics,
    logra_fit,
    run_budget,
    seed_args,
)
from benchmarks.harness import Benchmark, bench, flat, main, parallel
from benchmarks.report import Col, clip, command_head, load_text, met, pct, table

CONTROL = "logra_lightning.callbacks.KLStepControl"
TARGETS = {
    "realized_within_1.5T_share_min": 0.95,
    "median_abs_log_ratio_max": math.log(1.5),
    "overhead_share_max": 0.05,
}
OVERHEAD = {"steps": 60, "warmup": 5}  # --quick: QUICK_BUDGET["steps"] steps, no warm-up skipped
LR_MULTIPLIER = 10.0  # the high lr over the default lr
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


def is_overhead_run(row: str) -> bool:
    """Whether results row ``row`` is a timing run of the control (``demo_overhead``, ``overhead_<probe>``)."""
    return row == "demo_overhead" or row.startswith("overhead_")


def accuracy_summary(runs: list[dict]) -> dict:
    """Final held-out accuracy per row over seeds (mean, min, max, n), and the controlled high-lr
    row against the default-lr row: the difference of the means in points, the per-seed paired
    differences (same seed = same data order and init) with their standard error, and the strict
    verdict ``controlled mean >= default mean`` (None when either row has no finished run)."""
    rows: dict[str, dict[int, float]] = {}
    for r in runs:
        if r["ok"] and not is_overhead_run(r["row"]):
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
    """The results row of one ``logra fit``: accuracy, KL curves and (with a ``target``) summary, step seconds."""
    run = fit_metrics(res, row=row, seed=seed, lr=lr, callbacks=callbacks)
    if res["ok"]:
        sc = res["scalars"]
        run["curves"] = {k: [[int(s), v] for s, v in sc.get(k, [])] for k in KEEP}
        run.update({"kl": kl_summary(sc, target)} if target is not None else {})
    got = f"acc {run['accuracy_before']:.3f} -> {run['accuracy_after']:.3f}" if res["ok"] else "FAILED"
    print(f"{row} seed {seed}: {got}", flush=True)
    return {"name": f"{row}/seed{seed}", "ok": res["ok"], "error": res.get("error"), "metrics": run}


KL = lambda key: lambda r: r.get("kl", {}).get(key)  # noqa: E731  (demo_overhead: timing only, no kl)
COLS = [
    Col("run", "row"),
    Col("seed", "seed"),
    Col("lr", "lr", "g"),
    Col("held-out accuracy", lambda r: f"{pct(r['accuracy_before'])} → {pct(r['accuracy_after'])}"),
    Col("measured steps", lambda r: r.get("kl", {}).get("measured_steps", "–")),
    Col("realized ≤ 1.5 T", KL("realized_within_1.5T_share"), "pct"),
    Col("max realized KL", KL("realized_max"), ".2e"),
    Col("median abs log(realized / raw predicted)", KL("median_abs_log_realized_over_raw_predicted"), ".2f"),
    Col("s/step", "step_seconds_median", ".2f"),
]


@bench(
    "kl_control",
    title="KL step control at a high learning rate",
    quick=[],
    full=["--steps", "100"],
    variants=("kl_control_200_steps", "kl_control_overhead_smollm2"),
)
class KLControl(Benchmark):
    flags = {
        "config": str(CONFIGS / "arithmetic_tiny_logra.yaml"),
        **dict.fromkeys(("steps", "val_every", "seeds", "jobs")),
        "work_dir": str(WORK_DIR / "kl_control"),
    }

    def add_arguments(self, ap) -> None:
        ap.add_argument(
            "--demo-config",
            default=str(CONFIGS / "arithmetic_tiny.yaml"),
            help="config with the default lr and the KLStepControl settings; the overhead run runs it",
        )
        ap.add_argument("--overhead-only", action="store_true", help="only the overhead run(s), no stability runs")
        ap.add_argument("--probes", nargs="+", help="one overhead run per KLStepControl probe (default: as shipped)")
        ap.add_argument("--overhead-steps", type=int, help=f"steps of each overhead run (default {OVERHEAD['steps']})")
        ap.add_argument("--lr", type=float, default=None, help="the default lr (default: the demo config's LoGRA lr)")

    def settings(self, args) -> dict:
        base, demo = config_defaults(args.config), config_defaults(args.demo_config)
        logra = [c for c in (demo, base) if "LoGRA" in str(c["optimizer"]) and c["lr"]]
        lr = args.lr or (logra[0] if logra else base)["lr"]
        demo_control = control_init_args(args.demo_config)
        control = {**demo_control, "measure_every": 1}  # departure 1
        overhead = QUICK_BUDGET["steps"] if args.quick else args.overhead_steps or OVERHEAD["steps"]
        return {
            "config": base["config"],
            "demo_config": demo["config"],
            "default_lr": lr,
            "high_lr": lr * LR_MULTIPLIER,
            "lr_multiplier": LR_MULTIPLIER,
            "target_kl": float(control["target_kl"]),
            "min_scale": float(control["min_scale"]),
            "sample_tokens": control["sample_tokens"],
            "measure_every": control["measure_every"],
            **run_budget(args, base),
            "logra": {"rank": base["rank"] or 8, "update_proj_gap": base["update_proj_gap"] or 50},
            "control": control,
            "demo_control": demo_control,
            "overhead_steps": overhead,
            "overhead_warmup_steps": 0 if args.quick else OVERHEAD["warmup"],
            "overhead_only": args.overhead_only,
            "probes": args.probes,
            "targets": TARGETS,
        }

    def run(self, args, settings: dict) -> list[dict]:
        st, work_dir, test_size = settings, Path(args.work_dir), QUICK_BUDGET["test_size"] if args.quick else None
        others = config_callbacks(args.config, drop=("ModelCheckpoint", "KLStepControl"))

        def control(lo: float, hi: float) -> list[dict]:
            return others + [{"class_path": CONTROL, "init_args": {**st["control"], "min_scale": lo, "max_scale": hi}}]

        plan = {
            "default_lr": (st["default_lr"], control(1.0, 1.0)),
            "high_lr": (st["high_lr"], control(1.0, 1.0)),
            "high_lr_kl_control": (st["high_lr"], control(st["min_scale"], st["control"]["max_scale"])),
        }

        def stability_run(seed: int, row: str) -> dict:
            lr, callbacks = plan[row]
            optimizer = {"class_path": "logra_lightning.optim.LoGRA", "init_args": {"lr": lr, **st["logra"]}}
            seeded = [*seed_args(seed), *ONE_TORCH_THREAD]
            fit_args = [*budget_args(st["steps"], st["val_check_interval"], test_size), *seeded]
            res = logra_fit(
                f"{row}_seed{seed}", args.config, fit_args, optimizer=optimizer, callbacks=callbacks, work_dir=work_dir
            )
            return record(row, seed, lr, res, st["target_kl"], callbacks)

        runs = [] if st["overhead_only"] else [(seed, row) for seed in st["seeds"] for row in plan]
        rows = parallel(lambda p: stability_run(*p), runs, st["jobs"])
        # the demo as shipped: its own optimizer, KLStepControl (measure_every included), engine and sync
        demo = config_defaults(args.demo_config)
        budget = budget_args(st["overhead_steps"], demo["val_check_interval"], test_size)
        shipped = config_callbacks(args.demo_config)
        for probe in st["probes"] or [None]:
            row, callbacks = "demo_overhead", None
            if probe is not None:  # the shipped callbacks with the control's probe set
                row = f"overhead_{probe}"
                callbacks = [
                    {**c, "init_args": {**c.get("init_args", {}), "probe": probe}}
                    if c.get("class_path") == CONTROL
                    else c
                    for c in shipped
                ]
            res = logra_fit(row, args.demo_config, budget, callbacks=callbacks, work_dir=work_dir)
            # no KL summary: with measure_every > 1 the TensorBoard log repeats the last kl/realized on
            # the steps in between, so the realized-KL statistics of this run would count stale values
            rows.append(record(row, demo["seed"], demo["lr"], res, None, callbacks))
            if res["ok"]:
                rows[-1]["metrics"]["overhead"] = overhead_summary(res["scalars"], st["overhead_warmup_steps"])
        return rows

    def summarize(self, settings: dict, rows: list[dict]) -> dict:
        return accuracy_summary([{**r["metrics"], "ok": r["ok"]} for r in rows])

    def section(self, res: dict) -> list[str]:
        """Per run: accuracy, realized vs predicted KL, step time; then the accuracy, targets and overhead verdicts."""
        st = res["settings"]
        head = (
            f"Config `{st['config']}`, LoGRA {json.dumps(st['logra'])}, default lr {st['default_lr']:g}, high lr "
            f"{st['high_lr']:g}, target_kl T = {st['target_kl']:g}, min_scale {st['min_scale']}, measure_every "
            f"{st['measure_every']}, {st['steps']} steps; lr and control settings from `{st['demo_config']}`."
        )
        rows = [flat(r) for r in res["rows"]]
        if st.get("overhead_only"):
            return [command_head(res, end=False), "", *_overhead_lines(rows, st)]
        out = [command_head(res, end=False) + " " + head, "", *table(rows, COLS), ""]
        return out + _accuracy_lines(res) + _target_lines(rows, st["targets"]) + _overhead_lines(rows, st)

    def plot(self, res: dict, plt):
        """Realized KL, held-out accuracy and step scale per step, one line per run (none: overhead runs only)."""
        if res["settings"].get("overhead_only"):
            return None
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        target = res["settings"]["target_kl"]
        colors, labelled = {}, set()  # one colour per row, one legend entry per row; seeds share it
        for run in (flat(r) for r in res["rows"]):
            if not run["ok"] or "kl" not in run:  # demo_overhead is a timing run
                continue
            color = colors.setdefault(run["row"], f"C{len(colors)}")
            label = None if run["row"] in labelled else f"{run['row']} (lr {run['lr']:g})"
            labelled.add(run["row"])
            style, c = dict(color=color, label=label, alpha=0.8), run["curves"]
            if c.get("kl/realized"):
                axes[0].plot(*zip(*c["kl/realized"]), lw=0.8, **style)
            if c.get("val/accuracy"):
                axes[1].plot(*zip(*[(s, 100 * v) for s, v in c["val/accuracy"]]), marker="o", ms=3, **style)
            if c.get("kl/step_scale"):
                axes[2].plot(*zip(*c["kl/step_scale"]), lw=0.8, **style)
        axes[0].axhline(target, color="gray", ls="--", lw=0.8, label="target T")
        axes[0].axhline(1.5 * target, color="red", ls=":", lw=0.8, label="1.5 T")
        axes[0].set_yscale("log")
        titles = (
            "realized per-token KL of each step",
            "held-out greedy accuracy (%)",
            "step scale eta (1 = no control)",
        )
        for ax, title in zip(axes, titles):
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("RL step")
            ax.legend(fontsize=7)
        fig.suptitle(f"seeds {res['settings'].get('seeds')}: one line per seed", fontsize=9)
        return fig


def _accuracy_lines(res: dict) -> list[str]:
    """Final held-out accuracy per row over the seeds, and the "no worse than the default lr" verdict."""
    acc = res["summary"]
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
        text += f": {diff['mean_difference_points']:+.2f} points; paired by seed "
        text += " / ".join(f"{d:+.1f}" for d in diff["paired_difference_points"])
        text += f" (standard error {se:.2f})" if se is not None else ""
    return [
        f"Held-out accuracy at the end, mean over seeds: {'; '.join(parts)}. Target: the controlled high-lr mean is "
        f"no worse than the default-lr mean → {text}.",
        "",
    ]


def _target_lines(rows: list[dict], t: dict) -> list[str]:
    """The controlled runs' share within 1.5 T against its target; every run's prediction error against log 1.5."""
    ok = [r for r in rows if r["ok"] and "kl" in r]
    share_min, log_max = t["realized_within_1.5T_share_min"], t["median_abs_log_ratio_max"]
    share = [
        f"{r['row']} seed {r['seed']} {pct(x)} ({met(x >= share_min)})"
        for r in ok
        if r["row"] == "high_lr_kl_control" and (x := r["kl"].get("realized_within_1.5T_share")) is not None
    ]
    pred = [
        f"{r['row']} {x:.2f} ({met(x <= log_max)})"
        for r in ok
        if (x := r["kl"].get("median_abs_log_realized_over_raw_predicted")) is not None
    ]
    return [
        f"Targets: with control at the high lr, realized KL ≤ 1.5 T on ≥ {pct(share_min, 0)} of measured steps → "
        f"{', '.join(share) or 'not measured'}; prediction quality, median |log(realized / raw predicted)| ≤ log 1.5 "
        f"= {log_max:.3f} → {', '.join(pred) or 'not measured'}.",
        "",
    ]


def _overhead_lines(rows: list[dict], st: dict) -> list[str]:
    """Each overhead run: time the control adds per step, against its target share."""
    names = [f"overhead_{p}" for p in st.get("probes") or []] or ["demo_overhead"]
    out = []
    for name in names:
        run = next((r for r in rows if r["row"] == name), None)
        if run is None or not run["ok"] or "overhead_share" not in run.get("overhead", {}):
            why = "not measured" if run is None else clip(run.get("error") or "no steps logged", 200)
            out += [f"Control overhead: the `{name}` run failed or is missing: {why}.", ""]
            continue
        o, limit = run["overhead"], st["targets"]["overhead_share_max"]
        how = "as shipped" if name == "demo_overhead" else f"as shipped but `probe: {name[len('overhead_') :]}`"
        out += [
            f"Control overhead (`{name}`: `{st['demo_config']}` {how}, {st['overhead_steps']} steps, "
            f"medians over {o['steps_used']} steps after the first {o['warmup_steps_skipped']}; load at start "
            f"{load_text(run['load_before'])}): step {o['step_seconds_median']:.3f} s, of which the control "
            f"{o['control_seconds_median']:.3f} s → overhead **{pct(o['overhead_share'])}** of a step without it "
            f"(≤ {pct(limit, 0)}: {met(o['overhead_share'] <= limit)}).",
            "",
        ]
    return out


if __name__ == "__main__":
    main(KLControl)
