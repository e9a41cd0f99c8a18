"""The RL-table recipe: tasks x optimizer rows x seeds of ``logra fit``, an lr sweep per row, units kept and reused.

``reasoning_tasks`` (the ~20M builtin policy) and ``real_model_tasks`` (SmolLM2-135M on reasoning-gym) are this
recipe with their own tasks, lr grids, lr pick and report. A *unit* is one ``logra fit`` run in its own process
(the real model adds one unit per task for the base model's pass@k); it writes its record beside its logs in
``--work-dir``. With ``--reuse`` a unit whose record was made with the task's config as it is now (its settings
hashed, :func:`config_sha`) and the same step count is read back instead of run again; ``--reuse`` first
restores, from the results file, the records a fresh clone's work directory lacks. ``--max-runs N`` runs at
most N new units and writes the table so far (the others are rows with the error ``missing``).

Order: the sweep (each row's lrs on ``sweep_task``, seed 0, ``sweep_steps`` steps; ``--lr row=value`` skips it
for that row), the pick (:meth:`RLTable.pick`), then every task x row x seed at its row's lr. ``--jobs`` units
run at once. Rows are lists of ``logra fit`` overrides (:func:`row_args`): ``adamw`` (``torch.optim.AdamW``),
``logra`` (:class:`~logra_lightning.optim.LoGRA`, rank 16, every 2-D weight low-rank) and ``lora`` (a rank-16
LoRA adapter trained with AdamW).

Memory (per run, from ``memory.json``, :mod:`benchmarks.trainer_memory`): the trainer process's peak RSS, its
training-memory part (peak minus RSS before the policy was built) and exact params + grads + optimizer state.
Results: one row per unit (``sweep/<task>/<row>/lr<lr>``, ``<task>/<row>/seed<seed>``); the summary holds the
sweep's pick, per-task stats over seeds with reductions vs AdamW paired by task and seed, and task averages
taken per seed.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from pathlib import Path
from typing import NamedTuple

from benchmarks.common import WORK_DIR, held_out_args, logra_fit, seed_args, tb_scalars
from benchmarks.harness import Benchmark, flat, load, out_path, parallel
from benchmarks.report import Col, bars

ROWS = ("adamw", "logra", "lora")
RANK = 16
PAPER_REDUCTION = 0.457  # "45.7% lower average training memory" (LoGRA vs dense, the paper's abstract)
MEMORY_FILE = "memory.json"  # what TrainerPeakMemory writes into the run's log directory
RUN_FILE = "bench_run.json"  # a finished unit's record (read back with --reuse)
# whole-process peak RSS; peak minus RSS before the model; exact params + grads (after backward) + optimizer state
MEMORY_KEYS = ("peak_rss_bytes", "train_memory_bytes", "state_bytes")
# How rows are split into forward/backward passes changes memory and time, not the losses or the gradients (equal
# to the whole batch's: tests/test_token_budget.py); every unit passes its row's own optimizer. Neither is part of
# a unit's identity.
EXECUTION_ONLY = ("micro_batch_size", "max_tokens_per_micro_batch", "optimizer")
MISSING = "missing: not run yet"
QUICK_FIT_ARGS = ("--model.engine", "logra_lightning.rollout.HFEngineSpec", "--model.max_new_tokens", "8")


def row_args(row: str, lr: float) -> list[str]:
    """The ``logra fit`` overrides of an optimizer row at learning rate ``lr``."""
    adamw = {"class_path": "torch.optim.AdamW", "init_args": {"lr": lr, "weight_decay": 0.0}}
    logra = {"lr": lr, "rank": RANK, "update_proj_gap": 50, "weight_decay": 0.0}
    lora = {"class_path": "logra_lightning.models.LoRA", "init_args": {"rank": RANK, "alpha": 2 * RANK}}
    return {
        "adamw": ["--model.optimizer", json.dumps(adamw)],
        "logra": ["--model.optimizer", json.dumps({"class_path": "logra_lightning.optim.LoGRA", "init_args": logra})],
        "lora": ["--model.adapter", json.dumps(lora), "--model.optimizer", json.dumps(adamw)],
    }[row]


def config_sha(path: Path) -> str:
    """The first 12 hex digits of the SHA-256 of a config's settings (comments and :data:`EXECUTION_ONLY` model keys
    left out): a unit records it, and a unit recorded under other settings runs again."""
    import yaml

    settings = yaml.safe_load(Path(path).read_text())
    settings["model"] = {k: v for k, v in settings["model"].items() if k not in EXECUTION_ONLY}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def stats(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def pm(s: dict | None, scale: float = 1.0, fmt: str = ".1f") -> str:
    """``mean ± std`` of a :func:`stats` dict."""
    return "–" if not s else f"{format(scale * s['mean'], fmt)} ± {format(scale * s['std'], fmt)}"


def from_logs(run: dict, log_dir: Path) -> dict:
    """``run`` filled from a finished run's log directory (summary.json, memory.json, TensorBoard scalars)."""
    sc = tb_scalars(log_dir)
    rewards = [v for _, v in sc.get("reward/mean", [])]
    summary = json.loads((log_dir / "summary.json").read_text())
    memory = json.loads((log_dir / MEMORY_FILE).read_text())
    memory["state_bytes"] = memory["param_bytes"] + memory["grad_bytes"] + memory["optimizer_state_bytes"]
    return {
        **run,
        "ok": True,
        "accuracy_before": summary["accuracy_before"],
        "accuracy_after": summary["accuracy_after"],
        "reward_mean": [[int(s), v] for s, v in sc.get("reward/mean", [])],
        "late_reward": statistics.fmean(rewards[len(rewards) // 2 :]) if rewards else None,
        "step_seconds_median": statistics.median(v for _, v in sc["perf/step_seconds"]),
        "memory": memory,
    }


def pick_lrs(sweep_runs: list[dict]) -> dict[str, dict]:
    """Per row: the swept lrs with their late training reward, and the lr with the highest one."""
    out = {}
    for row in dict.fromkeys(r["row"] for r in sweep_runs):
        ok = [r for r in sweep_runs if r["row"] == row and r["ok"] and r["late_reward"] is not None]
        scores = {f"{r['lr']:g}": r["late_reward"] for r in ok}
        out[row] = {"late_reward": scores, "lr": max(ok, key=lambda r: r["late_reward"])["lr"] if ok else None}
    return out


def summarize(runs: list[dict], rows: list[str]) -> dict:
    """Per task and row: accuracy and memory stats over seeds; reductions vs AdamW paired by seed; task averages."""
    ok = {(r["task"], r["row"], r["seed"]): r for r in runs if r["ok"]}
    tasks, seeds = list(dict.fromkeys(r["task"] for r in runs)), sorted({r["seed"] for r in runs})
    reduction = lambda t, row, s, key: 1.0 - ok[(t, row, s)]["memory"][key] / ok[(t, "adamw", s)]["memory"][key]  # noqa: E731
    gain = lambda t, row, s: 100 * (ok[(t, row, s)]["accuracy_after"] - ok[(t, "adamw", s)]["accuracy_after"])  # noqa: E731
    per_task: dict = {}
    for task in tasks:
        per_task[task] = {}
        for row in rows:
            got = [ok[(task, row, s)] for s in seeds if (task, row, s) in ok]
            if not got:
                continue
            e = {
                "ok_runs": len(got),
                **{k: stats([r[k] for r in got]) for k in ("accuracy_before", "accuracy_after")},
                **{
                    k: stats([r["memory"][k] for r in got])
                    for k in (*MEMORY_KEYS, "optimizer_state_bytes", "grad_bytes")
                },
                "step_seconds_median": statistics.median(r["step_seconds_median"] for r in got),
            }
            paired = [s for s in seeds if (task, row, s) in ok and (task, "adamw", s) in ok]
            if paired and row != "adamw":
                for key in MEMORY_KEYS:
                    e[f"{key}_reduction_vs_adamw"] = stats([reduction(task, row, s, key) for s in paired])
                e["accuracy_after_vs_adamw_points"] = stats([gain(task, row, s) for s in paired])
            per_task[task][row] = e
    average: dict = {}
    for row in rows:
        complete = [s for s in seeds if all((t, row, s) in ok and (t, "adamw", s) in ok for t in tasks)]
        if not complete:
            continue
        over_tasks = lambda f: stats([statistics.fmean(f(t, s) for t in tasks) for s in complete])  # noqa: E731
        a = {"seeds": complete}
        for k in ("accuracy_before", "accuracy_after"):
            a[k] = over_tasks(lambda t, s, k=k: ok[(t, row, s)][k])
        if row != "adamw":
            for key in MEMORY_KEYS:
                a[f"{key}_reduction_vs_adamw"] = over_tasks(lambda t, s, key=key: reduction(t, row, s, key))
            a["accuracy_after_vs_adamw_points"] = over_tasks(lambda t, s: gain(t, row, s))
        average[row] = a
    return {"per_task": per_task, "average": average}


def rl_gain(average_row: dict) -> float:
    """Average held-out accuracy after RL minus before, in points."""
    return 100 * (average_row["accuracy_after"]["mean"] - average_row["accuracy_before"]["mean"])


def task_bars(res: dict, plt, panels: list[tuple[str, float, str]], title: str):
    """One panel per ``(key, scale, title)`` of the per-task stats: per task, a bar per row (mean ± std over seeds);
    the accuracy panel marks AdamW's accuracy before RL."""
    per_task = res["summary"]["per_task"]
    tasks, rows = list(per_task), list(dict.fromkeys(row for t in per_task for row in per_task[t]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, scale, name) in zip(axes, panels):
        stat = lambda t, row, key=key: per_task[t].get(row, {}).get(key)  # noqa: E731
        mean = lambda t, row: (s := stat(t, row)) and scale * s["mean"]  # noqa: E731
        bars(ax, tasks, rows, mean, err=lambda t, row: (s := stat(t, row)) and scale * s["std"], title=name)
        if key == "accuracy_after":
            before = [
                100 * per_task[t]["adamw"]["accuracy_before"]["mean"] if "adamw" in per_task[t] else 0 for t in tasks
            ]
            ax.scatter(range(len(tasks)), before, marker="_", s=600, color="k", label="before RL", zorder=3)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return fig, axes


# Per-task table columns over ``{"task", "row", **summary["per_task"][task][row]}``.
COLS = {
    "task": Col("task", "task"),
    "row": Col("row", "row"),
    "before": Col("accuracy before, %", lambda e: pm(e["accuracy_before"], 100)),
    "after": Col("accuracy after, %", lambda e: pm(e["accuracy_after"], 100)),
    "peak": Col("trainer peak RSS, MB", lambda e: pm(e["peak_rss_bytes"], 1e-6, ".0f")),
    "train": Col("training memory, MB", lambda e: pm(e["train_memory_bytes"], 1e-6, ".0f")),
    "train_vs": Col(
        "training memory vs AdamW, % lower", lambda e: pm(e.get("train_memory_bytes_reduction_vs_adamw"), 100)
    ),
}


class Unit(NamedTuple):
    """One ``logra fit`` of the table: ``tag`` is ``"sweep_"`` for a sweep run."""

    task: str
    row: str
    lr: float | None
    seed: int
    steps: int
    extra: tuple[str, ...]
    tag: str = ""

    @property
    def name(self) -> str:
        return f"sweep/{self.task}/{self.row}/lr{self.lr:g}" if self.tag else f"{self.task}/{self.row}/seed{self.seed}"

    def log_dir(self, work_dir: Path) -> Path:
        return work_dir / f"{self.tag}{self.task}_{self.row}_lr{self.lr:g}_seed{self.seed}" / "version_0"


class RLTable(Benchmark):
    """The recipe; a table sets the class attributes and may override the hooks (``pick``, ``record``, ``extra``)."""

    tasks: tuple[str, ...]
    model: str  # the configs' policy
    sweep_lrs: dict[str, list[float]]
    full: dict  # steps, sweep_steps, sweep_lrs (per row, None: all), seeds, later_seed_tasks, jobs, test_size
    quick: dict
    sweep_test_size: int | None = None  # held-out prompts of the sweep runs (None: the config's)
    sweep_data_seed: int | None = None  # the sweep's problems from another draw than the table's (None: the same)
    fit_args: tuple[str, ...] = ()  # ``logra fit`` arguments of every unit
    env: dict[str, str] = {}
    timeout: float | None = None

    def config(self, task: str) -> Path:
        raise NotImplementedError

    def callbacks(self, task: str) -> list[dict]:
        raise NotImplementedError

    def quick_model(self, work_dir: Path) -> str:
        raise NotImplementedError

    def pick(self, sweep_runs: list[dict]) -> dict[str, dict]:
        """Per row, the swept lrs' scores and the lr picked (default: the highest late training reward)."""
        return pick_lrs(sweep_runs)

    def record(self, run: dict, log_dir: Path, res: dict) -> dict:
        """A finished run's record (add fields from its log directory here)."""
        return run

    def extra_units(self, args, settings: dict, work_dir: Path, budget: list[int]) -> list[dict]:
        """Rows of units before the sweep (the real model's base pass@k)."""
        return []

    @property
    def flags(self) -> dict:
        return {"rows": list(ROWS), **dict.fromkeys(("seeds", "steps", "jobs")), "work_dir": str(WORK_DIR / self.name)}

    def add_arguments(self, ap) -> None:
        ap.add_argument("--tasks", nargs="*", default=list(self.tasks), help=f"subset of {self.tasks}")
        ap.add_argument("--later-seed-tasks", nargs="*", default=None, help="tasks that run the seeds after the first")
        ap.add_argument("--lr", nargs="*", default=None, help="ROW=LR: skip the sweep for that row, e.g. adamw=1e-5")
        ap.add_argument("--model", default=None, help="policy of every run instead of the configs'")
        ap.add_argument("--test-size", type=int, default=None, help="held-out prompts per task (default: the configs')")
        ap.add_argument("--reuse", action="store_true", help="read back units already finished in --work-dir")
        ap.add_argument("--max-runs", type=int, default=None, help="run at most this many new units")

    def settings(self, args) -> dict:
        mode = self.quick if args.quick else self.full
        unknown = {t for t in args.tasks if not self.config(t).is_file()} | (set(args.rows) - set(ROWS))
        if unknown or "adamw" not in args.rows:
            raise SystemExit(
                f"--tasks/--rows: unknown {sorted(unknown)} or no adamw row (the baseline of every reduction)"
            )
        fixed = {}
        for item in args.lr or []:
            row, _, value = item.partition("=")
            if row not in ROWS or not value:
                raise SystemExit(f"--lr {item!r}: use ROW=VALUE with ROW one of {', '.join(ROWS)}")
            fixed[row] = float(value)
        later = args.later_seed_tasks if args.later_seed_tasks is not None else mode["later_seed_tasks"]
        n = mode["sweep_lrs"]
        model = args.model or (self.quick_model(Path(args.work_dir)) if args.quick else self.model)
        return {
            "model": model,
            "tasks": args.tasks,
            "rows": args.rows,
            "seeds": args.seeds if args.seeds is not None else mode["seeds"],
            "later_seed_tasks": later or None,  # `--later-seed-tasks` with no task: every task runs every seed
            "steps": args.steps or mode["steps"],
            "jobs": args.jobs or mode["jobs"],
            "rank": RANK,
            "held_out_prompts": args.test_size or mode["test_size"],
            "sweep": {
                "task": args.tasks[0],
                "steps": mode["sweep_steps"],
                "seed": 0,
                "data_seed": self.sweep_data_seed,
                "fixed": fixed,
                "lrs": {row: self.sweep_lrs[row][:n] for row in args.rows if row not in fixed},
            },
            "quick": args.quick,
            "paper_reduction": PAPER_REDUCTION,
        }

    def extra(self, args, settings: dict) -> list[str]:
        """``logra fit`` arguments of every unit: the model, the held-out size (and, quick, a tiny run)."""
        out = [*self.fit_args, *(self.quick["fit_args"] if args.quick else [])]
        out += ["--model.model", settings["model"]] if settings["model"] != self.model else []
        if n := settings["held_out_prompts"]:
            out += held_out_args(n)
        return out

    def run(self, args, settings: dict) -> list[dict]:
        st, work_dir = settings, Path(args.work_dir)
        if args.reuse:
            restore_units(out_path(self, args), work_dir)
        budget = [args.max_runs if args.max_runs is not None else math.inf]
        rows = self.extra_units(args, st, work_dir, budget)
        extra = tuple(self.extra(args, st))
        sweep_extra = extra
        if n := self.sweep_test_size:
            sweep_extra += tuple(held_out_args(n))
        if self.sweep_data_seed is not None:
            seed = str(self.sweep_data_seed)
            sweep_extra += ("--data.train.init_args.seed", seed, "--data.val.init_args.seed", seed)
        sw = st["sweep"]
        sweep = [
            Unit(sw["task"], row, lr, 0, sw["steps"], sweep_extra, "sweep_")
            for row, lrs in sw["lrs"].items()
            for lr in lrs
        ]
        rows += self.units(sweep, args, work_dir, budget)
        lrs = self.lrs(st, rows)
        table = [
            Unit(task, row, lrs[row], seed, st["steps"], extra)
            for seed in st["seeds"]
            for task in st["tasks"]
            if seed == st["seeds"][0] or st["later_seed_tasks"] is None or task in st["later_seed_tasks"]
            for row in st["rows"]
        ]
        return rows + self.units(table, args, work_dir, budget)

    def lrs(self, settings: dict, rows: list[dict]) -> dict[str, float | None]:
        """Each row's lr: ``--lr``, else the sweep's pick once the row's sweep is complete (else ``None``)."""
        sweep = [r for r in rows if r["name"].startswith("sweep/")]
        picked = self.pick([flat(r) for r in sweep if r["ok"]])
        waiting = {r["metrics"]["row"] for r in sweep if r["error"] == MISSING}
        fixed = settings["sweep"]["fixed"]
        return {
            row: fixed.get(row) or (None if row in waiting else picked.get(row, {}).get("lr"))
            for row in settings["rows"]
        }

    def units(self, units: list[Unit], args, work_dir: Path, budget: list[int]) -> list[dict]:
        """Each unit's results row: read back (``--reuse``), run (within the budget, ``--jobs`` at once) or missing."""
        got, todo = {}, []
        for u in units:
            record = finished(u.log_dir(work_dir) / RUN_FILE, self.config(u.task), u.steps) if args.reuse else None
            if record:
                got[u] = {"name": u.name, "ok": True, "error": None, "metrics": record}
            elif u.lr is not None and budget[0] > 0:
                budget[0] -= 1
                todo.append(u)
            else:
                why = MISSING if u.lr is not None else f"{MISSING} (waiting for the sweep)"
                got[u] = {"name": u.name, "ok": False, "error": why, "metrics": u._asdict()}
        for u, row in zip(todo, parallel(lambda u: self.fit(u, work_dir), todo, args.jobs or self.full["jobs"])):
            got[u] = row
        return [got[u] for u in units]

    def fit(self, u: Unit, work_dir: Path) -> dict:
        """Run one unit; its results row (a finished one also written to its log directory)."""
        log_dir = u.log_dir(work_dir)
        budget = ["--trainer.max_steps", str(u.steps), "--trainer.val_check_interval", str(u.steps)]
        args = [*budget, *seed_args(u.seed), *u.extra, *row_args(u.row, u.lr)]
        callbacks = self.callbacks(u.task)
        res = logra_fit(
            log_dir.parent.name,
            self.config(u.task),
            args,
            callbacks=callbacks,
            work_dir=work_dir,
            env=self.env,
            timeout=self.timeout,
        )
        run = {
            "task": u.task,
            "row": u.row,
            "lr": u.lr,
            "seed": u.seed,
            "steps": u.steps,
            "config_sha": config_sha(self.config(u.task)),
            **{k: res[k] for k in ("seconds", "load_before", "load_after", "command")},
        }
        if not (res["ok"] and (log_dir / MEMORY_FILE).is_file()):
            error = res.get("error") or f"no {MEMORY_FILE} in {log_dir}"
            print(f"{u.name}: FAILED {error[-300:]}", flush=True)
            return {"name": u.name, "ok": False, "error": error, "metrics": run}
        run = self.record(from_logs(run, log_dir), log_dir, res)
        (log_dir / RUN_FILE).write_text(json.dumps(run, indent=2))
        print(
            f"{u.name}: {run['accuracy_before']:.3f} -> {run['accuracy_after']:.3f}, training memory "
            f"{run['memory']['train_memory_bytes'] / 1e6:.0f} MB ({run['seconds']:.0f} s)",
            flush=True,
        )
        return {"name": u.name, "ok": True, "error": None, "metrics": run}

    def summarize(self, settings: dict, rows: list[dict]) -> dict:
        runs = [flat(r) for r in rows if "/seed" in r["name"] and not is_missing(r)]  # the table's, not sweep/base
        sweep = [flat(r) for r in rows if r["name"].startswith("sweep/") and r["ok"]]
        missing = [r["name"] for r in rows if is_missing(r)]
        rows_run = [row for row in settings["rows"] if row not in settings.get("pending", {})]
        return {
            "sweep": self.pick(sweep),
            "lrs": self.lrs(settings, rows),
            "complete": not missing,
            "missing": missing,
            **summarize(runs, rows_run),
        }


def is_missing(row: dict) -> bool:
    """Whether a results row is a unit not run yet (``--max-runs``, or waiting for the sweep)."""
    return (row["error"] or "").startswith(MISSING)


def finished(path: Path, config: Path, steps: int | None = None) -> dict | None:
    """The record at ``path`` if it was made with ``config`` as it is now (and ``steps``), else None."""
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("config_sha") != config_sha(config) or (steps is not None and record.get("steps") != steps):
        print(f"{path}: recorded with another config or step count; running it again", flush=True)
        return None
    return record


def restore_units(results: Path, work_dir: Path) -> int:
    """Write the finished units recorded in ``results`` back into ``work_dir`` where it lacks them.

    The work directory is git-ignored; the results file is committed after every sitting. So a fresh clone
    resumes the table where the last sitting stopped instead of running hours of units again. Returns how many
    units were restored.
    """
    res, restored = load(results.stem, results.parent) or {}, 0
    for r in res.get("rows", []):
        m = r["metrics"]
        if not r["ok"]:
            continue
        if r["name"].startswith("base/"):
            path = work_dir / f"base_{m['task']}" / "base.json"
        else:
            tag = "sweep_" if r["name"].startswith("sweep/") else ""
            path = (
                Unit(m["task"], m["row"], m["lr"], m["seed"], m.get("steps", 0), (), tag).log_dir(work_dir) / RUN_FILE
            )
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(m, indent=2))
            restored += 1
    if restored:
        print(f"restored {restored} finished units from {results} into {work_dir}", flush=True)
    return restored


def lr_lines(res: dict, score: str, fmt, criterion: str) -> tuple[str, list[str]]:
    """The lr sentence of a table's section (each row's lr and the sweep's ``score`` per lr, ``fmt`` formatting one),
    and a line per pending row."""
    st, summ = res["settings"], res["summary"]
    waiting = {m.split("/")[2] for m in summ["missing"] if m.startswith("sweep/")}
    lrs = ", ".join(
        f"{row} {lr:g}" + (" (best so far; sweep not finished)" if row in waiting else "")
        for row, lr in summ["lrs"].items()
        if lr is not None
    )
    scores = "; ".join(
        f"{row}: " + ", ".join(f"{lr} → {fmt(v)}" for lr, v in s[score].items()) for row, s in summ["sweep"].items()
    )
    sw = st["sweep"]
    text = f"lr per row: {lrs or '–'} (sweep on {sw['task']}, {sw['steps']} steps, seed 0, {criterion}: "
    pending = [line for row, why in st.get("pending", {}).items() for line in (f"Row `{row}`: {why}.", "")]
    return text + f"{scores or 'not swept'}).", pending
