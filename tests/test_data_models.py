"""The arithmetic task, the JSONL loader, the char tokenizer and local model loading."""

from __future__ import annotations

import json

import pytest

from logra_lightning.data import ArithmeticSource, JSONLSource, PromptDataModule
from logra_lightning.errors import ConfigError, DataError
from logra_lightning.models import TinyModelConfig, build_char_tokenizer, build_tiny_model, load_policy
from logra_lightning.rewards import ExactMatchReward, safe_rewards


def test_arithmetic_splits_are_disjoint_and_deterministic():
    train = ArithmeticSource("train", max_digits=2, ops="+-", test_size=100).load()
    test = ArithmeticSource("test", max_digits=2, ops="+-", test_size=100).load()
    assert len(test) == 100 and len(train) == 2 * 100 * 100 - 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert test == ArithmeticSource("test", max_digits=2, ops="+-", test_size=100).load()
    for r in test[:20]:
        a, op, b = r["prompt"][:-1].partition("+") if "+" in r["prompt"] else r["prompt"][:-1].partition("-")
        assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"split": "dev"}, "split"),
        ({"max_digits": 4}, "max_digits"),
        ({"ops": "/"}, "ops"),
        ({"test_size": 0}, "test_size"),
    ],
)
def test_arithmetic_bad_args(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        ArithmeticSource(**kwargs)


def test_jsonl_loads_and_reports_bad_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"prompt": "1+1=", "answer": 2}) + "\n\n" + json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n"
    )
    assert JSONLSource(str(good)).load() == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: invalid JSON"):
        JSONLSource(str(bad)).load()
    missing = tmp_path / "missing_field.jsonl"
    missing.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    with pytest.raises(DataError, match=r"missing_field.jsonl:1: missing field\(s\) \['answer'\]"):
        JSONLSource(str(missing)).load()
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(DataError, match=r"binary.jsonl:1: not valid UTF-8"):
        JSONLSource(str(binary)).load()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="empty"):
        JSONLSource(str(empty)).load()


def test_missing_data_file_fails_at_creation(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: data file not found"):
        JSONLSource(str(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize("key", ["batch_size", "val_batch_size"])
def test_datamodule_rejects_non_positive_batch(key):
    with pytest.raises(ConfigError, match=f"data.{key}=0"):
        PromptDataModule(ArithmeticSource(), **{key: 0})


def test_char_tokenizer_round_trip():
    tok = build_char_tokenizer()
    text = "37+48=85 The answer is \\boxed{-3/4}!"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text


def test_local_model_directory_round_trip(tmp_path):
    path = build_tiny_model(tmp_path / "m", TinyModelConfig(num_layers=1))
    model, tok = load_policy(path)
    assert model.config.head_dim == 64 and tok.decode(tok.encode("12+3=")) == "12+3="
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_policy(str(tmp_path / "absent"))


def test_exact_match_and_safe_rewards():
    assert ExactMatchReward()(["a", "b"], [" 4", "5"], ["4", "6"]) == [1.0, 0.0]

    def flaky(prompts, completions, answers):
        if any(c == "boom" for c in completions):
            raise RuntimeError("cannot score boom")
        return [1.0 for _ in completions]

    rewards, errors, first = safe_rewards(flaky, ["p"] * 3, ["ok", "boom", "ok"], ["a"] * 3)
    assert rewards == [1.0, 0.0, 1.0] and errors == 1 and "cannot score boom" in first
