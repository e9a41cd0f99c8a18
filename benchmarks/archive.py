"""Results whose benchmark script is gone: each rendered from its committed file, never re-run.

A study that answered its question leaves its results file and a README section that reads it; the script
that measured it stays in git history (:attr:`Archived.script` at :attr:`Archived.commit`), so the numbers
keep their command and the tree does not carry code that no run needs. A section is where the script is,
the command it ran, a table of :attr:`~benchmarks.harness.Benchmark.columns` over :meth:`Archived.table_rows`
and, with ``summary_line``, every scalar of the result's summary; each class's docstring says what it
measured and what measures it now. Plots committed beside a results file stay in the README; nothing redraws
them. ``make bench`` skips these entries (they have neither a quick nor a full run); their interpretation is
in ``docs/results.md``.

Example::

    >>> scalars({"steps": 1100, "rss": {"trainer": 0.135, "engine": 0.22}, "each": [1, 2]})
    '`steps` 1100; `rss.trainer` 0.135; `rss.engine` 0.22'
"""

from __future__ import annotations

from benchmarks.harness import Benchmark, bench, flat
from benchmarks.report import Col, command_head, table


def scalars(summary: dict, prefix: str = "") -> str:
    """Every number, string and flag of a (nested) summary as ``key value`` pairs; lists are left out."""
    parts = []
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            parts.append(scalars(value, name + "."))
        elif isinstance(value, float):
            parts.append(f"`{name}` {value:.4g}")
        elif not isinstance(value, list):
            parts.append(f"`{name}` {value}")
    return "; ".join(p for p in parts if p)


class Archived(Benchmark):
    """A results file of a removed benchmark: what it measured, where its script is, and its table."""

    archived = True
    script: str
    commit: str
    summary_line = False  # add every scalar of the result's summary after the table

    def table_rows(self, res: dict) -> list[dict]:
        return [flat(r) for r in res["rows"]]

    def cols(self, rows: list[dict]) -> list[Col]:
        return self.columns

    def section(self, res: dict) -> list[str]:
        rows, where = self.table_rows(res), f"`git show {self.commit}:{self.script}`"
        out = [f"Recorded by `{self.script}`, removed after commit {self.commit} ({where}). {command_head(res)}", ""]
        out += [*table(rows, self.cols(rows)), ""] if self.columns else []
        return out + ([f"Summary: {scalars(res['summary'])}.", ""] if self.summary_line else [])


def _by_name(res: dict) -> list[dict]:
    """One row per key of the summary (a result whose summary is the table)."""
    return [{"name": k, **s} for k, s in res["summary"].items()]


def _last(key: str):
    return lambda r: (r.get(key) or [None])[-1]


@bench(
    "memory_breakdown_before_issue18",
    title="Where LoGRA's training memory went before issue 18 (per-tensor accounting)",
    quick=None,
)
class MemoryBreakdown(Archived):
    """The ~100M step's peak, every CPU allocation replayed under `torch.profiler`, with the default allocators and
    with RSS following live tensor bytes; before issue 18's storage changes (`optimizer_memory` measures LoGRA
    against the same floors now).
    """

    script, commit = "benchmarks/memory_breakdown.py", "08c5c3f"
    columns = [
        Col("row", "name"),
        Col("live tensor peak MB", "peak_live_bytes", "mb0"),
        Col("RSS peak, mmap allocator MB", "rss_live_train_peak_bytes", "mb0"),
        Col("RSS peak, default MB", "rss_default_train_peak_bytes", "mb0"),
        Col("allocator slack", "allocator_slack", "pct"),
        Col("state MB", "optimizer_state_bytes", "mb1"),
    ]
    table_rows = staticmethod(_by_name)


@bench(
    "direction_error",
    title="Update direction vs. state storage (issue 18)",
    quick=None,
    variants=("direction_error_25m",),
)
class DirectionError(Archived):
    """How far each of issue 18's storage choices (bf16 bases, bf16 first moment, factored second moment) moves LoGRA's
    update on the same real gradients: relative Frobenius error of each matrix's update against the all-fp32 full-
    second-moment LoGRA, and the cosine to AdamW's. The choices weighed are LoGRA's defaults now.
    """

    script, commit = "benchmarks/direction_error.py", "08c5c3f"
    columns = [
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

    def table_rows(self, res: dict) -> list[dict]:
        return [{**flat(r), **res["summary"].get(r["name"], {})} for r in res["rows"]]


def _peak(allocator: str) -> list[Col]:
    measured = lambda r: r["measured"][allocator]["train_peak_bytes"]  # noqa: E731
    return [
        Col(f"peak MB (`{allocator}`)", measured, "mb0"),
        Col(f"peak error (`{allocator}`)", lambda r: r["rel_error"][allocator]["peak"], "pct"),
    ]


PLANNED = ("param_bytes", "grad_bytes", "optimizer_state_bytes")


@bench("plan_vs_measured", title="Memory planner vs measurement", quick=None)
class PlanVsMeasured(Archived):
    """`logra plan` against measured bytes and peaks at ~25M / ~100M / ~400M, AdamW and LoGRA, with and without
    activation checkpointing, under two allocator settings (`live`: RSS follows live tensor bytes; `default`:
    allocator slack included); errors are predicted / measured − 1. Recorded before issue 18's storage changes;
    `real_shapes_memory` checks the planner on a real-shape RL step now.
    """

    script, commit = "benchmarks/plan_vs_measured.py", "2ac2186"
    columns = [
        Col("size", "size"),
        Col("params (M)", lambda r: r["predicted"]["params_m"], ".1f"),
        Col("optimizer", "optimizer"),
        Col("act. ckpt", lambda r: "on" if r["activation_checkpointing"] else "off"),
        Col("params+grads+state MB (plan)", lambda r: sum(r["predicted"][k] for k in PLANNED), "mb1"),
        Col("peak MB (plan)", lambda r: r["predicted"]["peak_bytes"], "mb0"),
        *_peak("live"),
        *_peak("default"),
    ]
    summary_line = True


@bench("server_engine", title="Engine in a separate vLLM server", quick=None)
class ServerEngine(Archived):
    """The demo with its engine in a `logra serve` process on the same 2 cores: the server killed and restarted mid-run
    (summary: the trainer waited, re-synced and went on; a test now, `tests/test_vllm_server.py`), then on- and off-
    policy rollouts (wall s/step batch end to batch end; the training step alone; the sync, which off-policy also
    waits for the rollout running ahead).
    """

    script, commit = "benchmarks/server_engine.py", "2ac2186"
    columns = [
        Col("run", "name"),
        Col("wall s/step", "batch_wall_median", ".3f"),
        Col("training_step s", lambda r: r["sync"]["step_seconds_median"], ".3f"),
        Col("sync s", lambda r: r["sync"]["sync_seconds_median"], ".3f"),
        Col("policy lag (syncs)", lambda r: (r.get("policy_lag") or {}).get("mean"), ".2f"),
    ]
    summary_line = True

    def table_rows(self, res: dict) -> list[dict]:
        return [flat(r) for r in res["rows"] if "batch_wall_median" in r["metrics"]]


QUALITY_VARIANTS = ("bf16", "bf16_kahan", "issue18", "lora", "lora_3seeds", "lora_r8", "lora_seeds12")
QUALITY_VARIANTS += ("same_base_seed0", "lora_lr_sweep_3e-4", "lora_lr_sweep_1e-3", "lora_lr_sweep_3e-3")


def _spread(s: dict) -> str:
    a = s["accuracy_after"]
    return a and f"{100 * a['mean']:.1f} ± {100 * a['std']:.1f} ({100 * a['min']:.1f}–{100 * a['max']:.1f})"


@bench(
    "quality",
    title="Quality: held-out accuracy on the arithmetic RL task",
    quick=None,
    variants=tuple(f"quality_{v}" for v in QUALITY_VARIANTS),
)
class Quality(Archived):
    """Held-out accuracy on the tiny arithmetic task: AdamW, LoGRA at several ranks, GaLore and LoRA over seeds; the
    variants weigh bf16-weight rounding rules and LoRA's lr and rank. The real-model table (`real_model_tasks`)
    compares accuracy now.
    """

    script, commit = "benchmarks/quality.py", "107cfcb"
    columns = [
        Col("row", "name"),
        Col("lr", "lr", "g"),
        Col("runs ok", lambda s: f"{s['ok_runs']}/{s['runs']}"),
        Col("accuracy before", lambda s: s["accuracy_before"]["mean"], "pct"),
        Col("accuracy after, % (mean ± std, min–max)", _spread),
        Col("vs AdamW (points)", "accuracy_after_vs_adamw_points", "+.1f"),
        Col("s/step (median)", "step_seconds_median", ".2f"),
    ]
    optional = [  # shown when a result has them
        Col("peak RSS GB (median)", "peak_rss_bytes", "gb3"),
        Col("params + grads + state MB", "train_tensor_bytes", "mb1"),
        Col("bf16 updates lost", "bf16_lost_share_mean", "pct"),
    ]

    def table_rows(self, res: dict) -> list[dict]:
        return [{**s, "ok": s["ok_runs"] > 0, "error": f"0/{s['runs']} ok"} for s in _by_name(res)]

    def cols(self, rows: list[dict]) -> list[Col]:
        return self.columns + [c for c in self.optional if any(r.get(c.value) is not None for r in rows)]


@bench(
    "soak",
    title="Soak: 1,100 RL steps",
    quick=None,
    variants=("soak_1100_no_trim", "soak_300_onednn_cache_64", "soak_300_onednn_cache_default"),
)
class Soak(Archived):
    """RL steps of the demo config (vLLM engine, a low-rank sync every step, KL control) with trainer and engine RSS,
    the engine's drift and skips after every step; the variants ran without the kernel-cache bound or the heap trim.
    Targets: RSS slope over the second half ≤ 1 MB / 100 steps, drift ≤ 1e-4, no skipped step. `long_real_run`
    checks the same on the real model now.
    """

    script, commit = "benchmarks/soak.py", "107cfcb"
    summary_line = True
