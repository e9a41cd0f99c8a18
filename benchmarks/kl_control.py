"""Stability at a high learning rate: LoGRA at 10x the default lr, with and without ``KLStepControl``.

Run (full: three ``logra fit`` runs of the config's length, seed 0):

    .venv/bin/python benchmarks/kl_control.py
    .venv/bin/python benchmarks/kl_control.py --lr 3e-5 --steps 300 --target-kl 1e-3 --seeds 0 1
    .venv/bin/python benchmarks/kl_control.py --quick          # 4 steps each, 64 held-out prompts (CI)

The issue-4 runs, each a real ``logra fit`` in its own process on the arithmetic RL task:

* ``default_lr``: LoGRA at the default lr, no control;
* ``high_lr``: LoGRA at ``--lr-multiplier`` (10) x the default lr, no control;
* ``high_lr_kl_control``: the same with ``KLStepControl(target_kl=T)``.

Departure, so that all three runs are measured the same way: the two runs "without control"
carry ``KLStepControl`` with ``min_scale = max_scale = 1`` (the step scale is always 1, so the
update is the optimizer's own) and the same ``measure_every``, which logs ``kl/predicted``
and ``kl/realized`` without changing the step beyond the rounding of the probe's
``+eps``/``-eps`` weight perturbation. ``measure_every`` defaults to 1 here (every step).

Defaults come from ``configs/``: the LoGRA config (as in :mod:`benchmarks.quality`: lr, rank,
``update_proj_gap``; else the AdamW config's lr with LoGRA rank 8), ``target_kl``/``min_scale``
from a ``KLStepControl`` in that config (else 1e-3 / 0.05, the values of the shipped Qwen
configs). Reported per run: the held-out accuracy curve, the per-step ``kl/realized``,
``kl/predicted`` (calibrated) and raw prediction, step scale; the share of measured steps with
realized KL <= 1.5 T; median |log(realized / raw prediction)|; median step seconds.
Results: ``benchmarks/results/kl_control[_quick].json``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    CONFIGS, RESULTS, WORK_DIR, config_callbacks, config_defaults, load_average, logra_fit, machine_info, write_result,
)  # fmt: skip
from benchmarks.quality import QUICK, find_logra_config  # noqa: E402

FALLBACK_CONTROL = {"target_kl": 1e-3, "min_scale": 0.05}


def _config_settings(path: str) -> dict:
    """LoGRA init_args and KLStepControl init_args of a config (either may be empty)."""
    import yaml

    cfg = yaml.safe_load(Path(path).read_text())
    opt = (cfg.get("model", {}) or {}).get("optimizer", {}) or {}
    control = next((c.get("init_args", {}) for c in (cfg.get("trainer", {}) or {}).get("callbacks") or []
                    if isinstance(c, dict) and str(c.get("class_path", "")).endswith("KLStepControl")), {})  # fmt: skip
    return {"optimizer": opt.get("init_args", {}) if "LoGRA" in str(opt.get("class_path", "")) else {},
            "control": control}  # fmt: skip


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
    logs = [abs(math.log(r / (pred[s] / cal[s]))) for s, r in realized.items()
            if s in pred and s in cal and r > 0 and pred[s] > 0 and cal[s] > 0]  # fmt: skip
    if logs:
        out["median_abs_log_realized_over_raw_predicted"] = statistics.median(logs)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 steps per run, 64 held-out prompts")
    ap.add_argument("--config", default=None, help="the RL config the runs use (default: the LoGRA config, else the AdamW one)")
    ap.add_argument("--logra-config", default=None, help="config with the default LoGRA lr/rank (and KLStepControl)")
    ap.add_argument("--lr", type=float, default=None, help="the default lr (default: from the configs)")
    ap.add_argument("--lr-multiplier", type=float, default=10.0)
    ap.add_argument("--target-kl", type=float, default=None)
    ap.add_argument("--min-scale", type=float, default=None)
    ap.add_argument("--measure-every", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's max_steps)")
    ap.add_argument("--val-every", type=int, default=None)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/kl_control[_quick].json)")
    ap.add_argument("--work-dir", default=str(WORK_DIR / "kl_control"))
    args = ap.parse_args(argv)
    logra_cfg = find_logra_config(args.logra_config)
    args.config = args.config or logra_cfg or str(CONFIGS / "arithmetic_tiny_adamw.yaml")
    base = config_defaults(args.config)
    found = _config_settings(logra_cfg) if logra_cfg else {"optimizer": {}, "control": {}}
    lr = args.lr or found["optimizer"].get("lr") or base["lr"]
    opt_args = {"rank": found["optimizer"].get("rank", 8), "update_proj_gap": found["optimizer"].get("update_proj_gap", 50)}
    target = args.target_kl or found["control"].get("target_kl", FALLBACK_CONTROL["target_kl"])
    min_scale = args.min_scale if args.min_scale is not None else found["control"].get("min_scale", FALLBACK_CONTROL["min_scale"])
    steps = args.steps or (QUICK["steps"] if args.quick else base["max_steps"])
    val_every = min(args.val_every or (QUICK["val_every"] if args.quick else base["val_check_interval"]), steps)
    common = ["--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(val_every)]
    if args.quick:
        size = str(QUICK["test_size"])
        common += ["--data.train.init_args.test_size", size, "--data.val.init_args.test_size", size]

    others = config_callbacks(args.config, drop=("ModelCheckpoint", "KLStepControl"))

    def control(lo: float, hi: float) -> list[dict]:
        return others + [{"class_path": "logra_lightning.callbacks.KLStepControl",
                 "init_args": {"target_kl": target, "min_scale": lo, "max_scale": hi, "measure_every": args.measure_every}}]  # fmt: skip

    high = lr * args.lr_multiplier
    plan = {"default_lr": (lr, control(1.0, 1.0)), "high_lr": (high, control(1.0, 1.0)),
            "high_lr_kl_control": (high, control(min_scale, 1.0))}  # fmt: skip
    started, load_start = time.time(), load_average()
    runs = []
    for seed in args.seeds:
        for row, (row_lr, callbacks) in plan.items():
            optimizer = {"class_path": "logra_lightning.optim.LoGRA", "init_args": {"lr": row_lr, **opt_args}}
            res = logra_fit(f"{row}_seed{seed}", args.config, [*common, "--seed_everything", str(seed), "--data.seed", str(seed)],
                            optimizer=optimizer, callbacks=callbacks, work_dir=Path(args.work_dir))  # fmt: skip
            run = {"row": row, "seed": seed, "lr": row_lr, "callbacks": callbacks, "ok": res["ok"],
                   "seconds": res["seconds"], "load_before": res["load_before"], "load_after": res["load_after"],
                   "command": res["command"]}  # fmt: skip
            if res["ok"]:
                sc = res["scalars"]
                keep = ("val/accuracy", "kl/realized", "kl/predicted", "kl/predicted_unscaled", "kl/step_scale",
                        "kl/calibration", "reward/mean")  # fmt: skip
                run.update(accuracy_before=res["summary"]["accuracy_before"], accuracy_after=res["summary"]["accuracy_after"],
                           curves={k: [[int(s), v] for s, v in sc.get(k, [])] for k in keep},
                           kl=kl_summary(sc, target),
                           step_seconds_median=statistics.median(v for _, v in sc["perf/step_seconds"]))  # fmt: skip
            else:
                run["error"] = res["error"]
            runs.append(run)
            print(f"{row} seed {seed}: " + (f"acc {run['accuracy_before']:.3f} -> {run['accuracy_after']:.3f}, {run['kl']}"
                                            if run["ok"] else f"FAILED {run['error'][-300:]}"), flush=True)  # fmt: skip
    result = {
        "command": "python benchmarks/kl_control.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(), "load_start": load_start, "load_end": load_average(),
        "wall_seconds": round(time.time() - started, 1),
        "settings": {"config": base["config"], "logra_config": logra_cfg, "default_lr": lr, "high_lr": high,
                     "lr_multiplier": args.lr_multiplier, "target_kl": target, "min_scale": min_scale,
                     "measure_every": args.measure_every, "steps": steps, "val_check_interval": val_every,
                     "seeds": args.seeds, "logra": opt_args},
        "targets": {"realized_within_1.5T_share_min": 0.95, "median_abs_log_ratio_max": math.log(1.5)},
        "runs": runs,
    }  # fmt: skip
    write_result(Path(args.out) if args.out else RESULTS / f"kl_control{'_quick' if args.quick else ''}.json", result)
    return result


if __name__ == "__main__":
    main()
