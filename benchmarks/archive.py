"""Results whose benchmark script is gone: each rendered from its committed file, never re-run.

A study that answered its question leaves its results file and the README section that reads it; the script
that measured it stays in git history (:attr:`Archived.script` at :attr:`Archived.commit`), so the numbers
keep their command and the tree does not carry code that no run needs. ``make bench`` skips these entries
(they have neither a quick nor a full run).

``memory_breakdown_before_issue18``: per-tensor accounting of the ~100M step's peak, replaying every CPU
allocation under ``torch.profiler`` (``profiled``), and the peak RSS with the default allocators
(``rss_default``) and with RSS following live tensor bytes (``rss_live``); recorded before issue 18's storage
changes. ``optimizer_memory`` measures LoGRA against the same floors as it is now.

``direction_error`` (``_25m``): how far each of issue 18's storage choices (bf16 bases, bf16 first moment, the
factored second moment) moves LoGRA's update on the same real gradients, against the all-fp32 full-second-moment
LoGRA, and each variant's cosine to dense AdamW's direction. The script read the optimizer's pending candidates
(private state); the choices it weighed are LoGRA's defaults now.

``plan_vs_measured``: ``logra plan`` against measured bytes and peaks, ~25M / ~100M / ~400M, AdamW and LoGRA, with
and without activation checkpointing, each row under two allocator settings (``live``: RSS follows live tensor
bytes; ``default``: allocator slack included), and the allocator slack fitted on the smallest size and checked on
the others. Recorded before issue 18's storage changes; ``real_shapes_memory`` checks the planner against the
live-bytes peak of a real-shape RL step as LoGRA is now.

``quality`` (and its variants): held-out accuracy on the tiny arithmetic task, AdamW vs LoGRA ranks 4-32 vs
GaLore vs LoRA over 3 seeds, bf16-weight rounding rules, LoRA's lr and rank. The real-model table
(``real_model_tasks``) is where accuracy is compared now.

``soak``: 1,100 RL steps of the demo config with trainer and engine RSS, engine drift and skips after every step
(and runs without the kernel-cache bound or the heap trim). ``long_real_run`` checks the same on the real model.

``server_engine``: the demo with its engine in a ``logra serve`` process, the server killed and restarted
mid-run (the trainer waited, re-synced and went on), and on- vs off-policy throughput. The restart is a test now
(``tests/test_vllm_server.py``); docs/server_engine.md reads the run.
"""

from __future__ import annotations

import json

from benchmarks.harness import Benchmark, bench, flat
from benchmarks.report import MB, Col, Target, command_head, load_text, met, num, pct, rows_table, table


class Archived(Benchmark):
    """A results file of a removed benchmark: how it reads, and where its script can still be found."""

    archived = True
    script: str
    commit: str

    def source(self) -> str:
        where = f"`git show {self.commit}:{self.script}`"
        return f"Recorded by `{self.script}`, removed from the tree after commit {self.commit} ({where})."


BREAKDOWN = [
    Col("row", "name"),
    Col("live tensor peak MB", lambda s: s.get("peak_live_bytes", 0), "mb0"),
    Col("RSS peak, mmap allocator MB", lambda s: s.get("rss_live_train_peak_bytes", 0), "mb0"),
    Col("RSS peak, default MB", lambda s: s.get("rss_default_train_peak_bytes", 0), "mb0"),
    Col("allocator slack", "allocator_slack", "pct"),
    Col("state MB", lambda s: s.get("optimizer_state_bytes", 0), "mb1"),
]


@bench(
    "memory_breakdown_before_issue18",
    title="Where LoGRA's training memory went before issue 18 (per-tensor accounting)",
    quick=None,
)
class MemoryBreakdown(Archived):
    script, commit = "benchmarks/memory_breakdown.py", "08c5c3f"

    def section(self, res: dict) -> list[str]:
        """Per row: live tensor peak, RSS peak under both allocators, the slack; then the largest live groups."""
        rows = [{"name": k, **s} for k, s in res["summary"].items()]
        out = [self.source() + " " + command_head(res, end=False), "", *table(rows, BREAKDOWN), ""]
        for r in (r["metrics"] for r in res["rows"] if r["ok"] and r["metrics"].get("mode") == "profiled"):
            step = max((k for k in r["live"] if k.startswith("step")), key=lambda k: r["live"][k]["peak_live_bytes"])
            top = ", ".join(f"{k} {v:.1f}" for k, v in list(r["live"][step]["groups"]["by_group_mb"].items())[:8])
            out += [f"- `{r['size']}/{r['name']}` live peak at {step}: {top} (MB)."]
        return out + [""]


def _last(key: str):
    return lambda r: (r.get(key) or [None])[-1]


DIRECTION = [
    Col("variant", "name"),
    Col("options", lambda r: f"`{r['options']}`"),
    Col("state MB", "state_bytes", "mb1"),
    Col("rel. err median (layers)", "rel_err_median_all_steps", ".4f"),
    Col("median, last step", "rel_err_median_last_step", ".4f"),
    Col("max", "rel_err_max_all_steps", ".3f"),
    Col("embedding, last step", _last("embedding_rel_err_per_step"), ".3f"),
    Col("cos vs AdamW, layers (median, last)", _last("cosine_vs_adamw_median_layers_per_step"), ".3f"),
    Col("cos vs AdamW, embedding (last)", _last("cosine_vs_adamw_embedding_per_step"), ".3f"),
]


@bench(
    "direction_error",
    title="Update direction vs. state storage (issue 18)",
    quick=None,
    variants=("direction_error_25m",),
)
class DirectionError(Archived):
    script, commit = "benchmarks/direction_error.py", "08c5c3f"

    def section(self, res: dict) -> list[str]:
        """One row per variant: state bytes, update error vs the reference (layers, embedding), cosine to AdamW."""
        st, summary = res["settings"], res["summary"]
        rows = [{**flat(r), **summary[r["name"]]} for r in res["rows"] if r["name"] in summary]
        reference = next(r["metrics"]["state_bytes"] for r in res["rows"] if r["name"] == "reference")
        return [
            f"{self.source()} Command: `{res['envelope']['command']}` — ~{st['size']}, rank {st['rank']}, "
            f"{st['steps']} steps, update_proj_gap {st['update_proj_gap']}; relative Frobenius error of each "
            "matrix's update vs the all-fp32 full-V LoGRA on the same gradients.",
            "",
            *table(rows, DIRECTION),
            "",
            f"Reference state: {reference / MB:.1f} MB.",
            "",
        ]


EXACT = ("param_bytes", "grad_bytes", "optimizer_state_bytes")
PLAN = [
    Col("size", "size"),
    Col("params (M)", lambda r: r["predicted"]["params_m"], ".1f"),
    Col("optimizer", "optimizer"),
    Col("act. ckpt", lambda r: "on" if r["activation_checkpointing"] else "off"),
    Col("params+grads+state MB (plan)", lambda r: sum(r["predicted"][k] for k in EXACT), "mb1"),
    # the exact sums are the same tensors under every allocator setting: the worst
    Col("error", lambda r: max((e["params_grads_state"] for e in r["rel_error"].values()), key=abs), "pct2"),
    Col("peak MB (plan)", lambda r: r["predicted"]["peak_bytes"], "mb0"),
    Col("peak phase", lambda r: r["predicted"]["peak_phase"]),
]


@bench("plan_vs_measured", title="Memory planner vs measurement", quick=None)
class PlanVsMeasured(Archived):
    script, commit = "benchmarks/plan_vs_measured.py", "2ac2186"

    def section(self, res: dict) -> list[str]:
        """Per size x optimizer x checkpointing: the plan, the measured peak under each allocator setting and the
        errors; then the targets (errors are ``predicted / measured - 1``)."""
        st, s = res["settings"], res["summary"]
        fit, t = s["allocator_slack_fit"], st["targets"]
        exact, peak = t["params_grads_state_abs_error_max"], t["peak_abs_error_max"]
        cols = PLAN + [
            c
            for m in st["allocators"]
            for c in (
                Col(f"peak MB (`{m}`)", lambda r, m=m: r["measured"][m]["train_peak_bytes"], "mb0"),
                Col(f"peak error (`{m}`)", lambda r, m=m: r["rel_error"][m]["peak"], "pct"),
            )
        ]
        fitted = lambda r: r["rel_error"]["default"]["peak_with_fitted_slack"]  # noqa: E731
        cols += [
            Col(f"peak error (`default`, slack {pct(fit['slack'])})", fitted, "pct"),
            Col("wall s", "wall_s", ".0f"),
        ]
        targets = [
            Target(
                f"params+grads+state within {pct(exact, 0)}, worst",
                "max_abs_error_params_grads_state",
                "<=",
                exact,
                "pct2",
            )
        ]
        targets += [
            Target(f"peak within {pct(peak, 0)} under `{m}`, worst", f"max_abs_error_peak_{m}", "<=", peak, "pct")
            for m in st["allocators"]
        ]
        label = f"peak within {pct(peak, 0)} under `default` with `--allocator-slack {fit['slack']:.3f}` fitted on the "
        label += f"{fit['size']} rows, worst held-out (other sizes)"
        targets.append(Target(label, "max_abs_error_peak_default_fitted_slack_held_out", "<=", peak, "pct"))
        mallocs = "; ".join(f"`{m}`: {doc}" for m, doc in st["allocators"].items())
        head = f"{self.source()} {command_head(res)} Run settings: `{json.dumps(st['run'])}`. Errors are predicted / "
        head += f"measured − 1; allocator settings: {mallocs}."
        verdicts = "; ".join(t.verdict(s) for t in targets)
        tail = f"Targets: {verdicts}; failed rows: {s['failed_rows']}."
        return [head, "", *table([flat(r) for r in res["rows"]], cols), "", tail, ""]


SERVER = [
    Col("low-rank syncs", "syncs"),
    Col("bytes per low-rank sync", lambda s: f"{num((s['bytes_per_sync_lowrank'] or 0) / 1e3, '.1f')} kB"),
    Col("full sync", lambda s: f"{num((s['bytes_per_sync_full'] or 0) / 1e6, '.2f')} MB"),
    Col("drift max", "drift_max", ".1e"),
    Col("restart recovered", lambda s: "yes" if s["restart_recovered"] else "**no**"),
    Col("accuracy", lambda a: f"{num(a.get('accuracy_before'), '.3f')} -> {num(a.get('accuracy_after'), '.3f')}"),
]
THROUGHPUT = [
    Col("rollouts", lambda r: r["name"].replace("_", "-")),
    Col("wall s/step", "batch_wall_median", ".3f"),
    Col("training_step s", lambda r: r["sync"]["step_seconds_median"], ".3f"),
    Col("sync s", lambda r: r["sync"]["sync_seconds_median"], ".3f"),
    Col("policy lag (syncs)", lambda r: (r.get("policy_lag") or {}).get("mean"), ".2f"),
]


@bench("server_engine", title="Engine in a separate vLLM server", quick=None)
class ServerEngine(Archived):
    script, commit = "benchmarks/server_engine.py", "2ac2186"

    def section(self, res: dict) -> list[str]:
        """The restart run's syncs, drift and recovery; then the on- and off-policy throughput runs."""
        s, st, runs = res["summary"], res["settings"], {r["name"]: flat(r) for r in res["rows"]}
        head = f"{self.source()} {command_head(res)} The demo config (`{st['config']}`) with its engine in a `logra "
        head += f"serve` process on the same machine (server start {st['server_start_seconds']:.0f} s); the server was "
        head += f"killed and restarted after step {st['restart_at']}."
        throughput = [runs["on_policy"], runs["off_policy"]]
        return [
            head,
            "",
            *table([{**runs["demo_restart"]["summary"], **s}], SERVER),
            "",
            "Throughput: wall seconds per step (batch end to batch end: rollout, training and sync, with whatever "
            "overlaps), the training step alone, and the sync (off-policy: it also waits for the rollout running "
            "ahead). Trainer and server share the same 2 cores here, so overlapping them has little to gain.",
            "",
            *table(throughput, THROUGHPUT),
            "",
        ]


QUALITY = [
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
QUALITY_OPTIONAL = [  # shown when a result has them
    Col("peak RSS GB (median)", "peak_rss_bytes", "gb3"),
    Col("params + grads + state MB", "train_tensor_bytes", "mb1"),
    Col("bf16 updates lost", "bf16_lost_share_mean", "pct"),
]
QUALITY_VARIANTS = ("bf16", "bf16_kahan", "issue18", "lora", "lora_3seeds", "lora_r8", "lora_seeds12")
QUALITY_VARIANTS += ("same_base_seed0", "lora_lr_sweep_3e-4", "lora_lr_sweep_1e-3", "lora_lr_sweep_3e-3")


@bench(
    "quality",
    title="Quality: held-out accuracy on the arithmetic RL task",
    quick=None,
    variants=tuple(f"quality_{v}" for v in QUALITY_VARIANTS),
)
class Quality(Archived):
    script, commit = "benchmarks/quality.py", "107cfcb"

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
        cols = QUALITY + [c for c in QUALITY_OPTIONAL if any(r.get(c.value) is not None for r in rows)]
        head = f"{self.source()} {command_head(res)} {', '.join(x for x in said if x)}."
        return [head, "", *table(rows, cols), ""]

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
        gain = lambda s: num(s.get("accuracy_after_vs_adamw_points"), "+.1f")  # noqa: E731
        parts = [f"{row} {gain(s)}" for row, s in summary.items() if row != "adamw"]
        if not parts:
            return []
        return [
            f"- Held-out accuracy after RL vs AdamW (points, mean over seeds): {', '.join(parts)} "
            "([table](#quality-held-out-accuracy-on-the-arithmetic-rl-task))."
        ]


@bench(
    "soak",
    title="Soak: 1,100 RL steps",
    quick=None,
    variants=("soak_1100_no_trim", "soak_300_onednn_cache_64", "soak_300_onednn_cache_default"),
)
class Soak(Archived):
    script, commit = "benchmarks/soak.py", "107cfcb"

    def plot(self, res: dict, plt):
        """Trainer and engine RSS per step; the engine's drift and the realized KL against the drift target."""
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
        target = res["settings"]["targets"]["max_drift_max"]
        ax2.axhline(target, color="red", lw=0.8, ls="--", label="drift target")
        ax2.set_xlabel("step")
        ax2.legend()
        return fig

    def section(self, res: dict) -> list[str]:
        """The issue's targets: steps, RSS slopes over the second half, the engine's drift, skipped steps."""
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
            f"{self.source()} Command: `{e['command']}` — {e['wall_seconds']:.0f} s, load "
            f"{load_text(e['load_start'])} at start, {load_text(e['load_end'])} at end; "
            f"{s.get('segments')} segment(s).",
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
