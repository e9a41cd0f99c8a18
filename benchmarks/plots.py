"""PNG plots of the benchmark results (matplotlib, no display needed).

Run after the benchmarks (``benchmarks/run_all.py`` does):

    .venv/bin/python benchmarks/plots.py            # benchmarks/results/*.json -> *.png
    .venv/bin/python benchmarks/plots.py --quick    # *_quick.json -> *_quick.png (CI smoke)

One figure per results file; a missing results file skips its figure (and says so).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import RESULTS  # noqa: E402
from benchmarks import reasoning_tasks  # noqa: E402

GB = 1e9


def _load(name: str, quick: bool, results: Path) -> dict | None:
    path = results / f"{name}{'_quick' if quick else ''}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _save(fig, name: str, quick: bool, results: Path) -> Path:
    path = results / f"{name}{'_quick' if quick else ''}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return path


def plot_optimizer_memory(res: dict, plt):
    sizes = list(res["sizes"])
    names = list(dict.fromkeys(r["name"] for s in sizes for r in res["sizes"][s]))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    width = 0.8 / max(len(sizes), 1)
    metrics = [("train_peak_bytes", "training memory (GB): peak RSS - RSS before model", GB),
               ("optimizer_state_bytes", "optimizer state (GB)", GB),
               ("step_cpu_ratio_vs_adamw", "step CPU time / AdamW's (median)", 1.0)]  # fmt: skip
    for ax, (key, title, scale) in zip(axes, metrics):
        for i, size in enumerate(sizes):
            rows = {r["name"]: r for r in res["sizes"][size]}
            xs = [j + i * width for j in range(len(names))]
            vals = [rows[n][key] / scale if n in rows and rows[n].get("ok") and rows[n].get(key) is not None else 0.0
                    for n in names]  # fmt: skip
            ax.bar(xs, vals, width, label=size)
            for x, n in zip(xs, names):
                if n in rows and not rows[n].get("ok"):
                    ax.text(x, 0, "x", ha="center", va="bottom", color="red")
        ax.set_xticks([j + width * (len(sizes) - 1) / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        if key == "step_cpu_ratio_vs_adamw":
            ax.axhline(1.15, color="gray", ls="--", lw=0.8)
    axes[0].legend(title="model")
    fig.suptitle("Optimizer memory and speed (each row its own process; x = failed row)", fontsize=10)
    return fig


def plot_quality(res: dict, plt):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row, s in res["summary"].items():
        if "curve" not in s:
            continue
        steps = [c[0] for c in s["curve"]]
        mean = [100 * c[1] for c in s["curve"]]
        std = [100 * c[2] for c in s["curve"]]
        (line,) = ax.plot(steps, mean, marker="o", ms=3, label=f"{row} (n={s['ok_runs']})")
        ax.fill_between(steps, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                        color=line.get_color(), alpha=0.15)  # fmt: skip
    st = res["settings"]
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title(f"Arithmetic RL: mean ± std over seeds {st['seeds']} (lr AdamW {st['adamw_lr']:g}, low-rank {st['logra_lr']:g})",
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    return fig


def plot_kl_control(res: dict, plt):
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


def plot_sync(res: dict, plt):
    rows = {size: r for size, r in res["sizes"].items() if r["ok"]}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    x, width = range(len(rows)), 0.38
    for ax, key, title in ((axes[0], "bytes", "MB sent per sync"), (axes[1], "seconds_median", "seconds per sync (median)")):
        scale = 1e6 if key == "bytes" else 1.0
        for i, (kind, label) in enumerate((("lowrank_sync", "low-rank"), ("full_sync", "full"))):
            ax.bar([j + (i - 0.5) * width for j in x], [r[kind][key] / scale for r in rows.values()], width,
                   label=label, color=f"C{i}")  # fmt: skip
        ax.set_xticks(list(x), [f"{size} (r={r['rank']})" for size, r in rows.items()])
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle("Weight sync to a vLLM engine (fp32, CPU): low-rank factors vs full weights", fontsize=10)
    return fig


def plot_trl(res: dict, plt):
    rows = [r for r in res["rows"] if r.get("ok")]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    names = [r["row"] for r in rows]
    for ax, (key, title, scale) in zip(axes, [("peak_bytes", "training memory (MB)", 1e6),
                                              ("step_seconds_median", "seconds per RL step (median)", 1.0),
                                              ("accuracy_after", "held-out accuracy after (%)", 0.01)]):  # fmt: skip
        ax.bar(names, [r[key] / scale for r in rows], color=[f"C{i}" for i in range(len(rows))])
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"TRL GRPOTrainer vs logra fit, {res['settings']['steps']} steps", fontsize=10)
    return fig


PLOTS = {"optimizer_memory": plot_optimizer_memory, "quality": plot_quality, "kl_control": plot_kl_control,
         "sync_cost": plot_sync, "trl_grpo": plot_trl, "reasoning_tasks": reasoning_tasks.plot}  # fmt: skip


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="plot the *_quick.json results")
    ap.add_argument("--results", default=str(RESULTS), help="folder of the results JSON files")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, written = Path(args.results), []
    for name, fn in PLOTS.items():
        res = _load(name, args.quick, results)
        if res is None:
            print(f"skip {name}: no results file")
            continue
        fig = fn(res, plt)
        written.append(_save(fig, name, args.quick, results))
        plt.close(fig)
    return written


if __name__ == "__main__":
    main()
