"""Bad input fails at start-up with the project's own errors, naming the key (or file:line), value and range.

The table of single bad values, each failing before a model is built, is in tests/test_user_errors.py. Here:
the checks that read a model's shapes or need the trainer, and property-based tests (hypothesis) that throw
random config values and malformed dataset lines at the checks and the loaders and require "loads, or a
LograError naming what is wrong".
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path

import lightning as L
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import logra_lightning.rl.module as module_mod
from logra_lightning.cli import run
from logra_lightning.cli.lightning_cli import LograCLI
from logra_lightning.config.checks import validate_fit_config
from logra_lightning.config.model_spec import model_config
from logra_lightning.data import GSM8KSource, JSONLSource, PromptDataModule
from logra_lightning.errors import ConfigError, DataError, LograError
from logra_lightning.models import parameter_shapes
from logra_lightning.rl.module import PolicyGradientModule

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "arithmetic_tiny_adamw.yaml")
LOGRA = ["--model.optimizer", "logra_lightning.optim.LoGRA"]


def test_rank_check_follows_include_and_exclude(no_model_built):
    # Without the embeddings (vocab 128) the smallest low-rank side is the hidden size, 256.
    cli = LograCLI(
        args=[
            "--config",
            CONFIG,
            *LOGRA,
            "--model.optimizer.init_args.rank",
            "200",
            "--model.optimizer.init_args.exclude",
            "[embed_tokens, lm_head]",
        ],
        run=False,
    )
    assert cli.model.hparams.group_size == 8  # instantiated: the rank was accepted
    with pytest.raises(ConfigError, match=r"rank=257: .*model.layers.0.self_attn.q_proj.weight \[256, 256\]"):
        run(
            [
                "fit",
                "--config",
                CONFIG,
                *LOGRA,
                "--model.optimizer.init_args.rank",
                "257",
                "--model.optimizer.init_args.exclude",
                "[embed_tokens, lm_head]",
            ]
        )


def test_parameter_shapes_match_the_real_model(tiny_policy_path):
    from logra_lightning.models import load_policy

    model, _ = load_policy(tiny_policy_path)
    real = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert parameter_shapes(model_config("builtin:arithmetic-tiny")) == real
    assert parameter_shapes(model_config(tiny_policy_path)) == real  # from the directory's config.json


@pytest.mark.parametrize("family", ["phi3", "qwen3_moe"])
def test_rank_check_sees_fused_and_expert_weights(tmp_path, family):
    """The check reads the shapes of the model class itself: Phi-3's fused qkv_proj, a MoE's 3-D experts."""
    from logra_lightning.config.checks import check_rank
    from logra_lightning.models import TinyModelConfig, build_tiny_model

    cfg = TinyModelConfig(architecture=family, num_layers=1, hidden_size=64, num_heads=1, num_kv_heads=1)
    shapes = parameter_shapes(model_config(build_tiny_model(tmp_path / family, cfg)))
    name = "qkv_proj" if family == "phi3" else "experts.down_proj"
    (matrix,) = [n for n in shapes if name in n]
    side = min(shapes[matrix][-1], math.prod(shapes[matrix][:-1]))
    check_rank(side, shapes, family, include=[name])
    with pytest.raises(ConfigError, match=rf"rank={side + 1}: larger than the smaller side of {re.escape(matrix)}"):
        check_rank(side + 1, shapes, family, include=[name])


def test_prompt_longer_than_engine_context_fails_before_the_policy_is_built(tmp_path, tiny_policy_path, monkeypatch):
    from logra_lightning.rollout.vllm.engine import VLLMEngineSpec

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in ["1+0=", "12345+67890=", "2+2="]))
    monkeypatch.setattr(module_mod, "load_policy", lambda *a, **k: pytest.fail("the policy was built"))
    module = PolicyGradientModule(engine=VLLMEngineSpec(max_model_len=16), max_new_tokens=5)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    match = (
        r"model.engine.init_args.max_model_len=16: too short for 1 training prompt\(s\); "
        r"the longest, #1 \('12345\+67890='...\), has 12 tokens .* needs 17"
    )
    with pytest.raises(ConfigError, match=match):
        trainer.fit(module, PromptDataModule(JSONLSource(str(data)), batch_size=2))


# ------------------------------------------------------------- properties
CONFIG_VALUES = st.fixed_dictionaries(
    {  # each value: in range about half the time, else anything
        "lr": st.one_of(st.floats(0, 1), st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5)),
        "rank": st.one_of(st.none(), st.integers(1, 128), st.integers(-3, 300)),
        "betas": st.one_of(
            st.lists(st.floats(0, 0.999), min_size=2, max_size=2), st.lists(st.floats(-1, 2), max_size=3)
        ),
        "target_kl": st.one_of(st.floats(1e-6, 1), st.floats(allow_nan=True, allow_infinity=True)),
        "max_model_len": st.one_of(st.none(), st.integers(31, 64), st.integers(-2, 40)),
        "max_new_tokens": st.integers(1, 30),
        "exclude_embeddings": st.booleans(),
    }
)


def _fit_config(v: dict) -> dict:
    opt_args = {"lr": v["lr"], "betas": v["betas"], "rank": v["rank"]}
    if v["exclude_embeddings"]:
        opt_args["exclude"] = ["embed_tokens", "lm_head"]
    return {
        "trainer": {
            "callbacks": [
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {}},
                {"class_path": "logra_lightning.callbacks.KLStepControl", "init_args": {"target_kl": v["target_kl"]}},
            ]
        },
        "model": {
            "model": "builtin:arithmetic-tiny",
            "max_new_tokens": v["max_new_tokens"],
            "optimizer": {"class_path": "logra_lightning.optim.LoGRA", "init_args": opt_args},
            "engine": {
                "class_path": "logra_lightning.rollout.VLLMEngineSpec",
                "init_args": {"max_model_len": v["max_model_len"]},
            },
        },
    }


def _violations(v: dict) -> set[str]:
    """The keys out of range, by the documented rules (an independent statement of them)."""
    bad = set()
    if not (math.isfinite(v["lr"]) and v["lr"] >= 0):
        bad.add("init_args.lr")
    if not (len(v["betas"]) == 2 and all(0 <= b < 1 for b in v["betas"])):
        bad.add("init_args.betas")
    smallest = 256 if v["exclude_embeddings"] else 128  # hidden size / vocab of the tiny model
    if v["rank"] is not None and not (1 <= v["rank"] <= smallest):
        bad.add("init_args.rank")
    if not (math.isfinite(v["target_kl"]) and v["target_kl"] > 0):
        bad.add("target_kl")
    if v["max_model_len"] is not None and v["max_model_len"] <= v["max_new_tokens"]:
        bad.add("max_model_len")
    return bad


@settings(max_examples=200, deadline=None, derandomize=True)
@given(CONFIG_VALUES)
def test_random_config_values_pass_or_fail_naming_a_bad_key(values):
    bad = _violations(values)
    try:
        validate_fit_config(_fit_config(values))
    except ConfigError as err:
        event("rejected")
        key = str(err).split("=", 1)[0]
        assert any(key.endswith(b) for b in bad), (str(err), bad)  # names a key that really is out of range
        assert "allowed" in str(err)
    else:
        event("accepted")
        assert not bad, bad


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    key=st.sampled_from(
        [
            "model.group_size",
            "data.batch_size",
            "model.max_new_tokens",
            "model.ppo_epochs",
            "model.temperature",
            "model.top_p",
            "model.optimizer.init_args.lr",
            "model.kl_coef",
        ]
    ),
    value=st.one_of(st.integers(-3, 3), st.floats(-2, 2), st.sampled_from([math.nan, math.inf])),
)
def test_random_cli_values_instantiate_or_fail_with_a_logra_error(key, value, no_model_built):
    if key.split(".")[-1] in ("group_size", "batch_size", "max_new_tokens", "ppo_epochs"):
        value = int(value) if math.isfinite(value) else 0
    text = {math.nan: ".nan", math.inf: ".inf"}.get(value, str(value))  # YAML spellings: types parse, ranges decide
    try:
        LograCLI(args=["--config", CONFIG, f"--{key}={text}"], run=False)
    except LograError as err:
        event(f"rejected: {type(err).__name__}")
        assert key.split(".", 1)[1] in str(err) or key in str(err), str(err)
    else:
        event("instantiated")


# -------------------------------------------------------------- data lines
def _line(kind: str, source: str, text: str) -> bytes:
    q, a = ("prompt", "answer") if source == "jsonl" else ("question", "answer")
    good_answer = "7" if source == "jsonl" else f"work\n#### {len(text)}"
    value = text if text.strip() else "x" + text
    lines = {
        "good": {q: value, a: good_answer},
        "good_number": {q: value, a: len(text)},
        "missing": {q: value},
        "not_object": [value, 1],
        "blank": None,
        "bad_json": None,
        "bad_utf8": None,
        "wrong_type": {q: [value], a: "1"},
        "empty_field": {q: " ", a: "1"},
        "no_final_answer": {q: value, a: "step one\nstep two"},
    }
    if kind == "blank":
        return b"   \n"
    if kind == "bad_json":
        return ("{oops " + text.replace("\n", " ") + "\n").encode()
    if kind == "bad_utf8":
        return b'{"' + q.encode() + b'": "\xff\xfe", "answer": "1"}\n'
    return (json.dumps(lines[kind]) + "\n").encode()


# What each loader accepts (None: skipped), from the module docstrings.
ACCEPTS = {
    "jsonl": {
        "good": True,
        "good_number": True,
        "blank": None,
        "wrong_type": True,
        "empty_field": True,
        "no_final_answer": True,
        "missing": False,
        "not_object": False,
        "bad_json": False,
        "bad_utf8": False,
    },
    "gsm8k": {
        "good": True,
        "good_number": True,
        "blank": None,
        "wrong_type": False,
        "empty_field": False,
        "no_final_answer": False,
        "missing": False,
        "not_object": False,
        "bad_json": False,
        "bad_utf8": False,
    },
}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    source=st.sampled_from(["jsonl", "gsm8k"]),
    rows=st.lists(st.tuples(st.sampled_from(sorted(ACCEPTS["jsonl"])), st.text(max_size=20)), max_size=8),
)
def test_malformed_dataset_lines_load_or_fail_naming_file_and_line(source, rows):
    path = Path(tempfile.mkdtemp()) / "data.jsonl"
    path.write_bytes(b"".join(_line(kind, source, text) for kind, text in rows))
    accepts = ACCEPTS[source]
    first_bad = next((i for i, (kind, _) in enumerate(rows, start=1) if accepts[kind] is False), None)
    good = sum(1 for kind, _ in rows if accepts[kind])
    loader = JSONLSource(str(path)) if source == "jsonl" else GSM8KSource(str(path), template="Q: {question}")
    try:
        records = loader.load()
    except DataError as err:
        event("DataError")
        if first_bad is not None:
            assert str(err).startswith(f"{path}:{first_bad}: "), (str(err), rows)
        else:
            assert good == 0 and str(err).startswith(f"{path}: no records"), str(err)
    else:
        event("loaded")
        assert first_bad is None and len(records) == good
        assert all(isinstance(r["prompt"], str) and isinstance(r["answer"], str) for r in records)


def test_the_prompt_length_check_sees_the_chat_template(tmp_path, tiny_policy_path, monkeypatch):
    """A chat template lengthens every prompt: the engine-context check counts the templated prompt."""
    import shutil

    from logra_lightning.models import load_tokenizer
    from logra_lightning.rollout.vllm.engine import VLLMEngineSpec

    chat = tmp_path / "chat_model"
    shutil.copytree(tiny_policy_path, chat)
    tok = load_tokenizer(str(chat))
    tok.chat_template = "{% for m in messages %}<start of {{ m['role'] }} turn>{{ m['content'] }}<end>{% endfor %}"
    tok.save_pretrained(chat)
    data = str(Path(__file__).parent / "data" / "gsm8k_tiny.jsonl")
    raw = max(len(tok.encode(r["prompt"])) for r in GSM8KSource(data).load())
    source = GSM8KSource(data)
    source.tokenizer = tok
    templated = max(len(tok.encode(r["prompt"])) for r in source.load())
    assert templated > raw
    monkeypatch.setattr(module_mod, "load_policy", lambda *a, **k: pytest.fail("the policy was built"))
    module = PolicyGradientModule(str(chat), engine=VLLMEngineSpec(max_model_len=raw + 5 + 1), max_new_tokens=5)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ConfigError, match=rf"max_model_len={raw + 6}: too short .* has {templated} tokens"):
        trainer.fit(module, PromptDataModule(GSM8KSource(data), batch_size=2))
