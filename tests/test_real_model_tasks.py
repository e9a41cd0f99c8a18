"""The real-model table's bookkeeping (benchmarks/real_model_tasks.py): its math, and resuming in a fresh clone.

The table takes hours, so it is built in sittings; its work directory is git-ignored and the results file is
committed. These tests check that a clone with only the results file reads every finished unit back instead of
running it again. The runs themselves are `logra fit` (tested in tests/test_smollm2.py and the CLI tests).
"""

from __future__ import annotations

import doctest
import json
from pathlib import Path

from benchmarks import real_model_tasks as rmt
from benchmarks.reasoning_tasks import RUN_FILE


def _run(task: str, row: str, lr: float, seed: int, ok: bool = True) -> dict:
    sha = rmt.config_sha(task)
    return {"task": task, "row": row, "lr": lr, "seed": seed, "steps": 20, "ok": ok, "config_sha": sha}


def test_docstring_examples_run() -> None:
    result = doctest.testmod(rmt)
    assert result.failed == 0 and result.attempted > 0


def test_a_fresh_clone_reads_the_committed_units_back_instead_of_running_them(tmp_path: Path) -> None:
    results, work = tmp_path / "real_model_tasks.json", tmp_path / "work"
    base = {"gcd": {"task": "gcd", "ok": True, "config_sha": rmt.config_sha("gcd")}, "chain_sum": {"ok": False}}
    sweep = [_run("basic_arithmetic", "adamw", 1e-5, 0)]
    runs = [_run("gcd", "logra", 3e-5, 0), _run("gcd", "lora", 1e-4, 1, ok=False)]
    results.write_text(json.dumps({"base": base, "sweep_runs": sweep, "runs": runs}))

    assert rmt.restore_units(results, work) == 3  # the failed units are left to run again
    assert json.loads((work / "base_gcd" / rmt.BASE_FILE).read_text()) == base["gcd"]
    assert not (work / "base_chain_sum").exists()
    for tag, record in (("sweep_", sweep[0]), ("", runs[0])):
        unit = (record["task"], record["row"], record["lr"], record["seed"], 20, [], work, tag)
        assert rmt._unit(unit, reuse=True, may_run=False) == (record, False)
    failed = ("gcd", "lora", 1e-4, 1, 20, [], work, "")
    assert rmt._unit(failed, reuse=True, may_run=False) == (None, False)


def test_a_unit_already_in_the_work_directory_is_not_overwritten(tmp_path: Path) -> None:
    results, work = tmp_path / "real_model_tasks.json", tmp_path / "work"
    newer = _run("gcd", "adamw", 1e-5, 0) | {"accuracy_after": 0.75}
    path = rmt._run_dir(work, "", "gcd", "adamw", 1e-5, 0) / RUN_FILE
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(newer))
    results.write_text(json.dumps({"runs": [_run("gcd", "adamw", 1e-5, 0)]}))
    assert rmt.restore_units(results, work) == 0
    assert json.loads(path.read_text()) == newer
    assert rmt.restore_units(tmp_path / "missing.json", work) == 0


def test_a_unit_recorded_under_another_config_or_step_count_runs_again(tmp_path: Path) -> None:
    work = tmp_path / "work"
    record = _run("gcd", "logra", 1e-5, 0)
    path = rmt._run_dir(work, "", "gcd", "logra", 1e-5, 0) / RUN_FILE
    path.parent.mkdir(parents=True)
    unit = ("gcd", "logra", 1e-5, 0, 20, [], work, "")
    for stale in (
        record | {"config_sha": "0" * 12},
        record | {"steps": 30},
        {k: v for k, v in record.items() if k != "config_sha"},
    ):
        path.write_text(json.dumps(stale))
        assert rmt._unit(unit, reuse=True, may_run=False) == (None, False)
    path.write_text(json.dumps(record))
    assert rmt._unit(unit, reuse=True, may_run=False) == (record, False)
