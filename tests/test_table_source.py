"""TableSource, the general prompt source: every file format, key mapping, extra fields, errors; and a fit that
reads a Parquet file whose extra column the reward asks for."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from conftest import tiny_run  # tests/conftest.py

from logra_lightning.cli import run
from logra_lightning.data import TableSource
from logra_lightning.errors import ConfigError, DataError

ROWS = [
    {"question": "12+30=", "solution": "42", "difficulty": 3, "topic": "add"},
    {"question": "7+0=", "solution": "007", "difficulty": 1, "topic": "add"},
]


def write(path: Path, rows: list[dict]) -> Path:
    """``rows`` as a file of the format its suffix names."""
    table = pa.Table.from_pylist(rows)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        pq.write_table(table, path)
    else:
        pcsv.write_csv(table, path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_every_format_gives_the_same_records(suffix, tmp_path):
    path = write(tmp_path / f"tasks{suffix}", ROWS)
    source = TableSource(
        str(path), prompt_key="question", answer_key="solution", system="Add.", use_chat_template=False
    )
    records = source.load()
    assert records[0] == {"prompt": "Add.\n\n12+30=", "answer": "42", **ROWS[0]}
    assert records[1]["answer"] == "007" and records[1]["difficulty"] == 1  # CSV too: the answer stays text


def test_extra_keys_choose_the_fields_and_answer_key_may_be_none(tmp_path):
    path = str(write(tmp_path / "t.parquet", ROWS))
    only = TableSource(path, prompt_key="question", answer_key=None, extra_keys=["difficulty"], limit=1).load()
    assert only == [{"prompt": "12+30=", "answer": "", "difficulty": 3}]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"prompt_key": "problem"},
            r"t\.parquet: row 1: missing field 'problem' \(fields present: \['difficulty', "
            r"'question', 'solution', 'topic'\]\); set prompt_key to the name your file uses",
        ),
        ({"prompt_key": "question", "answer_key": "answer"}, r"row 1: missing field 'answer' .*set answer_key"),
        (
            {"prompt_key": "question", "answer_key": "solution", "extra_keys": ["level"]},
            r"row 1: missing field\(s\) \['level'\] of extra_keys",
        ),
    ],
)
def test_a_missing_key_names_the_key_and_the_file(kwargs, match, tmp_path):
    with pytest.raises(DataError, match=match):
        TableSource(str(write(tmp_path / "t.parquet", ROWS)), **kwargs).load()


def test_construction_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"nope\.parquet: data file not found \(TableSource\.path\)"):
        TableSource(str(tmp_path / "nope.parquet"))
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"unknown format '\.txt'"):
        TableSource(str(tmp_path / "t.txt"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"pip install 'logra-lightning\[datasets\]'"):
        TableSource("openai/gsm8k", from_hub=True)


def test_a_datasets_name_loads_only_from_the_local_cache(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(DataError, match=r"from the local `datasets` cache \(loaded offline"):
        TableSource("no-such-user/no-such-dataset", from_hub=True).load()
    assert "HF_DATASETS_OFFLINE" not in os.environ  # offline while it loads, the environment left as it was


REWARD = """
def by_difficulty(completions, difficulty, topic):
    assert set(topic) == {"add"}
    return [d / 10 for d in difficulty]
"""


def test_fit_on_a_parquet_file_whose_extra_column_the_reward_reads(tmp_path, monkeypatch, tiny_policy_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_reward.py").write_text(textwrap.dedent(REWARD))
    rows = [
        {"question": f"{a}+{b}=", "solution": str(a + b), "difficulty": 3, "topic": "add"}
        for a in range(5)
        for b in range(4)
    ]
    write(tmp_path / "train.parquet", rows)
    source = {
        "class_path": "logra_lightning.data.TableSource",
        "init_args": {"path": "train.parquet", "prompt_key": "question", "answer_key": "solution"},
    }
    (tmp_path / "task.yaml").write_text(
        json.dumps({"model": {"reward": "my_reward.py:by_difficulty"}, "data": {"train": source, "val": source}})
    )
    cli = run(["fit", "--config", "arithmetic_tiny_adamw", "--config", "task.yaml", *tiny_run(tmp_path)])
    acc = EventAccumulator(cli.trainer.log_dir)
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward/mean")] == pytest.approx([0.3, 0.3])  # 3 / 10 on every sample
    assert acc.Scalars("reward/errors")[-1].value == 0
