"""The reasoning tasks, their rewards, the BPE tokenizer, and a short RL run of one task's config.

The RL runs use a tiny random-init policy built here with the same tokenizer as
``builtin:reasoning-20m`` (never the 20M policy: CI starts with an empty cache and 2 cores).
"""

from __future__ import annotations

import builtins
import json
import random
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logra_lightning.builtin import reasoning as reasoning_policy
from logra_lightning.data import (
    ChainArithmeticSource,
    CountdownSource,
    SortingSource,
    chain_arithmetic,
    countdown,
    sorting,
)
from logra_lightning.errors import ConfigError
from logra_lightning.rewards import AnswerMatchReward, CountdownReward
from logra_lightning.rewards.countdown import ExpressionError, countdown_score, evaluate, parse_problem

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"arithmetic": ChainArithmeticSource, "countdown": CountdownSource, "sorting": SortingSource}
REWARDS = {"arithmetic": AnswerMatchReward(), "countdown": CountdownReward(), "sorting": AnswerMatchReward()}
SMALL = {"test_size": 64, "train_size": 400}


def _score(task: str, records: list[dict], completions: list[str]) -> list[float]:
    return REWARDS[task]([r["prompt"] for r in records], completions, [r["answer"] for r in records])


# ------------------------------------------------------------------ tasks
@pytest.mark.parametrize("task", sorted(SOURCES))
def test_splits_are_disjoint_deterministic_and_solved_by_their_reference(task: str) -> None:
    source = SOURCES[task]
    train, test = source("train", **SMALL).load(), source("test", **SMALL).load()
    assert len(train) == 400 and len(test) == 64 and train == source("train", **SMALL).load()
    key = (
        (lambda r: r["prompt"])
        if task != "countdown"
        # countdown: the target and the numbers in any order
        else (lambda r: (parse_problem(r["answer"])[0], tuple(sorted(parse_problem(r["answer"])[1]))))
    )
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert source("test", **{**SMALL, "seed": 1}).load() != test
    assert _score(task, test, [" " + r["solution"] for r in test]) == [1.0] * len(test)
    assert _score(task, test, [" " + r["solution"] + "." for r in test]) == [0.0] * len(test)  # the sloppy habit
    prone = sum(r["slip_prone"] for r in test) / len(test)
    assert 0.2 < prone < 0.65, prone  # a real split of the problems, so greedy sloppiness is partial


@pytest.mark.parametrize(
    ("source", "kwargs", "key"),
    [
        (ChainArithmeticSource, {"split": "dev"}, "split"),
        (ChainArithmeticSource, {"digits": 5}, "digits"),
        (ChainArithmeticSource, {"ops": "*"}, "ops"),
        (CountdownSource, {"max_number": 1}, "max_number"),
        (CountdownSource, {"max_target": 0}, "max_target"),
        (SortingSource, {"length": 1}, "length"),
        (SortingSource, {"train_size": 0}, "train_size"),
    ],
)
def test_bad_source_arguments_name_the_key(source, kwargs, key) -> None:
    with pytest.raises(ConfigError, match=rf"{source.__name__}\.{key}="):
        source(**kwargs)


def test_too_many_problems_for_the_space_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="distinct problems"):
        SortingSource("train", length=2, max_value=3, test_size=4, train_size=100).load()


_STEP = re.compile(r"(\d+)\+(\d+)(\+1)?=(\d+)|(\d+)-(\d+)=(\d+)")


@settings(max_examples=300, deadline=None)
@given(a=st.integers(0, 99999), b=st.integers(0, 99999), op=st.sampled_from("+-"))
def test_chain_of_thought_steps_are_right_and_end_in_the_answer(a: int, b: int, op: str) -> None:
    a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
    text = chain_arithmetic.chain_of_thought(a, op, b)
    work, answer = text.split("; Answer: ")
    assert answer == str(a + b if op == "+" else a - b)
    digits = []
    for step in work.split(", "):
        m = _STEP.fullmatch(step)
        assert m, step
        if m[1] is not None:  # x+y(+1)=t: one column of the sum
            assert int(m[1]) + int(m[2]) + (1 if m[3] else 0) == int(m[4]) and int(m[1]) < 10 and int(m[2]) < 10
            digits.append(int(m[4]) % 10)
        else:  # t-y=d: the top digit (plus 10 if it borrowed) minus the bottom one
            assert int(m[5]) - int(m[6]) == int(m[7]) and 0 <= int(m[7]) < 10 and int(m[6]) < 10
            digits.append(int(m[7]))
    assert int("".join(map(str, reversed(digits)))) % 10 ** len(digits) == int(answer) % 10 ** len(digits)


@settings(max_examples=200, deadline=None)
@given(a=st.integers(100, 999), b=st.integers(100, 999), op=st.sampled_from("+-"), wrong=st.integers(1, 9))
def test_arithmetic_reward_accepts_the_answer_and_rejects_a_corrupted_one(a: int, b: int, op: str, wrong: int) -> None:
    a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
    rec = chain_arithmetic.make_record(a, op, b)
    bad = rec["solution"][:-1] + str((int(rec["solution"][-1]) + wrong) % 10)
    assert _score("arithmetic", [rec] * 3, [rec["solution"], bad, rec["solution"].replace("Answer:", "answer:")]) == [
        1.0,
        0.0,
        0.0,
    ]


@settings(max_examples=200, deadline=None)
@given(numbers=st.lists(st.integers(0, 999), min_size=2, max_size=12))
def test_sorting_reward_accepts_the_sorted_list_and_rejects_any_other_order(numbers: list[int]) -> None:
    rec = sorting.make_record(tuple(numbers))
    ordered = sorted(numbers)
    assert _score("sorting", [rec], [" " + rec["solution"]]) == [1.0]
    if len(set(numbers)) > 1:
        i = next(i for i in range(len(ordered) - 1) if ordered[i] != ordered[i + 1])
        swapped = ordered[:i] + [ordered[i + 1], ordered[i]] + ordered[i + 2 :]
        assert _score("sorting", [rec], ["Answer: " + " ".join(map(str, swapped))]) == [0.0]


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_number=st.integers(2, 30))
def test_countdown_reference_reaches_the_target_and_a_changed_number_does_not(seed: int, max_number: int) -> None:
    rng = random.Random(seed)
    sol = countdown.draw_solution(rng, max_number, "+-*", 200)
    rec = countdown.make_record(sol, (sol[4], sol[0], sol[2]))
    assert countdown_score(rec["solution"], rec["answer"]) == 1.0
    expr = rec["solution"].split("Answer: ")[1]
    bumped = re.sub(r"\d+", lambda m: str(int(m[0]) + 1), expr, count=1)  # one number +1: another value
    assert countdown_score("Answer: " + bumped, rec["answer"]) == 0.0


def test_countdown_rules() -> None:
    problem = "46 from 7 25 3"
    cases = {
        "25+(3*7)": 1.0,
        "(3*7)+25": 1.0,
        "25+21": 0.0,
        "7*7-3": 0.0,
        "(25-7)*3-8": 0.0,
        "25 + 3 * 7 ": 1.0,
        "1/0": 0.0,
        "(25*3-7)/1": 0.0,
        "25+3*7.0": 0.0,
        "-3+25+3*7": 0.0,
        "2**5": 0.0,
        "": 0.0,
    }
    for expr, want in cases.items():
        assert countdown_score(f"3*7=21; Answer: {expr}", problem) == want, expr
    assert countdown_score("Answer: (7+25)/3*3+14", "46 from 7 25 3 3 14") == 1.0  # exact division
    assert countdown_score("no answer here", problem) == 0.0
    assert (
        countdown_score("Answer: " + "+".join(["1"] * 40), "40 " + "from" + " 1" * 40) == 0.0
    )  # deeper than MAX_DEPTH
    with pytest.raises(ValueError, match="is not '<target> from"):
        parse_problem("46: 7 25 3")
    with pytest.raises(ExpressionError, match="Call is not allowed"):
        evaluate("print(1)")


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=80))
def test_countdown_scores_any_text_without_executing_it(text: str, monkeypatch, tmp_path) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the countdown reward must never eval/exec")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    assert countdown_score("Answer: " + text, "46 from 7 25 3") in (0.0, 1.0)


def test_countdown_payloads_are_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    payloads = [
        f"__import__('os').system('touch {marker}')",
        f"open('{marker}', 'w')",
        "(lambda: 46)()",
        "[46][0]",
        "7*7-3 or exit()",
        "9**9**9",
        "46 if 1 else 0",
        "'46'",
        "(46).real",
    ]
    assert CountdownReward()(
        ["q"] * len(payloads), [f"Answer: {p}" for p in payloads], ["46 from 7 25 3"] * len(payloads)
    ) == [0.0] * len(payloads)
    assert not marker.exists()


def test_reward_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="AnswerMatchReward.marker="):
        AnswerMatchReward(marker=" ")
    with pytest.raises(ConfigError, match="CountdownReward.max_chars="):
        CountdownReward(max_chars=0)


# ------------------------------------------------------------------ tokenizer and policy
@pytest.fixture(scope="module")
def tiny_reasoning_path(tmp_path_factory) -> str:
    """A random-init tiny Llama with the reasoning policy's tokenizer (trained here, about a second)."""
    from logra_lightning.builtin.reasoning import TINY_REASONING, ReasoningWarmupConfig, build_reasoning_model

    return build_reasoning_model(
        tmp_path_factory.mktemp("reasoning") / "model", ReasoningWarmupConfig(model=TINY_REASONING)
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_bpe_tokenizer_round_trips_any_text(text: str, tiny_reasoning_path: str) -> None:
    from logra_lightning.models import load_tokenizer

    tok = _cached_tokenizer(tiny_reasoning_path, load_tokenizer)
    assert tok.decode(tok.encode(text)) == text


_TOKENIZERS: dict = {}


def _cached_tokenizer(path: str, loader):
    return _TOKENIZERS.setdefault((path, loader.__name__), loader(path))


def test_tokenizer_splits_digits_merges_words_and_loads_the_same_everywhere(tiny_reasoning_path: str) -> None:
    from transformers import AutoTokenizer

    from logra_lightning.models import load_policy

    _, tok = load_policy(tiny_reasoning_path)
    auto = AutoTokenizer.from_pretrained(tiny_reasoning_path)  # what vLLM and `vllm serve` load
    text = "Make 46 from 7 25 3: 3*7=21, 25+21=46; Answer: 25+(3*7)\nSort 10  2:\tAnswer: 2 10"
    assert auto.encode(text) == tok.encode(text) and auto.decode(auto.encode(text)) == text
    assert tok.tokenize("12345") == list("12345")
    assert "ĠAnswer" in tok.get_vocab() and "Ġfrom" in tok.get_vocab()  # BPE merged the task words
    assert 200 < len(tok) <= 512


def test_builtin_reasoning_policy_is_registered_with_20m_parameters() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from logra_lightning.builtin.registry import BUILTIN_MODELS
    from logra_lightning.config.model_spec import model_config
    from logra_lightning.models import build_char_tokenizer

    cfg = BUILTIN_MODELS["reasoning-20m"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg.model.hf_config(build_char_tokenizer()))
    assert sum(p.numel() for p in model.parameters()) >= 19_000_000
    assert model_config("builtin:reasoning-20m")["hidden_size"] == 512 and cfg.model.architecture == "llama"


def test_export_rebuilds_the_reasoning_base_with_its_bpe_tokenizer(tmp_path: Path) -> None:
    from logra_lightning.io.export import base_model_dir
    from logra_lightning.models import load_tokenizer

    tok = load_tokenizer(base_model_dir("builtin:reasoning-20m", tmp_path))  # config and tokenizer of the base
    assert "ĠAnswer" in tok.get_vocab() and tok.decode(tok.encode("Sort 3 1: Answer: 1 3")) == "Sort 3 1: Answer: 1 3"


def test_warm_up_writes_per_task_accuracy_and_sloppy_demonstrations(tmp_path: Path) -> None:
    from logra_lightning.builtin.reasoning import (
        TINY_REASONING,
        ReasoningWarmupConfig,
        demonstrations,
        warm_up_reasoning,
    )

    cfg = ReasoningWarmupConfig(
        model=TINY_REASONING, steps=2, batch_size=4, test_size=8, tokenizer_texts=200, eval_max_new_tokens=4
    )
    demos = demonstrations(cfg, random.Random(0))
    for task_demos, task in zip(demos, cfg.tasks):
        records = reasoning_policy.task_records(cfg, task, "train")
        slipped = [d["answer"].endswith(".") for d in task_demos]
        prone = [r["slip_prone"] for r in records]
        share = lambda flag: sum(s for s, p in zip(slipped, prone) if p == flag) / sum(p == flag for p in prone)  # noqa: E731
        assert share(True) == pytest.approx(0.9, abs=0.02) and share(False) == pytest.approx(0.1, abs=0.02)
    summary = warm_up_reasoning(tmp_path / "policy", cfg, log_every=0)
    saved = json.loads((tmp_path / "policy" / "warmup.json").read_text())
    assert set(saved["tasks"]) == set(cfg.tasks) and saved["steps"] == 2 == summary["steps"]
    for task in cfg.tasks:
        got = saved["tasks"][task]
        assert 0.0 <= got["greedy_accuracy"] <= got["greedy_accuracy_ignoring_suffix"] <= 1.0


def test_a_second_stage_starts_from_its_first_stages_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from logra_lightning.builtin import registry as warmup
    from logra_lightning.builtin.reasoning import TINY_REASONING, ReasoningWarmupConfig
    from logra_lightning.models import load_policy

    small = dict(model=TINY_REASONING, batch_size=2, test_size=4, tokenizer_texts=50, eval_max_new_tokens=2)
    stages = {
        "first": ReasoningWarmupConfig(steps=1, **small),
        "second": ReasoningWarmupConfig(init_from="first", steps=0, **small),
        "other_tokenizer": ReasoningWarmupConfig(init_from="first", steps=0, **{**small, "tokenizer_texts": 20}),
    }
    monkeypatch.setattr(warmup, "BUILTIN_MODELS", stages)
    monkeypatch.setenv("LOGRA_CACHE_DIR", str(tmp_path))
    second = warmup.resolve_model("builtin:second")
    first = warmup.resolve_model("builtin:first")  # built by the second stage, found in the cache now
    a, b = load_policy(first)[0].state_dict(), load_policy(second)[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    key = warmup._key(stages["second"])
    monkeypatch.setitem(stages, "first", ReasoningWarmupConfig(steps=2, **small))
    assert warmup._key(stages["second"]) != key  # a changed first stage rebuilds the second
    with pytest.raises(ConfigError, match="init_from='first'.*tokenizer"):
        warmup.resolve_model("builtin:other_tokenizer")


@pytest.mark.parametrize("task", sorted(SOURCES))
def test_config_asks_for_the_problems_the_policy_was_warmed_up_on_and_scores_them(task: str) -> None:
    from omegaconf import OmegaConf

    config = OmegaConf.load(ROOT / "configs" / f"reasoning_{task}.yaml")
    data = config.data
    for split in ("train", "val"):
        args = OmegaConf.to_container(data[split].init_args)
        assert data[split].class_path.endswith(SOURCES[task].__name__)
        assert {k: args.get(k) for k in reasoning_policy.TASK_ARGS[task]} == reasoning_policy.TASK_ARGS[task], split
    assert config.model.reward.class_path.endswith("." + type(REWARDS[task]).__name__)


# The three configs differ only in their source and reward (checked above, and each one started up to the model
# build by tests/test_cli.py::test_config_starts_up): one of them runs RL.
@pytest.mark.parametrize("task", ["countdown"])
def test_config_runs_rl_on_a_tiny_policy(task: str, tiny_reasoning_path: str, tmp_path: Path) -> None:
    from conftest import tiny_run  # tests/conftest.py

    from logra_lightning.cli import run

    cli = run(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / f"reasoning_{task}.yaml"),
            "--model.model",
            tiny_reasoning_path,
            "--model.engine",
            "logra_lightning.rollout.HFEngineSpec",
            *tiny_run(tmp_path),
            "--model.max_new_tokens",
            "8",
            "--data.train.init_args.test_size",
            "16",
            "--data.val.init_args.test_size",
            "16",
            "--data.train.init_args.train_size",
            "64",
        ]
    )
    assert cli.trainer.global_step == 2
    summary = json.loads((Path(cli.trainer.log_dir) / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    assert type(cli.model.reward_fn).__name__ == type(REWARDS[task]).__name__


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_loads_the_directory_and_round_trips_task_text(tiny_reasoning_path: str) -> None:
    pytest.importorskip("vllm")
    from vllm import LLM, SamplingParams

    from logra_lightning.models import load_tokenizer

    tok = load_tokenizer(tiny_reasoning_path)
    llm = LLM(
        model=tiny_reasoning_path, dtype="float32", max_model_len=96, kv_cache_memory_bytes=2**28, enforce_eager=True
    )
    vtok = llm.get_tokenizer()
    text = "Make 46 from 7 25 3: 3*7=21, 25+21=46; Answer: 25+(3*7)\nSort 10  2:"
    assert vtok.encode(text) == tok.encode(text) and vtok.decode(vtok.encode(text)) == text
    out = llm.generate(["Sort 42 7 19:"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    full = tok.decode(out.token_ids, skip_special_tokens=True)
    # a random policy emits arbitrary bytes; vLLM's incremental detokenizer holds back trailing bytes that do
    # not form a character yet (each decodes to U+FFFD here), and nothing else
    assert vtok.decode(out.token_ids, skip_special_tokens=True) == full and full.startswith(out.text)
    assert set(full[len(out.text) :]) <= {"\ufffd"}, full[len(out.text) :]
