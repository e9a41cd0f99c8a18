"""The real-model table's bookkeeping (benchmarks/real_model_tasks.py on benchmarks/rl_table.py): its math, and
resuming in a fresh clone.

The table takes hours, so it is built in sittings; its work directory is git-ignored and the results file is
committed. These tests check that a clone with only the results file reads every finished unit back instead of
running it again. The runs themselves are `logra fit` (tested in tests/test_smollm2.py and the CLI tests).
"""

from __future__ import annotations

import doctest
import json
from pathlib import Path

from benchmarks import harness
from benchmarks import real_model_tasks as rmt
from benchmarks.rl_table import RUN_FILE, Unit, config_sha, finished, restore_units


def _run(task: str, row: str, lr: float, seed: int, ok: bool = True) -> dict:
    sha = config_sha(rmt.config_path(task))
    return {"task": task, "row": row, "lr": lr, "seed": seed, "steps": 20, "ok": ok, "config_sha": sha}


def _row(name: str, record: dict) -> dict:
    return {"name": name, "ok": record.pop("ok", True), "error": None, "metrics": record}


def _unit_file(work: Path, record: dict, tag: str = "") -> Path:
    return Unit(record["task"], record["row"], record["lr"], record["seed"], 20, (), tag).log_dir(work) / RUN_FILE


def test_docstring_examples_run() -> None:
    result = doctest.testmod(rmt)
    assert result.failed == 0 and result.attempted > 0


def test_a_fresh_clone_reads_the_committed_units_back_instead_of_running_them(tmp_path: Path) -> None:
    results, work = tmp_path / "real_model_tasks.json", tmp_path / "work"
    base = {"task": "gcd", "config_sha": config_sha(rmt.config_path("gcd"))}
    sweep, done, failed = (
        _run("basic_arithmetic", "adamw", 1e-5, 0),
        _run("gcd", "logra", 3e-5, 0),
        _run("gcd", "lora", 1e-4, 1, ok=False),
    )
    rows = [_row("base/gcd", dict(base)), _row("base/chain_sum", {"task": "chain_sum", "ok": False})]
    rows += [_row("sweep/x", dict(sweep)), _row("gcd/logra/seed0", dict(done)), _row("gcd/lora/seed1", dict(failed))]
    results.write_text(json.dumps({"rows": rows}))

    assert restore_units(results, work) == 3  # the failed units are left to run again
    assert json.loads((work / "base_gcd" / rmt.BASE_FILE).read_text()) == base
    assert not (work / "base_chain_sum").exists()
    for tag, record in (("sweep_", sweep), ("", done)):
        record = {k: v for k, v in record.items() if k != "ok"}
        assert finished(_unit_file(work, record, tag), rmt.config_path(record["task"]), 20) == record
    assert finished(_unit_file(work, failed), rmt.config_path("gcd"), 20) is None


def test_a_unit_already_in_the_work_directory_is_not_overwritten(tmp_path: Path) -> None:
    results, work = tmp_path / "real_model_tasks.json", tmp_path / "work"
    newer = _run("gcd", "adamw", 1e-5, 0) | {"accuracy_after": 0.75}
    path = _unit_file(work, newer)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(newer))
    results.write_text(json.dumps({"rows": [_row("gcd/adamw/seed0", _run("gcd", "adamw", 1e-5, 0))]}))
    assert restore_units(results, work) == 0
    assert json.loads(path.read_text()) == newer
    assert restore_units(tmp_path / "missing.json", work) == 0


def test_a_unit_recorded_under_another_config_or_step_count_runs_again(tmp_path: Path) -> None:
    record = _run("gcd", "logra", 1e-5, 0)
    path = _unit_file(tmp_path / "work", record)
    path.parent.mkdir(parents=True)
    config = rmt.config_path("gcd")
    for stale in (
        record | {"config_sha": "0" * 12},
        record | {"steps": 30},
        {k: v for k, v in record.items() if k != "config_sha"},
    ):
        path.write_text(json.dumps(stale))
        assert finished(path, config, 20) is None
    path.write_text(json.dumps(record))
    assert finished(path, config, 20) == record


def _finished(task: str, row: str, seed: int, before: float, after: float, mb: float, top_share: float) -> dict:
    memory = {"train_memory_bytes": mb * 1e6, "peak_rss_bytes": mb * 1e6, "state_bytes": mb * 1e5}
    memory |= {"optimizer_state_bytes": 0, "grad_bytes": 0}
    answers = {"after": {"top_answer": "1", "top_answer_share": top_share}}
    return _run(task, row, 3e-5, seed) | {
        "accuracy_before": before,
        "accuracy_after": after,
        "memory": memory,
        "step_seconds_median": 1.0,
        "answers": answers,
    }


def test_the_targets_leave_out_a_task_where_a_row_learned_one_answer_and_pair_logra_with_adamw() -> None:
    runs = [
        _finished("chain_sum", "adamw", 0, 0.10, 0.30, 3000, 0.2),
        _finished("chain_sum", "logra", 0, 0.10, 0.32, 1200, 0.2),
        _finished("gcd", "adamw", 0, 0.25, 0.53, 3000, 1.0),  # answers `1` everywhere: gcd leaves the targets
        _finished("gcd", "logra", 0, 0.25, 0.40, 1200, 0.6),
        _finished("basic_arithmetic", "adamw", 0, 0.20, 0.26, 3000, 0.1),  # no LoGRA run here yet
    ]
    summary = rmt.table_summary(runs, ["adamw", "logra"], ["basic_arithmetic", "chain_sum", "gcd"])
    assert summary["collapsed_tasks"] == ["gcd"]
    assert summary["rows"]["adamw"]["runs"] == 3 and summary["rows_excluding_collapsed"]["adamw"]["runs"] == 2
    t = summary["targets"]
    assert t["adamw_gain_points"]["tasks"] == ["basic_arithmetic", "chain_sum"]
    assert abs(t["adamw_gain_points"]["value"] - 13.0) < 1e-9  # (20 + 6) / 2
    assert t["logra_vs_adamw_points"]["tasks"] == ["chain_sum"]  # only where both rows ran
    assert abs(t["logra_vs_adamw_points"]["value"] - 2.0) < 1e-9
    assert abs(t["logra_memory_ratio"]["value"] - 0.4) < 1e-9 and t["logra_memory_ratio"]["met"]


def test_the_config_optimizer_and_micro_batching_are_not_part_of_a_units_identity(tmp_path: Path) -> None:
    text = rmt.config_path("chain_sum").read_text()
    copy = tmp_path / "smollm2_chain_sum.yaml"
    copy.write_text(text)
    sha = config_sha(copy)
    for old, new, same in (
        ("lr: 3.0e-5, rank: 16", "lr: 1.0e-3, rank: 4", True),  # every RL unit passes its row's optimizer
        ("micro_batch_size: 32", "micro_batch_size: 2", True),  # equal losses and gradients
        ("max_new_tokens: 8", "max_new_tokens: 16", False),
    ):
        assert old in text
        copy.write_text(text.replace(old, new))
        assert (config_sha(copy) == sha) is same, (old, new)


def test_the_second_seed_runs_on_the_later_seed_tasks_only(tmp_path: Path) -> None:
    args = ["--max-runs", "0", "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "r.json")]

    def missing_table_units(res: dict, seed: int) -> list[str]:
        return [m.split("/")[0] for m in res["summary"]["missing"] if m.endswith(f"/seed{seed}")]

    res = harness.main(rmt.RealModelTasks, args)
    assert set(missing_table_units(res, 0)) == set(rmt.TASKS)
    assert set(missing_table_units(res, 1)) == set(rmt.FULL["later_seed_tasks"])
    assert res["settings"]["later_seed_tasks"] == rmt.FULL["later_seed_tasks"]
    every = harness.main(rmt.RealModelTasks, [*args, "--later-seed-tasks"])
    assert len(missing_table_units(every, 1)) == len(rmt.TASKS) * 3  # every task x row


def test_the_headline_names_lora_only_when_it_ran_on_the_same_tasks() -> None:
    def row(acc: float, mb: float, tasks: list[str]) -> dict:
        return {"acc_before": 20.0, "acc_after": acc, "training_memory_mb": mb, "tasks": tasks}

    both = ["basic_arithmetic", "chain_sum"]
    got = {"tasks": both, "complete": False, "collapsed_tasks": []}
    rows = {"adamw": row(30.0, 3000, both), "logra": row(31.0, 1200, both), "lora": row(33.0, 1800, both[:1])}

    def headline(got: dict) -> list[str]:
        return rmt.RealModelTasks._instance.headline({"real_model_tasks": {"summary": got, "settings": {"steps": 20}}})

    line = headline({**got, "rows": rows})[0]
    assert "AdamW 30.0%, LoGRA 31.0%;" in line and "LoRA" not in line and "60.0% lower" in line
    rows["lora"] = row(33.0, 1800, both)
    assert "LoRA r16 33.0% (1800 MB)" in headline({**got, "rows": rows})[0]
