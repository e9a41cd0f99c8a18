"""Rewards a user writes: by file or dotted path, called with the record fields they name, several with weights."""

from __future__ import annotations

import json
import pickle
import re
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import tiny_run  # tests/conftest.py

from logra_lightning.cli import run
from logra_lightning.errors import ConfigError
from logra_lightning.rewards import ExactMatchReward, WeightedRewards, as_reward, call_reward
from logra_lightning.rl.faults import FaultPolicy

ROOT = Path(__file__).resolve().parents[1]
REWARD_FILE = """
def correct(completions, answers, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answers)]


def long_ones_fail(completions, level=0):
    # None for one kind of sample and an exception for another: both are faults of that sample only
    return [None if len(c) > 3 else 0.5 for c in completions]


def needs_difficulty(completions, difficulty):
    return [float(d) for d in difficulty]


NOT_CALLABLE = 3


class NeedsArgs:
    def __init__(self, scale):
        self.scale = scale

    def __call__(self, completions):
        return [self.scale] * len(completions)
"""


@pytest.fixture
def reward_dir(tmp_path, monkeypatch):
    """A working directory holding my_reward.py, on sys.path as `logra` puts it."""
    (tmp_path / "my_reward.py").write_text(textwrap.dedent(REWARD_FILE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_reward", None)


def test_fields_reach_the_parameters_that_name_them():
    fields = {"difficulty": [1, 2], "level": ["a", "b"]}
    got = call_reward(lambda completions, difficulty: difficulty, ["p"] * 2, ["x", "y"], ["x", "x"], fields)
    assert got == [1, 2]
    trl = call_reward(lambda prompts, completions, **kw: sorted(kw), ["p"] * 2, ["x", "y"], ["x", "x"], fields)
    assert trl == ["answers", "difficulty", "level"]  # every field the function did not name, as TRL passes them
    assert call_reward(ExactMatchReward(), ["p"] * 2, ["x", "y"], ["x", "x"], fields) == [1.0, 0.0]
    assert call_reward(lambda p, c, a: c, ["p"], ["x"], ["x"], fields) == ["x"]  # the positional convention


def test_file_and_dotted_rewards_load_and_pickle(reward_dir):
    by_file = as_reward("my_reward.py:correct")
    by_name = as_reward("my_reward.correct")
    assert by_file(["q"], ["4 "], ["4"]) == [1.0] and by_name(["q"], ["4 "], ["4"]) == [1.0]
    assert pickle.loads(pickle.dumps(by_file))(["q"], ["5"], ["4"]) == [0.0]  # a spawned process loads it again


@pytest.mark.parametrize(
    "spec, match",
    [
        ("nowhere.py:correct", r"model.reward=nowhere.py:correct: reward file nowhere.py not found \(relative paths"),
        ("my_reward.py:corect", r"my_reward.py has no 'corect' \(it defines: .*correct"),
        ("my_reward.py:NOT_CALLABLE", r"int 'NOT_CALLABLE' is not callable"),
        ("my_reward.py:NeedsArgs", r"the class NeedsArgs needs arguments .*class_path"),
        ("no_such_module.score", r"cannot import 'no_such_module'"),
        ("my_reward.nope", r"module my_reward has no 'nope'"),
    ],
)
def test_a_reward_that_does_not_load_names_what_is_wrong(spec, match, reward_dir):
    with pytest.raises(ConfigError, match=match):
        as_reward(spec)


def test_a_signature_that_cannot_take_the_fields_is_a_config_error_not_a_sample_fault(reward_dir):
    faults = FaultPolicy(max_consecutive_skips=None, max_new_tokens=4)
    with pytest.raises(
        ConfigError,
        match=r"reward needs_difficulty: parameter 'difficulty' is not a field of the "
        r"records \(fields: prompts, completions, answers, level\)",
    ):
        faults.score(as_reward("my_reward.py:needs_difficulty"), ["p"], ["c"], ["a"], step=0, fields={"level": [1]})
    with pytest.raises(ConfigError, match="takes no completions"):
        as_reward(lambda prompts: [1.0])


def test_weighted_parts_are_scored_and_fail_one_by_one(reward_dir):
    both = WeightedRewards(["my_reward.py:correct", "my_reward.py:long_ones_fail"], weights=[1.0, 2.0])
    faults = FaultPolicy(max_consecutive_skips=None, max_new_tokens=4)
    with pytest.warns(UserWarning, match="reward long_ones_fail: no finite reward"):
        total = faults.score(both, ["p"] * 3, ["4", "4444", "5"], ["4"] * 3, step=0, fields={"level": [1, 1, 2]})
    assert total.tolist() == [2.0, 0.0, 1.0]  # 1*correct + 2*0.5; the None costs that part of that sample only
    assert faults.last_parts == {"correct": [1.0, 0.0, 0.0], "long_ones_fail": [0.5, 0.0, 0.5]}
    assert faults.reward_errors == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rewards": []}, "empty"),
        ({"rewards": [ExactMatchReward()], "weights": [1.0, 2.0]}, "2 values for 1 rewards"),
        ({"rewards": [ExactMatchReward(), ExactMatchReward()]}, r"\['ExactMatchReward'\] are used twice"),
        ({"rewards": [ExactMatchReward()], "names": ["mean"]}, "reward/mean is logged by the module itself"),
    ],
)
def test_weighted_rewards_reject_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        WeightedRewards(**kwargs)


def test_fit_with_rewards_from_a_file_in_the_working_directory(reward_dir, tiny_policy_path):
    """`logra fit` with a reward file beside the config: two parts with weights, each logged as reward/<name>."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (reward_dir / "rl.yaml").write_text(
        json.dumps(
            {
                "model": {
                    "reward": {
                        "class_path": "logra_lightning.rewards.WeightedRewards",
                        "init_args": {
                            "rewards": ["my_reward.py:correct", "my_reward.long_ones_fail"],
                            "weights": [1, 0.1],
                        },
                    }
                }
            }
        )
    )
    cli = run(["fit", "--config", "arithmetic_tiny_adamw", "--config", "rl.yaml", *tiny_run(reward_dir)])
    assert cli.trainer.global_step == 2
    acc = EventAccumulator(cli.trainer.log_dir)
    acc.Reload()
    assert {"reward/correct", "reward/long_ones_fail", "reward/errors"} <= set(acc.Tags()["scalars"])
    saved = (Path(cli.trainer.log_dir) / "config.yaml").read_text()
    assert re.search(r"my_reward.py:correct", saved)  # the resolved config names the file again
