"""GSM8K-/MATH-shaped sources on small local files: formats, templating, and errors that name file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from logra_lightning.data.math import GSM8KSource, MATHSource, gsm8k_final_answer
from logra_lightning.data.module import PromptDataModule
from logra_lightning.data.template import render_prompt
from logra_lightning.errors import ConfigError, DataError
from logra_lightning.rewards.math import MathVerifyReward

DATA = Path(__file__).parent / "data"
GSM8K_ROWS = [
    {"question": "Ann has 2 apples and buys 3 more. How many apples?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"},
    {"question": "A box holds 12 eggs. How many eggs in 3 boxes?", "answer": "12 * 3 = 36\n#### 36"},
    {"question": "What is 1,000 minus 1?", "answer": "999"},
]
MATH_ROWS = [
    {"problem": "Simplify $\\frac{2}{4}$.", "solution": "Divide by 2: $\\boxed{\\frac{1}{2}}$.", "level": "Level 1"},
    {"problem": "What is $2^3$?", "solution": "We get $\\boxed{4}$, no: $2^3 = \\boxed{8}$.", "level": "Level 1"},
    {"problem": "Name the day after Sunday.", "solution": "It is Monday.", "answer": "\\text{Monday}"},
]


def write_jsonl(path: Path, rows: list, extra_lines: dict[int, bytes] | None = None) -> Path:
    """Write ``rows`` one per line; ``extra_lines`` puts raw bytes at given 1-based lines instead."""
    lines = [json.dumps(r).encode() for r in rows]
    for lineno, raw in (extra_lines or {}).items():
        lines.insert(lineno - 1, raw)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_tiny_files_load_and_their_own_solutions_score_full_reward():
    gsm = GSM8KSource(str(DATA / "gsm8k_tiny.jsonl")).load()
    math = MATHSource(str(DATA / "math_tiny.jsonl")).load()
    assert len(gsm) == 16 and len(math) == 16
    assert [r["answer"] for r in gsm[:4]] == ["19", "16", "210", "7"]
    assert [r["answer"] for r in math[:3]] == ["14", "\\frac{3}{4}", "9"]
    for name, records, key in (("gsm8k_tiny.jsonl", gsm, "answer"), ("math_tiny.jsonl", math, "solution")):
        path = DATA / name
        worked = [json.loads(line)[key] for line in path.read_text().splitlines()]
        answers = [r["answer"] for r in records]
        assert MathVerifyReward()([r["prompt"] for r in records], worked, answers) == [1.0] * 16
        # pairing each worked answer with the next record's reference must mostly fail
        assert sum(MathVerifyReward()([""] * 16, worked, answers[1:] + answers[:1])) <= 2


def test_gsm8k_jsonl_with_custom_fields_and_template(tmp_path):
    rows = [{"q": r["question"], "a": r["answer"], "id": i} for i, r in enumerate(GSM8K_ROWS)]
    path = write_jsonl(tmp_path / "g.jsonl", rows, extra_lines={2: b"   "})  # blank line skipped
    records = GSM8KSource(str(path), question_field="q", answer_field="a", template="Q: {question}\nA:").load()
    assert [r["answer"] for r in records] == ["5", "36", "999"]
    assert records[0]["prompt"] == f"Q: {GSM8K_ROWS[0]['question']}\nA:"
    assert records[0]["question"] == GSM8K_ROWS[0]["question"]
    assert sorted(records[0]) == ["answer", "prompt", "question"]  # same keys on every record, for collation


@pytest.mark.parametrize("layout", ["list", "lines"])
def test_json_file_as_a_list_or_as_json_lines(tmp_path, layout):
    path = tmp_path / "g.json"
    text = json.dumps(GSM8K_ROWS) if layout == "list" else "\n".join(json.dumps(r) for r in GSM8K_ROWS)
    path.write_text(text)
    assert [r["answer"] for r in GSM8KSource(str(path)).load()] == ["5", "36", "999"]


def test_parquet_gsm8k_and_math(tmp_path):
    g = write_parquet(tmp_path / "g.parquet", GSM8K_ROWS)
    assert [r["answer"] for r in GSM8KSource(str(g)).load()] == ["5", "36", "999"]
    m = write_parquet(tmp_path / "m.parquet", [{**r, "answer": r.get("answer")} for r in MATH_ROWS])
    assert [r["answer"] for r in MATHSource(str(m)).load()] == ["\\frac{1}{2}", "8", "\\text{Monday}"]


def test_parquet_row_error_names_file_and_row(tmp_path):
    path = write_parquet(tmp_path / "g.parquet", [GSM8K_ROWS[0], {"question": "Q?", "answer": None}])
    with pytest.raises(DataError, match=r"g\.parquet: row 2: field 'answer' must be a string, got NoneType"):
        GSM8KSource(str(path)).load()


def test_math_reference_prefers_answer_field_then_last_box(tmp_path):
    records = MATHSource(str(write_jsonl(tmp_path / "m.jsonl", MATH_ROWS))).load()
    assert [r["answer"] for r in records] == ["\\frac{1}{2}", "8", "\\text{Monday}"]


def test_math_solution_without_box_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [MATH_ROWS[0], {"problem": "P", "solution": "It is 3."}])
    with pytest.raises(DataError, match=r"m\.jsonl:2: no \\boxed\{\.\.\.\} answer in 'solution'"):
        MATHSource(str(path)).load()


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        (b'{"question": "Q", "answer": "#### 1"', r"g\.jsonl:3: invalid JSON"),
        (b'{"question": "Q"}', r"g\.jsonl:3: missing field 'answer' \(fields present: \['question'\]\)"),
        (b'{"question": "Caf\xe9?", "answer": "#### 1"}', r"g\.jsonl:3: not valid UTF-8"),
        (b'["Q", "#### 1"]', r"g\.jsonl:3: expected a JSON object, got list"),
        (b'{"question": "Q", "answer": ["1"]}', r"g\.jsonl:3: field 'answer' must be a string, got list"),
        (b'{"question": "", "answer": "#### 1"}', r"g\.jsonl:3: field 'question' is empty"),
        (b'{"question": "Q", "answer": "step 1\\nstep 2"}', r"g\.jsonl:3: field 'answer' has no final '#### <answer>'"),
        (b'{"question": "Q", "answer": "so\\n####  "}', r"g\.jsonl:3: field 'answer' has no final '#### <answer>'"),
    ],
)
def test_bad_line_is_an_error_naming_file_and_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS[:2], extra_lines={3: bad_line})
    with pytest.raises(DataError, match=message):
        GSM8KSource(str(path)).load()


def test_bad_json_list_names_the_line(tmp_path):
    path = tmp_path / "g.json"
    path.write_text('[\n  {"question": "Q", "answer": "1"},\n  {"question": "Q" "answer": "2"}\n]')
    with pytest.raises(DataError, match=r"g\.json:3: invalid JSON"):
        GSM8KSource(str(path)).load()
    path.write_bytes(b'[\n {"question": "Q", "answer": "1"},\n {"question": "\xff", "answer": "2"}\n]')
    with pytest.raises(DataError, match=r"g\.json:3: not valid UTF-8"):
        GSM8KSource(str(path)).load()


@pytest.mark.parametrize("content", [b"", b"\n  \n"])
def test_empty_file_is_an_error(tmp_path, content):
    path = tmp_path / "g.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=r"g\.jsonl: no records \(the file is empty\)"):
        GSM8KSource(str(path)).load()


def test_construction_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"missing\.jsonl: data file not found .*set from_hub=True"):
        GSM8KSource(str(tmp_path / "missing.jsonl"))
    txt = tmp_path / "g.txt"
    txt.write_text("question,answer\n")
    with pytest.raises(
        ConfigError, match=r"unknown format '\.txt'; use one of \('\.jsonl', '\.json', '\.parquet', '\.csv'\)"
    ):
        GSM8KSource(str(txt))
    good = str(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS))
    with pytest.raises(ConfigError, match=r"template='Q: \{q\}': must contain the placeholder \{question\}"):
        GSM8KSource(good, template="Q: {q}")
    with pytest.raises(ConfigError, match=r"MATHSource\.limit=0: use a positive integer or null"):
        MATHSource(good, limit=0)
    with pytest.raises(ConfigError, match=r"GSM8KSource\.max_prompt_chars=-5"):
        GSM8KSource(good, max_prompt_chars=-5)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"from_hub=True\) needs the `datasets` package: pip install datasets"):
        GSM8KSource("openai/gsm8k", from_hub=True, hub_config="main")


def test_long_prompts_are_skipped_counted_and_warned_once(tmp_path):
    rows = GSM8K_ROWS + [{"question": "x" * 500, "answer": "#### 1"}, {"question": "y" * 600, "answer": "#### 2"}]
    source = GSM8KSource(str(write_jsonl(tmp_path / "g.jsonl", rows)), max_prompt_chars=100)
    with pytest.warns(UserWarning, match=r"skipped 2 prompts longer than max_prompt_chars=100; kept 3") as record:
        records = source.load()
    assert len(records) == 3 and len(record) == 1
    assert source.stats == {"loaded": 3, "skipped_too_long": 2}
    with pytest.raises(DataError, match=r"no records \(all 3 prompts exceed max_prompt_chars=10\)"):
        GSM8KSource(str(write_jsonl(tmp_path / "h.jsonl", GSM8K_ROWS)), max_prompt_chars=10).load()


def test_limit_keeps_the_first_records():
    records = GSM8KSource(str(DATA / "gsm8k_tiny.jsonl"), limit=5).load()
    assert [r["answer"] for r in records] == ["19", "16", "210", "7", "26"]


def test_gsm8k_final_answer():
    assert gsm8k_final_answer("a #### b\n#### 42 ") == "42"
    assert gsm8k_final_answer("-3") == "-3"
    assert gsm8k_final_answer("####") is None


class FakeChatTokenizer:
    chat_template = "fake"

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append((messages, kwargs))
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"


def test_render_prompt_without_chat_template_keeps_literal_braces():
    template = "{question}\nPut the final answer in \\boxed{}."
    assert render_prompt("1+1?", None, template) == "1+1?\nPut the final answer in \\boxed{}."
    assert render_prompt("1+1?", None, system="Be brief.") == "Be brief.\n\n1+1?"


def test_render_prompt_uses_chat_template_when_present():
    tok = FakeChatTokenizer()
    out = render_prompt("1+1?", tok, template="Solve: {question}", system="S")
    assert out == "system:S|user:Solve: 1+1?|assistant:"
    assert tok.calls[0][1] == {"add_generation_prompt": True, "tokenize": False}
    assert render_prompt("1+1?", tok, use_chat_template=False) == "1+1?"
    tok.chat_template = None
    assert render_prompt("1+1?", tok) == "1+1?"


def test_source_renders_with_a_real_hf_chat_template(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    source = GSM8KSource(str(write_jsonl(tmp_path / "g.jsonl", GSM8K_ROWS[:1])), system="Think.")
    source.tokenizer = tok
    assert source.load()[0]["prompt"] == f"<|system|>Think.\n<|user|>{GSM8K_ROWS[0]['question']}\n<|assistant|>"


def test_math_source_feeds_the_prompt_data_module():
    dm = PromptDataModule(MATHSource(str(DATA / "math_tiny.jsonl")), batch_size=4)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert sorted(batch) == ["answer", "prompt", "question"] and len(batch["prompt"]) == 4


def test_datamodule_hands_chat_template_to_math_sources(tmp_path):
    """A chat model's template is applied to GSM8K prompts once the module hands over its tokenizer."""
    from logra_lightning.data import GSM8KSource, PromptDataModule
    from logra_lightning.models import build_char_tokenizer

    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}) + "\n")
    dm = PromptDataModule(GSM8KSource(str(path)), GSM8KSource(str(path)), batch_size=1)
    dm.setup("fit")
    assert dm.train_records[0]["prompt"] == "What is 2+2?"
    tok = build_char_tokenizer()
    assert dm.use_tokenizer(tok) is False  # no chat template: nothing changes
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    assert dm.use_tokenizer(tok) is True
    assert dm.train_records[0]["prompt"] == "<user>What is 2+2?<assistant>"
    assert dm.val_records[0]["prompt"] == "<user>What is 2+2?<assistant>"
