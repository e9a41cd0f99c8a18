"""The long real-model runs' report (benchmarks/long_real_run.py on benchmarks/run_curves.py): its math and checks.

The runs take hours; these tests write small TensorBoard event files with ``SummaryWriter`` (float32 values, as
Lightning's logger writes them) and check what the report reads from them: a resumed run stitched into one
curve, the RSS slope across sittings, the realized-KL share, and checks without inputs reported as not measured.
"""

from __future__ import annotations

import doctest
import json
import shutil
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from benchmarks import harness, run_curves
from benchmarks import long_real_run as lrr
from benchmarks.run_curves import by_sitting, kl_within_2x, read_run, rises, slope_per_100


def _write(run_dir: Path, version: int, scalars: dict[str, list]) -> None:
    with SummaryWriter(run_dir / f"version_{version}") as w:
        for tag, points in scalars.items():
            for step, value in points:
                w.add_scalar(tag, value, step)


def test_docstring_examples_run() -> None:
    for module in (run_curves, lrr):
        assert doctest.testmod(module).failed == 0
    assert doctest.testmod(run_curves).attempted >= 3


def test_a_resumed_sitting_wins_from_its_first_step_and_versions_read_in_numeric_order(tmp_path: Path) -> None:
    # version_9 ran steps 0-9 and was killed; version_10 resumed from the step-6 checkpoint (10 sorts before 9 as text)
    _write(tmp_path, 9, {"reward/mean": [(s, s) for s in range(10)], "kl/realized": [(0, 1.0), (5, 2.0), (8, 3.0)]})
    later = {"reward/mean": [(s, 100 + s) for s in range(6, 13)], "sync/seconds": [(6, 1.0), (6, 0.5), (7, 0.25)]}
    _write(tmp_path, 10, {**later, "hp_metric": [(0, -1.0)]})  # Lightning logs hp_metric at step 0 in every sitting
    curves, sittings = read_run(tmp_path)
    assert curves["reward/mean"] == [[s, s] for s in range(6)] + [[s, 100 + s] for s in range(6, 13)]
    assert curves["kl/realized"] == [[0, 1.0], [5, 2.0]]  # a tag the later sitting did not log is cut there too
    assert curves["sync/seconds"] == [[6, 0.5], [7, 0.25]]  # a step logged twice in a sitting: its later value
    assert "hp_metric" not in curves
    assert sittings == [
        {"version": 9, "first_step": 0, "last_step": 9, "resumed_from_step": None, "step_seconds_median": None},
        {"version": 10, "first_step": 6, "last_step": 12, "resumed_from_step": 6, "step_seconds_median": None},
    ]


def test_a_sitting_starts_at_its_first_trained_batch_and_steps_count_optimizer_steps() -> None:
    # sitting 0 trained batches 0-11, two of them skipped, and was killed after the checkpoint of optimizer step 8
    # (batch 10); sitting 1 logged its start and end evaluations at global steps 8 and 12 (the older library's
    # axis), and trained batches 10-14
    first = {"perf/step_seconds": [[s, 1.0] for s in range(12)], "health/skipped_batches": [[11, 2.0]]}
    later = {
        "perf/step_seconds": [[s, 4.0] for s in range(10, 15)],  # on a slower machine
        "health/skipped_batches": [[14, 2.0]],
        "val/accuracy": [[8, 0.5], [12, 0.6]],
    }
    curves, sittings = run_curves.stitch([(0, {**first, "val/accuracy": [[0, 0.1]]}), (1, later)])
    assert sittings[1]["first_step"] == 10 and [s for s, _ in curves["perf/step_seconds"]] == list(range(15))
    assert [st["step_seconds_median"] for st in sittings] == [1.0, 4.0]
    # the point at 8 falls before the sitting's first batch and is left out; the one at 12 stays, 2 batches early
    assert curves["val/accuracy"] == [[0, 0.1], [12, 0.6]]
    assert run_curves.steps_reached(curves) == 13  # 15 batches, 2 skipped


def test_rss_slope_takes_the_second_half_with_one_intercept_per_sitting(tmp_path: Path) -> None:
    # 2 MB per 100 steps in each sitting; the resumed process starts 200 MB lower, so one line through all would fall
    first = [(s, 1.5 + 2e-5 * s) for s in range(0, 25)]
    second = [(s, 1.3 + 2e-5 * s) for s in range(25, 40)]
    _write(tmp_path, 0, {lrr.TRAINER_RSS: first, "perf/step_seconds": [(s, 1.0) for s in range(25)]})
    _write(tmp_path, 1, {lrr.TRAINER_RSS: second, "perf/step_seconds": [(s, 1.0) for s in range(25, 40)]})
    curves, sittings = read_run(tmp_path)
    groups = by_sitting(curves[lrr.TRAINER_RSS], sittings, from_step=20)
    assert [[s for s, _ in g] for g in groups] == [list(range(20, 25)), list(range(25, 40))]
    # float32 storage rounds each value by <= 6e-8 x 1.5 GB = 1e-4 MB; over steps 5-15 apart that moves the slope
    # by < 0.01 MB per 100 steps
    assert slope_per_100(groups) == pytest.approx(2.0, abs=0.01)
    metrics = lrr.row_metrics(curves, sittings, target_kl=3e-4, baseline=None, warmup=0)
    assert metrics["steps_reached"] == 40 and metrics["trainer_rss_slope_mb_per_100"] == pytest.approx(2.0, abs=0.01)
    assert metrics["engine_rss_slope_mb_per_100"] is None  # the tag is not in these logs
    pooled = slope_per_100([groups[0] + groups[1]])  # the naive fit sees the restart as a fall
    assert pooled is not None and pooled < 0


def test_realized_kl_share_within_2x_counts_both_edges() -> None:
    target = 3e-4  # halving and doubling are exact in binary floating point: 1.5e-4 and 6e-4 sit on the edges
    share, median = kl_within_2x([1.5e-4, 6e-4, 3e-4, 1.4e-4, 7e-4], target)
    assert share == pytest.approx(3 / 5) and median == pytest.approx(3e-4)
    assert kl_within_2x([], target) == (None, None)


def test_skipped_steps_count_rises_of_the_cumulative_counter_and_a_restarted_counter() -> None:
    counter = [[0, 0.0], [1, 1.0], [2, 1.0], [3, 3.0], [4, 0.0], [5, 1.0]]  # step 4: a sitting whose counter began at 0
    assert rises(counter) == [1, 3, 3, 5]


def test_rss_slope_leaves_out_each_sittings_warm_up(tmp_path: Path) -> None:
    # a resumed process's RSS rises 30 MB over its first 10 steps, then stays flat: growth of a fresh process, no leak
    rss = [(s, 1.40) for s in range(0, 100)] + [(s, 1.40 + 0.003 * min(s - 100, 10)) for s in range(100, 200)]
    _write(tmp_path, 0, {lrr.TRAINER_RSS: rss[:100], "perf/step_seconds": [(s, 1.0) for s in range(100)]})
    _write(tmp_path, 1, {lrr.TRAINER_RSS: rss[100:], "perf/step_seconds": [(s, 1.0) for s in range(100, 200)]})
    curves, sittings = read_run(tmp_path)
    metrics = lrr.row_metrics(curves, sittings, target_kl=3e-4, baseline=None, warmup=10)
    assert metrics["trainer_rss_slope_mb_per_100"] == pytest.approx(0.0, abs=0.01)
    assert metrics["trainer_rss_slope_mb_per_100_with_warmup"] > 5.0  # the rise read as growth


def _logra_metrics(**over) -> dict:
    series = {"val/accuracy": [[0, 0.04], [49, 0.10]], lrr.STEP_PEAK: [[0, 2.0], [1, 2.1]]}
    base = dict(steps_reached=50, skipped_fraction=0.0, weight_drift_max=None, weight_drift_steps=0, kl_measured=10)
    base |= dict(trainer_rss_slope_mb_per_100=0.5, engine_rss_slope_mb_per_100=None, kl_within_2x_share=0.9)
    base |= dict(kl_target=3e-4, accuracy_best=0.10, accuracy_gain=0.06, series=series)
    return base | over


def test_checks_whose_inputs_are_missing_are_not_measured_never_passed() -> None:
    checks = {c["check"]: c for c in lrr.done_when({"logra": _logra_metrics()}, {"targets": lrr.TARGETS})}
    assert set(checks) == set(lrr.TARGETS)
    not_measured = {"logra_drift", "logra_engine_rss", "accuracy_vs_adamw", "best_vs_adamw", "memory_vs_adamw"}
    assert {n for n, c in checks.items() if c["status"] == "not measured"} == not_measured
    assert all(checks[n]["value"] is None for n in not_measured)
    assert checks["logra_steps"]["status"] == "fail" and checks["logra_steps"]["compares"] == "steps reached >= 1100"
    assert checks["logra_skipped"]["status"] == "pass" and checks["logra_trainer_rss"]["status"] == "pass"
    assert checks["logra_kl_within_2x"]["status"] == "fail"  # 90% < 95%
    assert checks["logra_gain"]["value"] == pytest.approx(6.0) and checks["logra_gain"]["status"] == "fail"
    assert "0 of 50 steps" in checks["logra_drift"]["compares"]
    nothing = lrr.done_when({}, {"targets": lrr.TARGETS})  # no run has logs yet
    assert {c["status"] for c in nothing} == {"not measured"}


def test_checks_against_adamw_compare_common_evaluations_and_memory_per_step() -> None:
    adamw = _logra_metrics(accuracy_best=0.13)
    adamw["series"] = {
        "val/accuracy": [[0, 0.05], [49, 0.13], [99, 0.2]],
        lrr.STEP_PEAK: [[0, 3.5], [1, 3.0]],
    }
    rows = {"logra": _logra_metrics(), "adamw": adamw}
    s = {"targets": lrr.TARGETS, "rss_before_model_bytes": int(0.5e9)}
    checks = {c["check"]: c for c in lrr.done_when(rows, s)}
    acc = checks["accuracy_vs_adamw"]  # only step 49 is after step 0 and in both: 10% - 13%
    assert (
        acc["value"] == pytest.approx(-3.0) and acc["status"] == "fail" and "over the 1 evaluations" in acc["compares"]
    )
    assert checks["best_vs_adamw"]["value"] == pytest.approx(-3.0)  # AdamW's 20% at step 99: LoGRA did not run there
    # training memory = step peak - 0.5 GB: step 0 (2.0 - 0.5) / (3.5 - 0.5) = 0.5, step 1 (2.1 - 0.5) / 2.5 = 0.64
    assert checks["memory_vs_adamw"]["value"] == pytest.approx(0.64) and checks["memory_vs_adamw"]["status"] == "fail"


def test_memory_against_adamw_takes_each_rows_own_baseline() -> None:
    """Rows read on different machines keep their own RSS before the model; the settings' is the fallback."""
    adamw = _logra_metrics()
    adamw["series"] = {lrr.STEP_PEAK: [[0, 3.5], [1, 3.0]]}
    adamw["rss_before_model_bytes"] = int(1.0e9)  # read where the baseline is 1 GB; LoGRA's row has none: 0.5 GB
    rows = {"logra": _logra_metrics(), "adamw": adamw}
    checks = {
        c["check"]: c for c in lrr.done_when(rows, {"targets": lrr.TARGETS, "rss_before_model_bytes": int(0.5e9)})
    }
    # step 0: (2.0 - 0.5) / (3.5 - 1.0) = 0.6, step 1: (2.1 - 0.5) / (3.0 - 1.0) = 0.8
    assert checks["memory_vs_adamw"]["value"] == pytest.approx(0.8)


def test_best_against_adamw_waits_for_an_evaluation_after_step_0() -> None:
    adamw = _logra_metrics(accuracy_best=0.05)
    adamw["series"] = {"val/accuracy": [[0, 0.05]]}  # AdamW's run has only its base evaluation yet
    rows = {"logra": _logra_metrics(), "adamw": adamw}
    checks = {c["check"]: c for c in lrr.done_when(rows, {"targets": lrr.TARGETS})}
    assert checks["best_vs_adamw"]["status"] == "not measured"


def test_fit_command_resumes_only_a_run_with_a_checkpoint(tmp_path: Path) -> None:
    seed1 = lrr.ROWS["logra_seed1"]
    cmd = lrr.fit_command(seed1, tmp_path, 300)
    assert cmd[cmd.index("--seed_everything") + 1] == "1" and "--ckpt_path" not in cmd
    assert cmd[cmd.index("--trainer.logger.init_args.name") + 1] == "smollm2_long_seed1"
    assert cmd[cmd.index("--trainer.max_steps") + 1] == "300" and cmd[cmd.index("--config") + 1].endswith("long.yaml")
    ckpt = tmp_path / "smollm2_long_seed1" / "version_3" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.touch()
    assert lrr.fit_command(seed1, tmp_path, 300)[-2:] == ["--ckpt_path", "last"]


@pytest.mark.filterwarnings("ignore:No artists with labels")
def test_report_only_reads_every_row_and_writes_the_schema(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrr.write_example_logs(tmp_path / "runs")
    argv = ["--report-only", "--work-dir", str(tmp_path / "runs"), "--rss-before-model-mb", "500"]
    res = harness.main(lrr.LongRealRun, [*argv, "--out", str(tmp_path / "r.json")])
    harness.check(json.loads((tmp_path / "r.json").read_text()))
    logra = res["rows"][0]["metrics"]
    assert [r["name"] for r in res["rows"]] == list(lrr.ROWS) and all(r["ok"] for r in res["rows"])
    assert [s["resumed_from_step"] for s in logra["sittings"]] == [None, 8] and logra["steps_reached"] == 20
    assert logra["weight_drift_steps"] == 12  # the drift tag is in the later sitting only (steps 8-19)
    assert sum(res["summary"]["counts"].values()) == len(lrr.TARGETS)
    assert any("| logra | 20 (2) |" in line for line in lrr.LongRealRun._instance.section(res))
    fig = lrr.LongRealRun._instance.plot(res, plt)
    assert all(ax.has_data() for ax in fig.axes if ax.get_visible())
    plt.close(fig)


def test_a_row_not_run_yet_is_named_not_failed(tmp_path: Path) -> None:
    lrr.write_example_logs(tmp_path / "runs")
    shutil.rmtree(tmp_path / "runs" / lrr.run_name(lrr.ROWS["lora"]))
    argv = ["--report-only", "--work-dir", str(tmp_path / "runs"), "--rss-before-model-mb", "500"]
    res = harness.main(lrr.LongRealRun, [*argv, "--out", str(tmp_path / "r.json")])
    assert "lora" not in [r["name"] for r in res["rows"]] and res["settings"]["not_run"] == ["lora"]
    assert lrr.LongRealRun._instance.describe(res).endswith("Not run yet: lora.")
    assert not any("failed" in line for line in lrr.LongRealRun._instance.section(res))


def test_a_row_whose_logs_are_gone_keeps_the_recorded_row(tmp_path: Path) -> None:
    lrr.write_example_logs(tmp_path / "runs")
    argv = ["--report-only", "--work-dir", str(tmp_path / "runs"), "--rss-before-model-mb", "500"]
    argv += ["--out", str(tmp_path / "r.json")]
    first = harness.main(lrr.LongRealRun, argv)
    shutil.rmtree(tmp_path / "runs" / lrr.run_name(lrr.ROWS["adamw"]))  # another session's workspace held it
    second = harness.main(lrr.LongRealRun, argv)
    assert [r["name"] for r in second["rows"]] == list(lrr.ROWS) and second["settings"]["not_run"] == []
    assert second["settings"]["kept_from_results"] == ["adamw"]
    assert second["rows"][1] == first["rows"][1] and second["summary"] == first["summary"]
    assert "earlier report recorded them" in lrr.LongRealRun._instance.describe(second)
    # read on a machine with another baseline, the kept row keeps its own
    third = harness.main(lrr.LongRealRun, [*argv, "--rss-before-model-mb", "600"])  # the last flag wins
    assert [r["metrics"]["rss_before_model_bytes"] for r in third["rows"][:3]] == [600e6, 500e6, 600e6]
