"""reasoning-gym as prompts and reward: ReasoningGymSource and ReasoningGymReward on real datasets (no network).

Each task of the real-model configs (``configs/smollm2_<task>.yaml``) is loaded from its config file, so the
test checks the settings the table ran with: the held-out and training splits are disjoint, the chat template
is applied, a completion in the documented answer format scores 1 under the dataset's own ``score_answer``
and a wrong or missing answer scores below 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("reasoning_gym")

from logra_lightning.data import PromptDataModule, ReasoningGymSource  # noqa: E402
from logra_lightning.errors import ConfigError  # noqa: E402
from logra_lightning.rewards import ReasoningGymReward  # noqa: E402
from logra_lightning.rewards.reasoning_gym import encode_reference, entry_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(ROOT.glob("configs/smollm2_*.yaml"))


def _config(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _sources(path: Path, n: int = 6) -> tuple[ReasoningGymSource, ReasoningGymSource, ReasoningGymReward]:
    cfg = _config(path)
    data, reward = cfg["data"], cfg["model"]["reward"]
    sizes = {"train_size": 40, "test_size": n}  # both sources split the same draw: they share the sizes
    train_args, test_args = {**data["train"]["init_args"], **sizes}, {**data["val"]["init_args"], **sizes}
    assert {**train_args, "split": "test"} == test_args, "train and val differ in more than the split"
    return (
        ReasoningGymSource(**train_args),
        ReasoningGymSource(**test_args),
        ReasoningGymReward(**reward.get("init_args", {})),
    )


def _written(reward: ReasoningGymReward, answer: str) -> str:
    """A completion that states ``answer`` the way ``reward`` reads answers."""
    if reward.extract == "tag":
        return f"Let me think.\n<{reward.tag}>{answer}</{reward.tag}>"
    return f" {answer}.\nThat is the answer."


def test_there_are_at_least_three_real_model_configs() -> None:
    assert len(CONFIGS) >= 3, [p.name for p in CONFIGS]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_each_task_scores_its_own_reference_and_rejects_a_wrong_one(path: Path) -> None:
    train, test, reward = _sources(path)
    records = test.load()
    assert len(records) == 6 and all(r["prompt"] and r["question"] in r["prompt"] for r in records)
    prompts = [r["prompt"] for r in records]
    answers = [r["answer"] for r in records]
    references = [json.loads(a)["answer"] for a in answers]
    assert reward(prompts, [_written(reward, ref) for ref in references], answers) == [1.0] * 6
    wrong = reward(prompts, [_written(reward, "zz" + ref + "9") for ref in references], answers)
    assert all(w < 1.0 for w in wrong), wrong
    assert reward(prompts, [""] * 6, answers) == [0.0] * 6  # nothing to extract
    held_out = {r["question"] for r in records}
    assert not held_out & {r["question"] for r in train.load()}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_the_chat_template_is_applied_through_the_data_module(path: Path, tiny_policy_path: str) -> None:
    from logra_lightning.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_policy_path)
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    train, test, _ = _sources(path, n=2)
    dm = PromptDataModule(train, test, batch_size=2)
    dm.setup("fit")
    question = dm.val_records[0]["question"]
    assert dm.use_tokenizer(tokenizer)
    rendered = dm.val_records[0]["prompt"]
    assert rendered.startswith("<|user|>") and question in rendered
    prefix = _config(path)["data"]["val"]["init_args"].get("assistant_prefix", "")
    assert rendered.endswith("<|assistant|>" + prefix)


def test_an_unknown_dataset_fails_at_start_up_naming_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"ReasoningGymSource.dataset='leg_count'.*'leg_counting'"):
        ReasoningGymSource("leg_count")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"config": {"max_legs": 3}}, r"unknown config keys \['max_legs'\].*max_animals"),
        ({"config": {"min_animals": 5, "max_animals": 2}}, "rejected by reasoning-gym"),
        ({"split": "dev"}, "split='dev'"),
        ({"test_size": 0}, "test_size=0"),
        ({"template": "no placeholder"}, "placeholder"),
    ],
)
def test_bad_source_arguments_are_refused_at_start_up(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ReasoningGymSource("leg_counting", **kwargs)


def test_a_config_that_fails_only_when_drawing_is_refused_at_start_up() -> None:
    with pytest.raises(ConfigError, match="operators_weights|weights"):
        ReasoningGymSource("simple_equations", config={"operators": ["+", "-"]})


def test_too_small_a_problem_space_for_train_size_names_the_fix() -> None:
    # 5 x 5 pairs of numbers in 1..5: 25 distinct problems at most
    space = {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 5}
    source = ReasoningGymSource("gcd", config=space, train_size=40, test_size=8)
    with pytest.raises(ConfigError, match=r"only 25 distinct problems .* lower train_size"):
        source.load()


def test_reward_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="ReasoningGymReward.extract='last'"):
        ReasoningGymReward(extract="last")
    with pytest.raises(ConfigError, match="ReasoningGymReward.tag="):
        ReasoningGymReward(tag=" ")


def test_a_reference_is_rebuilt_exactly_and_a_mismatch_is_an_error() -> None:
    ref = encode_reference("chain_sum", {"max_terms": 2}, seed=7, size=9, index=4)
    _, entry = entry_of(ref)
    assert entry_of(encode_reference("chain_sum", {"max_terms": 2}, 7, 9, 4, entry["answer"]))[1] == entry
    with pytest.raises(ValueError, match="differs"):
        entry_of(encode_reference("chain_sum", {"max_terms": 2}, 7, 9, 4, entry["answer"] + "0"))
    with pytest.raises(ValueError, match="not a reasoning-gym reference"):
        entry_of("42")


def test_partial_credit_is_the_datasets_own() -> None:
    """``chain_sum`` gives len(reference)/len(answer) to an answer that contains the reference; accuracy needs 1.0."""
    ref = encode_reference("chain_sum", {"max_terms": 2, "max_digits": 1}, seed=1, size=4, index=0)
    answer = entry_of(ref)[1]["answer"]
    got = ReasoningGymReward(extract="completion")(["q"], [f"{answer} apples"], [ref])[0]
    assert got == pytest.approx(len(answer) / len(f"{answer} apples"))
