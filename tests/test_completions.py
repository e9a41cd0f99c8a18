"""LogCompletions: sample completions in completions.jsonl, TensorBoard text and the end-of-fit printout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_run  # tests/conftest.py

from logra_lightning.callbacks import LogCompletions
from logra_lightning.cli import run
from logra_lightning.errors import ConfigError
from logra_lightning.rewards.reasoning_gym import encode_reference


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


def test_the_printout_shows_the_question_and_a_reasoning_gym_records_reference_answer(capsys):
    cb = LogCompletions(print_rows=1)
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM.<|im_end|>\n"
    prompt = system + "<|im_start|>user\nState the final answer: 1 + 6 =<|im_end|>\n<|im_start|>assistant\n"
    answer = encode_reference("chain_sum", {"max_terms": 2}, seed=0, size=5, index=3, answer="7")
    cb.last_rows = [{"step": 3, "prompt": prompt, "completion": " 7.", "answer": answer, "reward": 1.0}]
    cb.on_fit_end(None, None)
    line = capsys.readouterr().out.splitlines()[-1]
    assert "answer '7'" in line and "1 + 6 =" in line and "SmolLM" not in line


@pytest.mark.parametrize("kwargs", [{"every_n_steps": 0}, {"num_rows": -1}, {"print_rows": -1}])
def test_bad_arguments(kwargs):
    with pytest.raises(ConfigError, match=f"LogCompletions.{next(iter(kwargs))}"):
        LogCompletions(**kwargs)
