"""The benchmarks' ``--quick`` modes run and write result files with the expected fields (not values).

Every script's ``--quick`` mode runs here, in ``make test`` and so in CI (about 3 min together),
into a temporary directory, and its result goes through the plot and README generators. Peers
that are not installed (``galore-torch``, ``apollo-torch``, ``bitsandbytes``, ``trl``: the
``bench`` extra) must show up as failed rows with an error, never as missing rows.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks import (
    kl_control,
    make_readme,
    optimizer_memory,
    plan_vs_measured,
    plots,
    quality,
    reasoning_tasks,
    trl_grpo,
)

ROOT = Path(__file__).resolve().parents[1]


MEMORY_ROW_FIELDS = {
    "train_peak_bytes",
    "steady_peak_bytes",
    "optimizer_state_bytes",
    "grad_bytes_after_backward",
    "step_time_s_median",
    "step_cpu_s_median",
    "rss_before_model_bytes",
    "load_before",
    "load_after",
}
LOAD = {"1m", "5m", "15m"}


def _check_rows_recorded(rows: list[dict], key: str, wanted: list[str]) -> None:
    assert [r[key] for r in rows] == wanted, "every planned row is recorded, failed ones included"
    for r in rows:
        assert isinstance(r["ok"], bool)
        if not r["ok"]:
            assert r["error"], f"failed row {r[key]} must say why"


def _check_header_loads(res: dict) -> None:
    assert set(res["load_start"]) == LOAD and set(res["load_end"]) == LOAD
    assert res["command"].startswith("python -m benchmarks.") and res["wall_seconds"] > 0


def _check_header(res: dict) -> None:
    _check_header_loads(res)
    assert res["machine"]["cores"] >= 1 and "torch" in res["machine"]["versions"]


def test_optimizer_memory_quick_fields_plots_and_readme(tmp_path: Path) -> None:
    rows = optimizer_memory.ROWS  # every row: the peers not installed must be failed rows, not missing ones
    res = optimizer_memory.main(["--quick", "--out", str(tmp_path / "optimizer_memory_quick.json")])
    assert json.loads((tmp_path / "optimizer_memory_quick.json").read_text()) == res
    _check_header(res)
    assert set(res["sizes"]) == {"quick"} and res["shapes"]["quick"]["model_type"] == "qwen2"
    got = res["sizes"]["quick"]
    _check_rows_recorded(got, "name", rows)
    for r in got:
        if r["name"] not in ("adamw", "logra"):  # these two need nothing outside the project
            continue
        assert r["ok"], r.get("error")
        assert MEMORY_ROW_FIELDS <= set(r)
        assert {
            "state_ratio_vs_adamw",
            "train_memory_reduction_vs_adamw",
            "step_time_ratio_vs_adamw",
            "step_cpu_ratio_vs_adamw",
        } <= set(r)

    written = plots.main(["--quick", "--results", str(tmp_path)])
    assert [p.name for p in written] == ["optimizer_memory_quick.png"] and written[0].stat().st_size > 1000
    readme = make_readme.main(["--quick", "--results", str(tmp_path), "--out", str(tmp_path / "README.md")])
    text = readme.read_text()
    assert "## Optimizer memory and speed" in text and "| adamw |" in text
    assert "_Not measured yet._ Run `.venv/bin/python -m benchmarks.quality --quick`" in text


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
    ]
    got = kl_control.accuracy_summary(runs)
    assert got["default_lr"] == {"mean": pytest.approx(0.95), "min": 0.9, "max": 1.0, "n": 2}
    assert got["high_lr_kl_control"]["n"] == 2 and "demo_overhead" not in got
    assert got["controlled_no_worse_than_default"] is False  # 0.94 < 0.95
    diff = got["controlled_vs_default"]
    assert diff["mean_difference_points"] == pytest.approx(-1.0)
    assert diff["paired_difference_points"] == pytest.approx([2.0, -4.0])
    assert diff["paired_standard_error_points"] == pytest.approx(3.0)  # stdev 4.243 / sqrt 2
    assert kl_control.accuracy_summary(runs[:2])["controlled_no_worse_than_default"] is None


def test_allocator_slack_is_fitted_on_one_size_and_scores_the_others() -> None:
    pvm = plan_vs_measured
    run, rows = pvm.RUN["quick"], []
    for size, ratio in (("1m", 1.2), ("5m", 1.3)):  # measured = ratio x the planner's live-bytes peak
        pred = pvm.predict(pvm.QUICK[size], run, "adamw", True)
        rows.append(
            {
                "size": size,
                "optimizer": "adamw",
                "activation_checkpointing": True,
                "shape": pvm.QUICK[size],
                "predicted": pred,
                "measured": {"default": {"train_peak_bytes": ratio * pred["peak_bytes"]}},
                "error": {"default": {}},
            }
        )
    assert pvm.fit_allocator_slack(rows, "1m", run) == pytest.approx(0.2)
    assert rows[0]["error"]["default"]["peak_with_fitted_slack"] == pytest.approx(0.0, abs=1e-6)
    assert rows[1]["error"]["default"]["peak_with_fitted_slack"] == pytest.approx(1.2 / 1.3 - 1, abs=1e-6)
    assert pvm.fit_allocator_slack(rows, "13m", run) is None


def test_plan_vs_measured_quick_fields_and_readme(tmp_path: Path) -> None:
    res = plan_vs_measured.main(["--quick", "--out", str(tmp_path / "plan_vs_measured_quick.json")])
    assert json.loads((tmp_path / "plan_vs_measured_quick.json").read_text()) == res
    assert res["command"].startswith("python -m benchmarks.") and set(res["load_start"]) == LOAD
    assert res["summary"]["failed_rows"] == 0, [r.get("failed") for r in res["rows"]]
    for row in res["rows"]:
        assert {"params", "grads", "optimizer_state", "params_grads_state", "peak"} <= set(row["error"]["live"])
        assert {"param_bytes", "optimizer_state_bytes", "train_peak_bytes"} <= set(row["measured"]["live"])
    text = make_readme.main(["--quick", "--results", str(tmp_path), "--out", str(tmp_path / "README.md")]).read_text()
    section = text.split("## Memory planner vs measurement")[1].split("\n## ")[0]
    assert section.count("\n| ") == len(res["rows"]) + 1, "one table row per size x optimizer x checkpointing"
    assert "params+grads+state within 2%" in section and "peak within 20% under `live`" in section


def test_quality_quick(tmp_path: Path) -> None:
    res = quality.main(
        ["--quick", "--jobs", "2", "--out", str(tmp_path / "q.json"), "--work-dir", str(tmp_path / "runs")]
    )
    _check_header(res)
    assert res["settings"]["seeds"] == [0] and res["settings"]["steps"] == quality.QUICK["steps"]
    assert res["settings"]["jobs"] == 2
    rows = ["adamw", "logra_r8", "logra_r16", "galore_r16", "lora_r8"]
    _check_rows_recorded(res["runs"], "row", rows)
    for run in res["runs"][:3] + res["runs"][4:]:
        assert run["ok"], run.get("error")
        assert {"accuracy_before", "accuracy_after", "curve", "step_seconds_median", "load_before"} <= set(run)
        assert run["curve"][0][0] == 0 and len(run["curve"]) >= 2
        assert run["peak_rss_bytes"] > run["train_tensor_bytes"] > run["optimizer_state_bytes"] > 0
    lora, adamw = res["runs"][4], res["runs"][0]
    assert lora["optimizer_state_bytes"] < 0.2 * adamw["optimizer_state_bytes"]  # AdamW on the factors only
    assert {"accuracy_after", "curve", "ok_runs"} <= set(res["summary"]["logra_r8"])
    assert "accuracy_after_vs_adamw_points" in res["summary"]["logra_r8"]


def test_kl_control_quick(tmp_path: Path) -> None:
    res = kl_control.main(["--quick", "--out", str(tmp_path / "kl.json"), "--work-dir", str(tmp_path / "runs")])
    _check_header(res)
    assert {
        "default_lr",
        "high_lr",
        "target_kl",
        "min_scale",
        "sample_tokens",
        "measure_every",
        "overhead_steps",
    } <= set(res["settings"])
    assert "overhead_share_max" in res["targets"]
    _check_rows_recorded(res["runs"], "row", ["default_lr", "high_lr", "high_lr_kl_control", "demo_overhead"])
    for run in res["runs"][:3]:
        assert run["ok"], run.get("error")
        assert {"kl/realized", "kl/predicted", "kl/step_scale", "val/accuracy"} <= set(run["curves"])
        assert {"measured_steps", "realized_within_1.5T_share", "median_abs_log_realized_over_raw_predicted"} <= set(
            run["kl"]
        )
    demo = res["runs"][3]
    if importlib.util.find_spec("vllm") is None:  # the demo config runs a vLLM engine
        return
    assert demo["ok"], demo.get("error")
    assert demo["overhead"]["steps_used"] == kl_control.QUICK["steps"]
    assert {"overhead_share", "step_seconds_median", "control_seconds_median"} <= set(demo["overhead"])


def test_trl_grpo_quick(tmp_path: Path) -> None:
    res = trl_grpo.main(["--quick", "--out", str(tmp_path / "trl.json")])
    _check_header(res)
    _check_rows_recorded(res["rows"], "row", list(trl_grpo.ROWS))
    for r in res["rows"]:
        if r["ok"]:
            assert {"peak_bytes", "step_seconds_median", "accuracy_before", "accuracy_after", "steps"} <= set(r)
            assert r["steps"] == trl_grpo.QUICK_STEPS
    assert all(r["ok"] for r in res["rows"] if r["row"].startswith("logra_")), "the logra rows need no peer"


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


@pytest.mark.vllm
def test_sync_cost_quick_fields(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from benchmarks import sync_cost

    res = sync_cost.main(["--quick", "--out", str(tmp_path / "sync_cost_quick.json")])
    _check_header_loads(res)
    row = res["sizes"][res["headline_size"]]
    assert row["ok"], row.get("error")
    assert {"bytes", "seconds_median"} <= set(row["lowrank_sync"]) and {"bytes", "seconds_median"} <= set(
        row["full_sync"]
    )
    assert isinstance(row["bytes_ratio"], float) and {"mean", "max"} <= set(row["logprob_gap_after_lowrank_syncs"])
    coef = row["coefficient_bytes_ratio"]  # the engine keeps the bases: most syncs carry coefficients only
    assert coef["bfloat16"] < coef["float32"] < row["bytes_ratio"]
    assert set(row["wire_formats"]) == {"float32", "bfloat16", "bfloat16_unmatched"}
    assert all(f["with_bases"]["syncs"] >= 1 and f["coefficients"]["syncs"] >= 1 for f in row["wire_formats"].values())
    assert row["wire_formats"]["float32"]["drift_max"] <= 1e-4 and row["wire_formats"]["bfloat16"]["drift_max"] <= 1e-4
    adamw, logra = row["sparse_delta_adamw_bf16"], row["sparse_delta_logra_bf16"]
    for sparse in (adamw, logra):  # lossless: the receiver holds bf16(trainer) bit for bit
        assert sparse["drift_max"] == 0.0 and sparse["syncs"] == res["run"]["steps"]["tiny"]
        assert sparse["bytes_per_step"] == pytest.approx(6 * sparse["changed_fraction_median"] * row["params"], rel=0.2)
    assert row["coefficient_vs_sparse_adamw"]["ratio"] == pytest.approx(
        row["coefficient_sync"]["bfloat16"]["bytes"] / adamw["bytes_per_step"]
    )
    assert [p["lr"] for p in row["sparse_delta_lr_sweep"]] == list(res["run"]["sweep_lrs"])
    lines, _ = sync_cost.section(res)
    assert any("coefficients bf16" in line for line in lines)
    assert any("sparse delta, AdamW" in line for line in lines)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.close(sync_cost.plot(res, plt))
    assert plots.main(["--quick", "--results", str(tmp_path)])[0].name == "sync_cost_quick.png"
    text = make_readme.main(["--quick", "--results", str(tmp_path), "--out", str(tmp_path / "README.md")]).read_text()
    assert "a step's sync sends" in text and "coefficients fp32 (× full)" in text


def test_reasoning_tasks_quick_records_accuracy_memory_and_reductions(tmp_path: Path) -> None:
    res = reasoning_tasks.main(
        ["--quick", "--out", str(tmp_path / "reasoning_tasks_quick.json"), "--work-dir", str(tmp_path / "runs")]
    )
    _check_header(res)
    rows = [r for r in reasoning_tasks.ROWS if r not in res["settings"]["pending"]]
    assert {"adamw", "logra"} <= set(rows) and set(res["settings"]["pending"]) <= {"lora"}
    assert [(r["row"], r["lr"]) for r in res["sweep_runs"]] == [
        (row, lr) for row in rows for lr in reasoning_tasks.SWEEP_LRS[row][:1]
    ]
    assert all(res["sweep"][row]["lr"] in reasoning_tasks.SWEEP_LRS[row] for row in rows)
    assert [(r["task"], r["row"]) for r in res["runs"]] == [(t, row) for t in reasoning_tasks.TASKS for row in rows]
    for run in res["runs"]:
        assert run["ok"], run.get("error")
        mem = run["memory"]
        assert mem["peak_rss_bytes"] > mem["rss_before_model_bytes"] > 0 and mem["train_memory_bytes"] > 0
        assert mem["state_bytes"] >= mem["param_bytes"] > 0 and 0.0 <= run["accuracy_after"] <= 1.0
    logra = res["summary"]["average"]["logra"]
    assert {
        "train_memory_bytes_reduction_vs_adamw",
        "peak_rss_bytes_reduction_vs_adamw",
        "state_bytes_reduction_vs_adamw",
        "accuracy_after_vs_adamw_points",
    } <= set(logra)
    adamw_state = res["summary"]["per_task"]["sorting"]["adamw"]["optimizer_state_bytes"]["mean"]
    assert res["summary"]["per_task"]["sorting"]["logra"]["optimizer_state_bytes"]["mean"] < adamw_state
    written = plots.main(["--quick", "--results", str(tmp_path)])
    assert [p.name for p in written] == ["reasoning_tasks_quick.png"]
    text = make_readme.main(["--quick", "--results", str(tmp_path), "--out", str(tmp_path / "README.md")]).read_text()
    assert "## Reasoning tasks: the paper's table" in text and "| **average** | logra |" in text


def test_reasoning_lr_pick_uses_training_reward_and_reductions_pair_by_seed() -> None:
    sweep = [
        {"row": "adamw", "lr": lr, "ok": True, "late_reward": r} for lr, r in ((1e-4, 0.2), (3e-4, 0.5), (1e-3, 0.4))
    ]
    sweep.append({"row": "logra", "lr": 1e-3, "ok": False, "late_reward": None})
    picked = reasoning_tasks.pick_lrs(sweep)
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
    got = reasoning_tasks.summarize(runs, ["adamw", "logra"])
    red = got["per_task"]["a"]["logra"]["train_memory_bytes_reduction_vs_adamw"]
    assert red["mean"] == pytest.approx(0.45) and red["min"] == pytest.approx(0.4)  # seeds: 1-60/100, 1-100/200
    avg = got["average"]["logra"]
    assert avg["train_memory_bytes_reduction_vs_adamw"]["mean"] == pytest.approx((0.3 + 0.35) / 2)  # tasks per seed
    assert avg["accuracy_after_vs_adamw_points"]["mean"] == pytest.approx(((10 + 0) / 2 + (0 + 20) / 2) / 2)
    assert "train_memory_bytes_reduction_vs_adamw" not in got["average"]["adamw"]
    assert avg["state_bytes_reduction_vs_adamw"]["mean"] == pytest.approx((0.3 + 0.35) / 2)
