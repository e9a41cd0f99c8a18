"""``logra generate``: completions of a model directory or a checkpoint; pass@k with a reward on held-out problems."""

from __future__ import annotations

import json
import textwrap

import pytest
from conftest import tiny_run  # tests/conftest.py

from logra_lightning.cli import run
from logra_lightning.cli.generate import pass_at_k
from logra_lightning.errors import ConfigError


def test_pass_at_k_matches_its_definition():
    from itertools import combinations

    n, c = 5, 2
    draws = list(combinations([1] * c + [0] * (n - c), 3))
    assert pass_at_k(n, c, 3) == pytest.approx(sum(any(d) for d in draws) / len(draws))  # some of k draws correct


def test_completions_of_a_model_directory(tiny_policy_path, capsys):
    assert (
        run(
            [
                "generate",
                "--model",
                tiny_policy_path,
                "--prompt",
                "12+30=",
                "--prompt",
                "5+5=",
                "--n",
                "3",
                "--max_new_tokens",
                "4",
                "--threads",
                "1",
                "--json",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["prompt"] for x in lines] == ["12+30=", "5+5="] and all(len(x["completions"]) == 3 for x in lines)


def test_pass_at_k_of_a_checkpoint(tmp_path, monkeypatch, capsys, tiny_policy_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_reward.py").write_text(
        textwrap.dedent("""
        def exact(completions, answers, level):
            assert level == [1] * len(completions)
            return [float(c.strip() == a) for c, a in zip(completions, answers)]
    """)
    )
    (tmp_path / "test.jsonl").write_text(
        "".join(
            json.dumps({"question": f"{a}+{b}=", "solution": str(a + b), "level": 1}) + "\n"
            for a in range(3)
            for b in (4, 9)
        )
    )
    cli = run(["fit", "--config", "arithmetic_tiny_adamw", *tiny_run(tmp_path)])
    capsys.readouterr()
    args = [
        "generate",
        "--ckpt_path",
        "last",
        "--config",
        "arithmetic_tiny_adamw",
        "--config",
        str(tmp_path / "c.yaml"),
        "--data",
        "test.jsonl",
        "--prompt_key",
        "question",
        "--answer_key",
        "solution",
        "--reward",
        "my_reward.py:exact",
        "--n",
        "4",
        "--max_new_tokens",
        "4",
        "--threads",
        "1",
        "--json",
    ]
    (tmp_path / "c.yaml").write_text(
        json.dumps(
            {
                "trainer": {
                    "logger": {
                        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                        "init_args": {"save_dir": str(tmp_path), "name": "arithmetic_tiny_adamw"},
                    }
                }
            }
        )
    )
    assert cli.trainer.checkpoint_callback.last_model_path  # the fit wrote last.ckpt, which `last` finds
    assert run(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["problems"] == 6 and set(result) >= {"greedy_accuracy", "pass@1", "pass@2", "pass@4"}
    assert 0 <= result["pass@1"] <= result["pass@2"] <= result["pass@4"] <= 1


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--prompt", "x"], "one of the arguments --ckpt_path --model is required"),
        (["--model", "m", "--prompt", "x", "--reward", "r.py:f"], "--reward scores --data problems"),
        (["--ckpt_path", "best", "--prompt", "x"], "also give the fit's --config"),
    ],
)
def test_bad_arguments_are_one_config_error(argv, match):
    with pytest.raises(ConfigError, match=match):
        run(["generate", *argv])
