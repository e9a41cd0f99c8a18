"""The benchmark harness and its results: one schema, every results file read, the README regenerated.

Fast checks only (no benchmark runs here: ``make bench`` runs every benchmark's quick mode): the
harness writes the schema it documents, every committed result passes
that schema, no results file is left unread, ``benchmarks/README.md`` is exactly what
``make_readme`` builds from the committed results, and every committed result plots. Then the
benchmarks' pure summaries.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import harness, kl_control, make_readme, rl_table
from benchmarks.common import RESULTS

ROOT = Path(__file__).resolve().parents[1]


class _Tiny(harness.Benchmark):
    def row_names(self, args, settings):
        return ["fine", "broken"]

    def measure(self, name, settings):
        if name == "broken":
            raise RuntimeError("no kernel for this row")
        return {"peak_bytes": 1}


harness.bench("_tiny_test", title="test only")(_Tiny)
harness._REGISTRY.pop("_tiny_test")  # registered for its instance only, not for the README


def test_harness_writes_the_schema_and_records_failed_rows(tmp_path: Path) -> None:
    res = harness.main(_Tiny, ["--out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == res
    harness.check(res)
    assert res["envelope"]["command"].startswith("python -m benchmarks.") and res["envelope"]["wall_seconds"] >= 0
    assert (
        set(res["envelope"]["load_start"]) == {"1m", "5m", "15m"} and "torch" in res["envelope"]["machine"]["versions"]
    )
    fine, broken = res["rows"]
    assert fine["ok"] and fine["metrics"]["peak_bytes"] == 1 and fine["error"] is None
    assert not broken["ok"] and broken["error"] == "RuntimeError: no kernel for this row" and broken["metrics"] == {}
    bad = {"envelope": {k: 0 for k in harness.ENVELOPE if k != "wall_seconds"}, "settings": {}, "rows": [{"name": "x"}]}
    with pytest.raises(ValueError, match=r"missing: envelope.wall_seconds, rows\[0\].ok"):
        harness.check(bad)


@pytest.mark.parametrize("name", list(harness.registry()))
def test_committed_results_of_a_harness_benchmark_pass_the_schema(name: str) -> None:
    entry = harness.registry()[name]
    files = [f for f in (name, *entry.variants) if (RESULTS / f"{f}.json").is_file()]
    assert files or entry.full is None, f"{name}: no committed results"
    for f in files:
        harness.check(json.loads((RESULTS / f"{f}.json").read_text()))
    quick = harness.QUICK_RESULTS / f"{name}.json"  # written by `make bench`, when it has run here
    if quick.is_file():
        harness.check(json.loads(quick.read_text()))


def test_every_results_file_is_read_by_a_registered_benchmark() -> None:
    read = {f for e in harness.registry().values() for f in (e.name, *e.variants)}
    unread = sorted(p.name for p in RESULTS.glob("*.json") if p.stem not in read)
    assert not unread, f"results files no registered benchmark renders (register them as variants): {unread}"
    for path in RESULTS.glob("*.png"):
        assert (RESULTS / f"{path.stem}.json").is_file(), f"results/{path.name} plots no results file"


def test_readme_is_what_make_readme_builds_from_the_committed_results() -> None:
    readme = ROOT / "benchmarks" / "README.md"
    assert make_readme.build(False, RESULTS, readme) == readme.read_text(), "run python -m benchmarks.make_readme"


def test_quick_and_full_commands_cover_every_benchmark() -> None:
    from benchmarks import run_all

    quick, entries = run_all.commands(quick=True), harness.registry().values()
    runnable = [e for e in entries if not getattr(e.impl, "archived", False)]
    assert {e.module for e in runnable} <= {harness.registry()[n].module for n in quick}
    assert all(e.quick is None and e.full is None for e in entries if e not in runnable)
    assert all(cmd[3] == "--quick" for cmd in quick.values())
    assert all(harness.registry()[n].full is not None for n in run_all.commands(quick=False))


def test_kl_overhead_share_skips_warmup_and_pairs_steps() -> None:
    step = [[s, 1.0 if s < 2 else 0.6] for s in range(6)]  # steps 0-1: slow warm-up
    control = [[s, 0.5 if s < 2 else 0.1] for s in range(6)]
    got = kl_control.overhead_summary({"perf/step_seconds": step, "kl/control_seconds": control}, warmup=2)
    assert got["steps_used"] == 4 and got["step_seconds_median"] == pytest.approx(0.6)
    assert got["control_seconds_median"] == pytest.approx(0.1)
    assert got["overhead_share"] == pytest.approx(0.1 / 0.5)
    assert got["overhead_share_mean"] == pytest.approx(0.1 / 0.5)  # equal steps: mean = median
    assert kl_control.overhead_summary({"perf/step_seconds": step}, warmup=0) == {
        "steps_used": 0,
        "warmup_steps_skipped": 0,
    }


def test_kl_control_settings_come_from_the_demo_config() -> None:
    control = kl_control.control_init_args(ROOT / "configs" / "arithmetic_tiny.yaml")
    assert {"target_kl", "min_scale", "sample_tokens", "max_scale"} <= set(control)
    with pytest.raises(SystemExit, match="no KLStepControl"):
        kl_control.control_init_args(ROOT / "configs" / "arithmetic_tiny_logra.yaml")


def test_kl_accuracy_summary_compares_seed_means() -> None:
    runs = [{"row": "default_lr", "seed": i, "ok": True, "accuracy_after": a} for i, a in enumerate((0.9, 1.0))]
    runs += [
        {"row": "high_lr_kl_control", "seed": i, "ok": True, "accuracy_after": a} for i, a in enumerate((0.92, 0.96))
    ]
    runs += [
        {"row": "high_lr_kl_control", "seed": 2, "ok": False},
        {"row": "demo_overhead", "seed": 0, "ok": True, "accuracy_after": 0.1},
        {"row": "overhead_jvp", "seed": 0, "ok": True, "accuracy_after": 0.2},  # a timing run per probe
    ]
    got = kl_control.accuracy_summary(runs)
    assert got["default_lr"] == {"mean": pytest.approx(0.95), "min": 0.9, "max": 1.0, "n": 2}
    assert got["high_lr_kl_control"]["n"] == 2 and "demo_overhead" not in got and "overhead_jvp" not in got
    assert got["controlled_no_worse_than_default"] is False  # 0.94 < 0.95
    diff = got["controlled_vs_default"]
    assert diff["mean_difference_points"] == pytest.approx(-1.0)
    assert diff["paired_difference_points"] == pytest.approx([2.0, -4.0])
    assert diff["paired_standard_error_points"] == pytest.approx(3.0)  # stdev 4.243 / sqrt 2
    assert kl_control.accuracy_summary(runs[:2])["controlled_no_worse_than_default"] is None


def test_sparse_bf16_delta_is_lossless_and_counts_changed_weights() -> None:
    import torch

    from benchmarks.sparse_delta import SparseDelta, bf16_bits

    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(64, 32, generator=g) * 0.02, "b": torch.zeros(32)}
    delta = SparseDelta(params)
    for lr in (1e-3, 1e-6):
        before = {n: bf16_bits(p) for n, p in params.items()}
        for p in params.values():
            p.add_(lr * torch.randn(p.shape, generator=g).sign())
        row = delta.step(params)
        changed = sum(int((bf16_bits(p) != before[n]).sum()) for n, p in params.items())
        assert row["changed"] == changed and row["bytes"] == 6 * changed and row["drift_max"] == 0.0
        assert all(torch.equal(delta.replica[n], bf16_bits(p)) for n, p in params.items())
    assert row["changed_fraction"] < 0.5  # at lr 1e-6 most weights of magnitude ~0.02 keep their bf16 value


def test_reasoning_lr_pick_uses_training_reward_and_reductions_pair_by_seed() -> None:
    sweep = [
        {"row": "adamw", "lr": lr, "ok": True, "late_reward": r} for lr, r in ((1e-4, 0.2), (3e-4, 0.5), (1e-3, 0.4))
    ]
    sweep.append({"row": "logra", "lr": 1e-3, "ok": False, "late_reward": None})
    picked = rl_table.pick_lrs(sweep)
    assert picked["adamw"]["lr"] == 3e-4 and picked["logra"]["lr"] is None

    def run(task, row, seed, train, acc):
        return {
            "task": task,
            "row": row,
            "seed": seed,
            "ok": True,
            "accuracy_before": 0.5,
            "accuracy_after": acc,
            "step_seconds_median": 1.0,
            "memory": {
                "peak_rss_bytes": 2 * train,
                "train_memory_bytes": train,
                "state_bytes": train,
                "optimizer_state_bytes": 1,
                "grad_bytes": 0,
            },
        }

    runs = [
        run("a", "adamw", 0, 100, 0.8),
        run("a", "logra", 0, 60, 0.9),
        run("a", "adamw", 1, 200, 0.6),
        run("a", "logra", 1, 100, 0.6),
        run("b", "adamw", 0, 100, 0.5),
        run("b", "logra", 0, 80, 0.5),
        run("b", "adamw", 1, 100, 0.5),
        run("b", "logra", 1, 80, 0.7),
    ]
    got = rl_table.summarize(runs, ["adamw", "logra"])
    red = got["per_task"]["a"]["logra"]["train_memory_bytes_reduction_vs_adamw"]
    assert red["mean"] == pytest.approx(0.45) and red["min"] == pytest.approx(0.4)  # seeds: 1-60/100, 1-100/200
    avg = got["average"]["logra"]
    assert avg["train_memory_bytes_reduction_vs_adamw"]["mean"] == pytest.approx((0.3 + 0.35) / 2)  # tasks per seed
    assert avg["accuracy_after_vs_adamw_points"]["mean"] == pytest.approx(((10 + 0) / 2 + (0 + 20) / 2) / 2)
    assert "train_memory_bytes_reduction_vs_adamw" not in got["average"]["adamw"]
    assert avg["state_bytes_reduction_vs_adamw"]["mean"] == pytest.approx((0.3 + 0.35) / 2)


@pytest.mark.filterwarnings("ignore:No artists with labels")  # a collapsed run has no curve to label
def test_every_committed_result_plots() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = []  # the results whose figure has data (a collapsed run's has none)
    for name, entry in harness.registry().items():
        for f in (name, *entry.variants):
            res = harness.load(f)
            fig = res and entry.impl.plot(res, plt)
            if fig:
                drawn += [f] if any(ax.has_data() for ax in fig.axes) else []
                plt.close(fig)
    main = {"optimizer_memory", "kl_control", "sync_cost", "trl_grpo", "reasoning_tasks", "long_real_run"}
    assert main | {"real_model_tasks"} <= set(drawn)


def test_plots_only_draws_the_named_benchmarks_figures(tmp_path) -> None:
    from benchmarks import plots

    for name in ("sync_cost", "sync_cost_25m", "kl_control"):
        (tmp_path / f"{name}.json").write_text((RESULTS / f"{name}.json").read_text())
    written = plots.main(["--results", str(tmp_path), "--only", "sync_cost"])
    assert sorted(p.name for p in written) == ["sync_cost.png", "sync_cost_25m.png"]  # the variant too
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["sync_cost.png", "sync_cost_25m.png"]
    with pytest.raises(SystemExit, match="unknown --only"):
        plots.main(["--only", "nope"])
