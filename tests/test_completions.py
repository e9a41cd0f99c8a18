"""LogCompletions: sample completions in completions.jsonl, TensorBoard text and the end-of-fit printout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_run  # tests/conftest.py

from logra_lightning.callbacks import LogCompletions
from logra_lightning.cli import run
from logra_lightning.errors import ConfigError


def test_completions_reach_the_jsonl_file_tensorboard_and_the_printout(tmp_path, capsys, tiny_policy_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ["fit", "--config", "arithmetic_tiny_adamw", *tiny_run(tmp_path)]
    cli = run([*args, "--trainer.callbacks+=log_completions", "--trainer.callbacks.every_n_steps=1"])
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, LogCompletions)]  # the snippet's, not a default
    rows = [json.loads(line) for line in (Path(cli.trainer.log_dir) / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * 8 + [1] * 8  # num_rows=8 of each step's 4 x 4 samples
    assert set(rows[0]) == {"step", "prompt", "completion", "answer", "reward"}
    assert rows[0]["prompt"] == rows[3]["prompt"] and rows[0]["prompt"].endswith("=")  # a prompt's group together
    acc = EventAccumulator(cli.trainer.log_dir)
    acc.Reload()
    assert [e.step for e in acc.Tensors("completions/text_summary")] == [0, 1]
    out = capsys.readouterr().out
    assert "sample completions at RL step 1" in out and out.count("  reward ") == 4


@pytest.mark.parametrize("kwargs", [{"every_n_steps": 0}, {"num_rows": -1}, {"print_rows": -1}])
def test_bad_arguments(kwargs):
    with pytest.raises(ConfigError, match=f"LogCompletions.{next(iter(kwargs))}"):
        LogCompletions(**kwargs)
