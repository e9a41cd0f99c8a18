"""Held-out accuracy on the arithmetic RL task: AdamW vs LoGRA (ranks 4/8/16/32) vs GaLore vs LoRA, 3 seeds.

Run (full: the settings of ``configs/``, 8 rows x 3 seeds = 24 ``logra fit`` runs):

    .venv/bin/python -m benchmarks.quality
    .venv/bin/python -m benchmarks.quality --lr 3e-5 --steps 300          # override the configs' lr / steps
    .venv/bin/python -m benchmarks.quality --quick                         # 1 seed, 2 ranks, 4 steps (CI)
    .venv/bin/python -m benchmarks.quality --jobs 1                        # one run at a time
    .venv/bin/python -m benchmarks.quality --rows lora_r16 --seeds 0 --lora-lr 3e-3 --out /tmp/sweep.json  # one lr

Every run is a real ``logra fit --config <AdamW config>`` in its own process with the optimizer
replaced on the command line, so all rows share the loop, task, reward, batch, group size, sampling
and evaluation (greedy held-out accuracy before RL, every ``val_check_interval`` steps and after).
Rows: ``adamw``; ``logra_r{4,8,16,32}`` (:class:`~logra_lightning.optim.LoGRA`, every 2-D param
low-rank); ``galore_r16`` (``galore_torch.GaLoreAdamW`` on attention/MLP, :mod:`benchmarks.galore_named`);
``lora_r{16,8}`` (LoRA, ``alpha = 2r``, AdamW on the factors at the LoRA config's lr; r8 is the rank
whose params + grads + state match LoGRA r16's); with ``--bf16``, weights held at bf16 values with
each step's update rounded by a rule (:class:`benchmarks.bf16_weights.BF16Weights`):
``logra_r{R}_bf16w_{nearest,stochastic,kahan}`` and ``adamw_bf16w_nearest``.

Defaults are read from the configs (``--config`` for AdamW, the first LoGRA config for the low-rank
rows' lr and ``update_proj_gap``); ``--lr`` sets every row's. Seeds change sampling and prompt order;
the held-out split is fixed. Every run carries :class:`~logra_lightning.callbacks.MemoryMonitor`:
``peak_rss_bytes`` (the whole process, HF engine included) and ``train_tensor_bytes`` (params + the
largest live gradients + optimizer state). ``--jobs`` runs go at once, each on one torch thread, so
s/step is a rough cost figure (``optimizer_memory`` measures time); accuracy does not depend on it.
One results row per run (``logra_r16/seed0``); the summary has per-row mean/std over seeds.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.common import (
    CONFIGS,
    ONE_THREAD,
    ONE_TORCH_THREAD,
    WORK_DIR,
    budget_args,
    config_defaults,
    fit_metrics,
    logra_fit,
    seed_args,
)
from benchmarks.harness import Benchmark, bench, main, parallel
from benchmarks.report import Col, command_head, num, table
from benchmarks.rl_table import stats

LOGRA_CONFIGS = ("arithmetic_tiny_logra.yaml", "arithmetic_tiny.yaml")
LORA_CONFIG = CONFIGS / "arithmetic_tiny_lora.yaml"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MEMORY_MONITOR = [{"class_path": "logra_lightning.callbacks.MemoryMonitor"}]


def row_callbacks(row: str) -> list[dict]:
    """Callbacks of a row: MemoryMonitor, plus the bf16 weight rounding of a ``*_bf16w_<rule>`` row."""
    if "_bf16w_" not in row:
        return MEMORY_MONITOR
    return MEMORY_MONITOR + [
        {"class_path": "benchmarks.bf16_weights.BF16Weights", "init_args": {"rule": row.rsplit("_", 1)[1]}}
    ]


QUICK = dict(steps=4, val_every=2, seeds=[0], ranks=[8, 16], test_size=64, jobs=1)
GALORE_RANK = 16
JOBS = 2  # full run: 2 single-threaded runs at once on the 2-core machine


def run_budget(args, base: dict) -> dict:
    """Steps, held-out check interval, seeds and jobs of a rows x seeds benchmark: the flags, else (``--quick``)
    :data:`QUICK`, else the config's steps and interval, seeds 0 1 2 and :data:`JOBS` at once."""
    steps = args.steps or (QUICK["steps"] if args.quick else base["max_steps"])
    val_every = args.val_every or (QUICK["val_every"] if args.quick else base["val_check_interval"])
    jobs = args.jobs if args.jobs is not None else (QUICK["jobs"] if args.quick else JOBS)
    if jobs < 1:
        raise SystemExit(f"Invalid --jobs: {jobs} (must be >= 1)")
    seeds = args.seeds if args.seeds is not None else (QUICK["seeds"] if args.quick else [0, 1, 2])
    return {"steps": steps, "val_check_interval": min(val_every, steps), "seeds": seeds, "jobs": jobs}


def lora_lr(args, default: float) -> float:
    """The LoRA rows' lr: ``--lora-lr``, else ``--lr``, else the LoRA config's (``default`` without one)."""
    return args.lora_lr or args.lr or (config_defaults(LORA_CONFIG)["lr"] if LORA_CONFIG.is_file() else default)


def logra_defaults() -> dict:
    """The settings of the first config in :data:`LOGRA_CONFIGS` that trains with LoGRA (``{}``: none does)."""
    found = (config_defaults(CONFIGS / name) for name in LOGRA_CONFIGS if (CONFIGS / name).is_file())
    return next((c for c in found if "LoGRA" in str(c["optimizer"])), {})


def lora_adapter(rank: int) -> dict:
    """The ``--model.adapter`` value of a LoRA row (alpha = 2 * rank, as in the LoRA config)."""
    return {
        "class_path": "logra_lightning.models.LoRA",
        "init_args": {"rank": rank, "alpha": 2 * rank, "target_modules": LORA_TARGETS, "dropout": 0.0},
    }


def row_args(row: str) -> list[str]:
    """Extra ``logra fit`` arguments of a row (the adapter of a LoRA row)."""
    if row.startswith("lora_r"):
        return ["--model.adapter", json.dumps(lora_adapter(int(row[len("lora_r") :])))]
    return []


def adamw(lr: float) -> dict:
    return {"class_path": "torch.optim.AdamW", "init_args": {"lr": lr, "weight_decay": 0.0}}


def plan_rows(args, adamw_lr: float, logra_lr: float, gap: int, lora_lr: float | None) -> dict[str, dict]:
    """Row name -> the ``--model.optimizer`` value of that row (LoRA rows add :func:`row_args`)."""

    def logra(rank: int, **extra) -> dict:
        init = {"lr": logra_lr, "rank": rank, "update_proj_gap": gap, **extra}
        return {"class_path": "logra_lightning.optim.LoGRA", "init_args": init}

    rows = {"adamw": adamw(adamw_lr)}
    extra = json.loads(args.logra_args) if args.logra_args else {}
    rows |= {f"logra_r{r}{args.row_suffix}": logra(r, **extra) for r in args.ranks}
    rows[f"galore_r{GALORE_RANK}"] = {
        "class_path": "benchmarks.galore_named.GaLoreAdamWNamed",
        "init_args": {"lr": logra_lr, "rank": GALORE_RANK, "update_proj_gap": gap, "scale": 1.0},
    }
    if args.bf16:
        r = max([x for x in args.ranks if x <= 16] or [16])
        rows |= {f"logra_r{r}_bf16w_{rule}": logra(r) for rule in ("nearest", "stochastic", "kahan")}
        rows["adamw_bf16w_nearest"] = adamw(adamw_lr)
    rows |= {f"lora_r{r}": adamw(lora_lr or adamw_lr) for r in args.lora_ranks}
    if args.rows:
        unknown = set(args.rows) - set(rows)
        if unknown:
            raise SystemExit(f"unknown --rows {sorted(unknown)} (allowed: {', '.join(rows)})")
        rows = {k: v for k, v in rows.items() if k in args.rows}
    return rows


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per row: accuracy after RL (mean/std/min/max over seeds), the mean curve, median step seconds."""
    out: dict[str, dict] = {}
    for row in dict.fromkeys(r["row"] for r in runs):
        ok = [r for r in runs if r["row"] == row and r["ok"]]
        mine = [r for r in runs if r["row"] == row]
        entry: dict = {"runs": len(mine), "ok_runs": len(ok), "lr": mine[0]["lr"]}
        if ok:
            entry["accuracy_before"] = stats([r["accuracy_before"] for r in ok])
            entry["accuracy_after"] = stats([r["accuracy_after"] for r in ok])
            steps = sorted(set.intersection(*(set(s for s, _ in r["curve"]) for r in ok)))
            entry["curve"] = [
                [s, *(lambda v: [v["mean"], v["std"]])(stats([dict(r["curve"])[s] for r in ok]))] for s in steps
            ]
            entry["step_seconds_median"] = statistics.median(r["step_seconds_median"] for r in ok)
            for key in ("peak_rss_bytes", "train_tensor_bytes", "optimizer_state_bytes", "bf16_lost_share_mean"):
                if all(r.get(key) is not None for r in ok):
                    entry[key] = statistics.median(r[key] for r in ok)
        out[row] = entry
    base = out.get("adamw", {}).get("accuracy_after")
    for entry in out.values():
        if base and "accuracy_after" in entry:
            entry["accuracy_after_vs_adamw_points"] = 100 * (entry["accuracy_after"]["mean"] - base["mean"])
    return out


def memory_fields(scalars: dict[str, list]) -> dict[str, int | None]:
    """Peak RSS over the training steps and the training-tensor bytes, from MemoryMonitor's scalars."""
    peaks = [
        v
        for tag, series in scalars.items()
        if tag.startswith("memory/") and tag.endswith("/peak_gb")
        for _, v in series
    ]
    last = {
        k: max((v for _, v in scalars.get(f"memory/{k}_gb", [])), default=None)
        for k in ("params", "grads", "optimizer_state")
    }
    tensors = None if None in last.values() else sum(last.values())
    return {
        "peak_rss_bytes": round(max(peaks) * 1e9) if peaks else None,
        "train_tensor_bytes": None if tensors is None else round(tensors * 1e9),
        "optimizer_state_bytes": None if last["optimizer_state"] is None else round(last["optimizer_state"] * 1e9),
    }


def run_one(row: str, seed: int, optimizer: dict, config: str, common: list[str], work_dir: Path) -> dict:
    """One ``logra fit`` of a row and seed on one torch thread (a results row): accuracy, curves, step s, memory."""
    name = f"{row}_seed{seed}"
    res = logra_fit(
        name,
        config,
        [*common, *seed_args(seed), *row_args(row)],
        optimizer=optimizer,
        callbacks=row_callbacks(row),
        work_dir=work_dir,
        env=ONE_THREAD,
    )
    run = fit_metrics(res, row=row, seed=seed, lr=optimizer["init_args"]["lr"])
    if res["ok"]:
        sc = res["scalars"]
        run.update(
            curve=[[int(s), v] for s, v in sc.get("val/accuracy", [])],
            reward_mean=[[int(s), v] for s, v in sc.get("reward/mean", [])],
            **memory_fields(sc),
        )
        if "bf16/lost_share" in sc:
            run["bf16_lost_share_mean"] = statistics.fmean(v for _, v in sc["bf16/lost_share"])
    got = f"{run['accuracy_before']:.3f} -> {run['accuracy_after']:.3f}" if res["ok"] else "FAILED"
    print(f"{name}: {got} ({run['seconds']:.0f} s)", flush=True)
    return {"name": f"{row}/seed{seed}", "ok": res["ok"], "error": res.get("error"), "metrics": run}


COLS = [
    Col("row", "name"),
    Col("lr", "lr", "g"),
    Col("runs ok", lambda s: f"{s['ok_runs']}/{s['runs']}"),
    Col("accuracy before", lambda s: s["accuracy_before"]["mean"], "pct"),
    Col(
        "accuracy after, % (mean ± std, min–max)",
        lambda s: (
            (a := s["accuracy_after"])
            and f"{100 * a['mean']:.1f} ± {100 * a['std']:.1f} ({100 * a['min']:.1f}–{100 * a['max']:.1f})"
        ),
    ),
    Col("vs AdamW (points)", "accuracy_after_vs_adamw_points", "+.1f"),
    Col("s/step (median)", "step_seconds_median", ".2f"),
]
OPTIONAL = [  # shown when a result has them
    Col("peak RSS GB (median)", "peak_rss_bytes", "gb3"),
    Col("params + grads + state MB", "train_tensor_bytes", "mb1"),
    Col("bf16 updates lost", "bf16_lost_share_mean", "pct"),
]


@bench(
    "quality",
    title="Quality: held-out accuracy on the arithmetic RL task",
    quick=[],
    full=["--steps", "100"],
    variants=tuple(
        f"quality_{v}"
        for v in ("bf16", "bf16_kahan", "issue18", "lora", "lora_3seeds", "lora_r8", "lora_seeds12", "same_base_seed0")
        + tuple(f"lora_lr_sweep_{lr}" for lr in ("3e-4", "1e-3", "3e-3"))
    ),
)
class Quality(Benchmark):
    flags = {
        "config": str(CONFIGS / "arithmetic_tiny_adamw.yaml"),
        **dict.fromkeys(("lr", "steps", "val_every", "seeds", "jobs", "rows")),
        "work_dir": str(WORK_DIR / "quality"),
    }

    def add_arguments(self, ap) -> None:
        ap.add_argument("--ranks", type=int, nargs="*", default=None, help="LoGRA ranks (default 4 8 16 32)")
        ap.add_argument(
            "--logra-args", default=None, help='extra LoGRA init_args as JSON, e.g. \'{"second_moment": "full"}\''
        )
        ap.add_argument("--row-suffix", default="", help="appended to the LoGRA row names (e.g. _fullv)")
        ap.add_argument("--lora-ranks", type=int, nargs="*", default=None, help="LoRA ranks (default 16 8; --quick: 8)")
        ap.add_argument("--lora-lr", type=float, default=None, help="lr of the LoRA rows (default: the LoRA config's)")
        ap.add_argument(
            "--bf16", action="store_true", help="add the bf16-weight rows (three rounding rules, see BF16Weights)"
        )

    def settings(self, args) -> dict:
        base, logra = config_defaults(args.config), logra_defaults()
        args.ranks = args.ranks if args.ranks is not None else (QUICK["ranks"] if args.quick else [4, 8, 16, 32])
        args.lora_ranks = args.lora_ranks if args.lora_ranks is not None else ([8] if args.quick else [16, 8])
        adamw_lr = args.lr or base["lr"]
        logra_lr = args.lr or logra.get("lr") or base["lr"]
        gap = logra.get("update_proj_gap") or 50
        rows = plan_rows(args, adamw_lr, logra_lr, gap, lora_lr(args, adamw_lr))
        return {
            "config": base["config"],
            "logra_config": logra.get("config"),
            **run_budget(args, base),
            "adamw_lr": adamw_lr,
            "logra_lr": logra_lr,
            "lora_lr": lora_lr(args, adamw_lr),
            "update_proj_gap": gap,
            "lora_adapters": {row: lora_adapter(int(row[len("lora_r") :])) for row in rows if row.startswith("lora_r")},
            "batch_size": base["batch_size"],
            "group_size": base["group_size"],
            "held_out_prompts": QUICK["test_size"] if args.quick else base["held_out_prompts"],
            "optimizers": rows,
        }

    def run(self, args, settings: dict) -> list[dict]:
        test_size = QUICK["test_size"] if args.quick else None
        common = [*budget_args(settings["steps"], settings["val_check_interval"], test_size), *ONE_TORCH_THREAD]
        plan = [(row, seed, opt) for seed in settings["seeds"] for row, opt in settings["optimizers"].items()]
        return parallel(lambda p: run_one(*p, args.config, common, Path(args.work_dir)), plan, settings["jobs"])

    def summarize(self, settings: dict, rows: list[dict]) -> dict:
        return summarize([{**r["metrics"], "ok": r["ok"]} for r in rows])

    def section(self, res: dict) -> list[str]:
        """Held-out accuracy per row: mean ± std over seeds, and against AdamW's."""
        st = res["settings"]
        said = [
            "config" in st and f"Base config `{st['config']}` (LoGRA settings from `{st['logra_config']}`)",
            f"{st['steps']} RL steps",
            "batch_size" in st and f"{st['batch_size']} prompts × {st['group_size']} samples per step",
            "seeds" in st and f"seeds {st['seeds']}",
            "update_proj_gap" in st and f"update_proj_gap {st['update_proj_gap']}",
            "jobs" in st
            and f"{st['jobs']} run(s) at a time (1 torch thread each: s/step is a rough cost figure, "
            "accuracy does not depend on it)",
        ]
        rows = [
            {"name": n, "ok": s["ok_runs"] > 0, "error": f"0/{s['runs']} ok", **s} for n, s in res["summary"].items()
        ]
        cols = COLS + [c for c in OPTIONAL if any(r.get(c.value) is not None for r in rows)]
        body = table(rows, cols)
        return [command_head(res) + " " + ", ".join(x for x in said if x) + ".", "", *body, ""]

    def plot(self, res: dict, plt):
        """Held-out accuracy curves per row, mean ± std over seeds."""
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for row, s in res["summary"].items():
            if "curve" not in s:
                continue
            steps, mean, std = zip(*((c[0], 100 * c[1], 100 * c[2]) for c in s["curve"]))
            (line,) = ax.plot(steps, mean, marker="o", ms=3, label=f"{row} (n={s['ok_runs']})")
            lo, hi = [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)]
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_xlabel("RL step")
        ax.set_ylabel("held-out greedy accuracy (%)")
        lrs = ", ".join(f"{row} {s['lr']:g}" for row, s in res["summary"].items())
        ax.set_title(f"Arithmetic RL: mean ± std over seeds (lr {lrs})", fontsize=9)
        ax.legend(fontsize=8)
        return fig

    def headline(self, results: dict[str, dict]) -> list[str]:
        """Each row's held-out accuracy after RL against AdamW's."""
        summary = (results.get("quality") or {}).get("summary", {})
        parts = [
            f"{row} {num(s.get('accuracy_after_vs_adamw_points'), '+.1f')}"
            for row, s in summary.items()
            if row != "adamw"
        ]
        if not parts:
            return []
        return [
            f"- Held-out accuracy after RL vs AdamW (points, mean over seeds): {', '.join(parts)} "
            "([table](#quality-held-out-accuracy-on-the-arithmetic-rl-task))."
        ]


if __name__ == "__main__":
    main(Quality)
