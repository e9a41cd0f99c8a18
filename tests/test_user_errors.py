"""Every everyday mistake ends in one ``logra: error:`` line naming the thing and the fix, with no traceback.

Cases are run in-process through :func:`logra_lightning.cli.run`, checked for what the console prints
(:func:`console`), with model building forbidden (every case must fail before a model is
loaded); a few run ``python -m logra_lightning`` as a subprocess to check the exit status and
that stderr holds no traceback. The property-based tests (hypothesis) generate bad config
files, bad single config values, bad checkpoint bytes and bad data lines.

Run: ``.venv/bin/python -m pytest tests/test_user_errors.py -q`` (about 2-3 min on 2 cores).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import console  # tests/conftest.py
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logra_lightning.cli import run
from logra_lightning.errors import ConfigError, DataError, LograError
from logra_lightning.io.checkpoint import check_checkpoint_path
from logra_lightning.models import TinyModelConfig, build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "arithmetic_tiny_adamw.yaml")


def fast(n: int) -> settings:
    return settings(
        max_examples=n, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )


@pytest.fixture(autouse=True)
def offline_and_no_model(monkeypatch, no_model_built):
    """Nothing may be downloaded, and no case may get as far as building a model (``no_model_built``)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelConfig(num_layers=1)))


def _copy_model(src: Path, dst: Path, drop: tuple[str, ...] = (), edit: dict | None = None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in drop:
            (dst / f.name).write_bytes(f.read_bytes())
    if edit:
        for name, text in edit.items():
            (dst / name).write_text(text) if isinstance(text, str) else (dst / name).write_bytes(text)
    return dst


# ------------------------------------------------------------------ config files
CONFIG_FILES = [
    ("missing", None, r"--config .*missing.yaml: no such file"),
    ("dir", "DIR", r"--config .*dir: is a directory"),
    ("tab", "trainer:\n  max_steps: 3\n\tfoo: 1\n", r"tab.yaml:3:1: not valid YAML"),
    ("bracket", "model: {model: builtin:arithmetic-tiny\ndata: 1\n", r"bracket.yaml:\d+:\d+: not valid YAML"),
    ("quote", 'model:\n  model: "builtin:arithmetic-tiny\n', r"quote.yaml:\d+:\d+: not valid YAML"),
    ("empty", "", r"empty.yaml: the file is empty"),
    ("list", "- trainer\n- model\n", r"list.yaml: holds a YAML list, not a mapping"),
    ("section", "trainer: 5\nmodel: {}\n", r"section.yaml: section trainer: holds a int \(5\), not a mapping"),
    ("binary", b"\xff\xfe\x00model", r"binary.yaml:1: not UTF-8 text"),
    ("unknown_key", "model:\n  grup_size: 4\n", r"grup_size"),
    ("wrong_type", "trainer:\n  max_steps: lots\n", r"trainer.max_steps: Expected a <class 'int'>. Got value: lots"),
    (
        "duplicate",
        "trainer:\n  max_steps: 3\n  max_steps: 4\n",
        r"duplicate.yaml:3:3: not valid YAML \(duplicate key 'max_steps' \(first on line 2\)",
    ),
    (
        "unset_env",
        "model:\n  group_size: ${oc.env:LOGRA_TEST_UNSET_VARIABLE}\n",
        r"model.group_size: interpolation cannot be resolved: "
        r"Environment variable 'LOGRA_TEST_UNSET_VARIABLE' not found "
        r"\(--config .*unset_env.yaml\)",
    ),
    (
        "bad_reference",
        "model:\n  group_size: ${data.no_such_key}\n",
        r"model.group_size: interpolation cannot be resolved: .*no_such_key",
    ),
]


@pytest.mark.parametrize("name, text, match", CONFIG_FILES, ids=[c[0] for c in CONFIG_FILES])
def test_bad_config_file(name, text, match, tmp_path, capsys):
    path = tmp_path / (name if text == "DIR" else f"{name}.yaml")
    if text == "DIR":
        path.mkdir()
    elif isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    base = ["--config", CONFIG] if name in ("unknown_key", "wrong_type") else []  # a whole config, then the bad part
    args = ["fit", *base, "--config", str(path)]
    assert re.search(match, console(args, capsys))


LOGRA = ["--model.optimizer", "logra_lightning.optim.LoGRA"]
KL = ["--trainer.callbacks+=logra_lightning.callbacks.KLStepControl"]
LORA = ["--config", str(ROOT / "configs" / "arithmetic_tiny_lora.yaml")]
# One bad value (or combination) each, on the AdamW config unless a row starts with its own --config: the error
# raised (SystemExit: the command line does not parse) and what its one line says. Every row fails before a model is
# built (the autouse fixture above).
BAD_VALUES = [
    (["--model.grup_size", "4"], SystemExit, r"unrecognized arguments: --model.grup_size 4 \(`logra fit --help` lists"),
    (["--trainer.max_steps", "ten"], SystemExit, r"trainer.max_steps: Expected a <class 'int'>. Got value: ten"),
    (["--model.optimizer", "logra_lightning.optim.LoGRa"], SystemExit, r"model.optimizer: .*LoGRa"),
    (["--data.batch_size", "-3"], ConfigError, r"data.batch_size=-3: must be an integer >= 1"),
    (["--data.batch_size", "0"], ConfigError, r"data.batch_size=0"),
    (["--model.group_size", "0"], ConfigError, r"model.group_size=0"),
    (["--model.group_size", "1"], ConfigError, r"scale_by_std"),
    (["--model.truncated_reward", ".nan"], ConfigError, r"model.truncated_reward=nan: allowed None \(off\) or finite"),
    (
        ["--data.train", "logra_lightning.data.JSONLSource", "--data.train.path", "/nonexistent/d.jsonl"],
        DataError,
        r"/nonexistent/d.jsonl: data file not found",
    ),
    (
        ["--trainer.logger.init_args.save_dir", "FILE"],
        ConfigError,
        r"save_dir='.*FILE': is a file, not a log directory",
    ),
    (["--export", "FILE"], ConfigError, r"--export='.*FILE': is a file, not a export directory"),
    (
        ["--data.batch_size", "100000"],
        LograError,
        r"data.batch_size=100000: larger than the training set \(\d+ prompts\)",
    ),
    (
        ["--trainer.accumulate_grad_batches", "4"],
        ConfigError,
        r"accumulate_grad_batches=4: allowed 1; .*model.micro_batch_size",
    ),
    (["--trainer.gradient_clip_val", "1.0"], ConfigError, r"gradient_clip_val=1.0: .*model.gradient_clip_norm=1.0"),
    (["--trainer.val_check_interval", "0"], ConfigError, r"val_check_interval=0: allowed numbers > 0"),
    (
        [*LOGRA, "--model.optimizer.init_args.rank", "200"],
        ConfigError,
        r"model.optimizer.init_args.rank=200: larger than the smaller side of "
        r"model.embed_tokens.weight \[128, 256\] "
        r"in builtin:arithmetic-tiny; allowed 1 <= rank <= 128",
    ),
    (
        [*LOGRA, "--model.optimizer.init_args.rank", "0"],
        ConfigError,
        r"optimizer.init_args.rank=0: allowed integers >= 1",
    ),
    (
        ["--model.optimizer.init_args.lr=-0.001"],
        ConfigError,
        r"optimizer.init_args.lr=-0.001: allowed finite numbers >= 0",
    ),
    (
        ["--model.optimizer.init_args.lr", ".nan"],
        ConfigError,
        r"optimizer.init_args.lr=nan: allowed finite numbers >= 0",
    ),
    (
        [*KL, "--trainer.callbacks.target_kl", "0"],
        ConfigError,
        r"trainer.callbacks\[1\].init_args.target_kl=0.0: allowed finite numbers > 0",
    ),
    ([*KL, "--trainer.callbacks.target_kl=-1e-3"], ConfigError, r"target_kl=-0.001: allowed finite numbers > 0"),
    (
        ["--model.engine", "logra_lightning.rollout.VLLMEngineSpec", "--model.engine.init_args.max_model_len", "5"],
        ConfigError,
        r"model.engine.init_args.max_model_len=5: allowed null or integers > model.max_new_tokens=5",
    ),
    (  # any constructor's ValueError
        ["--trainer.callbacks+=logra_lightning.callbacks.LowRankWeightSync", "--trainer.callbacks.full_sync_every=-1"],
        ConfigError,
        r"invalid config value: ValueError: Invalid full_sync_every: -1",
    ),
    (
        [*LORA, "--model.optimizer", "logra_lightning.optim.LoGRA", "--model.optimizer.rank", "4"],
        ConfigError,
        r"LoGRA does not train LoRA factors",
    ),
    (
        [*LORA, "--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy"],
        ConfigError,
        r"LoRA under FSDP2 is not supported",
    ),
    ([*LORA, "--model.adapter.rank", "0"], ConfigError, r"model.adapter.init_args.rank=0"),
]


@pytest.mark.parametrize("args, error, match", BAD_VALUES)
def test_a_bad_value_fails_before_a_model_is_built(args, error, match, tmp_path, capsys):
    (tmp_path / "FILE").write_text("x")
    args = [str(tmp_path / "FILE") if a == "FILE" else a for a in args]
    config = [] if args[0] == "--config" else ["--config", CONFIG]
    assert re.search(match, console(["fit", *config, *args], capsys, error))


@pytest.mark.parametrize(
    "argv, match",
    [
        ([], r"a command is required: fit, validate, test, plan, export, serve, generate or configs"),
        (["fti"], r"invalid choice: 'fti'"),
    ],
)
def test_bad_subcommand(argv, match, capsys):
    assert re.search(match, console(argv, capsys))


# ------------------------------------------------------------------ model paths
def _model_case(kind: str, tmp: Path, good: Path) -> str:
    if kind == "missing":
        return str(tmp / "no_such_model")
    if kind == "file":
        (tmp / "model.bin").write_bytes(b"x")
        return str(tmp / "model.bin")
    if kind == "empty":
        (tmp / "empty").mkdir()
        return str(tmp / "empty")
    if kind == "not_a_model":
        (tmp / "notes").mkdir()
        (tmp / "notes" / "readme.txt").write_text("hi")
        return str(tmp / "notes")
    if kind == "parent_of_model":
        (tmp / "outer").mkdir()
        _copy_model(good, tmp / "outer" / "inner")
        return str(tmp / "outer")
    if kind == "run_dir":
        (tmp / "run" / "version_0" / "checkpoints").mkdir(parents=True)
        (tmp / "run" / "version_0" / "checkpoints" / "last.ckpt").write_bytes(b"x")
        return str(tmp / "run")
    edits = {
        "bad_json": ((), {"config.json": '{"model_type": "qwen2",\n  oops}'}),
        "no_model_type": ((), {"config.json": "{}"}),
        "unknown_model_type": ((), {"config.json": '{"model_type": "qwen99"}'}),
        "not_causal_lm": ((), {"config.json": '{"model_type": "vit"}'}),
        "no_weights": (("model.safetensors",), None),
        "truncated_weights": ((), {"model.safetensors": (good / "model.safetensors").read_bytes()[:5000]}),
        "no_tokenizer": (("tokenizer.json", "tokenizer_config.json"), None),
        "missing_shard": (
            ("model.safetensors",),
            {"model.safetensors.index.json": json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})},
        ),
    }
    drop, edit = edits[kind]
    return str(_copy_model(good, tmp / kind, drop, edit))


MODEL_CASES = [
    ("missing", r"no such directory \(.* exists and holds: .*\); point it to a local Hugging Face model directory"),
    ("file", r"is a file, not a directory"),
    ("empty", r"the directory is empty .*hf download"),
    ("not_a_model", r"no config.json, so not a Hugging Face model directory \(it holds: readme.txt\)"),
    ("parent_of_model", r"no config.json.*did you mean '.*inner'"),
    ("run_dir", r"looks like a training run; export its checkpoint first: logra export"),
    ("bad_json", r"config.json:2 is not valid JSON"),
    ("no_model_type", r"config.json has no 'model_type'"),
    ("unknown_model_type", r"model_type 'qwen99' in config.json is not known to transformers"),
    ("not_causal_lm", r"model_type 'vit' is not a causal language model"),
    ("no_weights", r"no weights \(one of \['model.safetensors'"),
    ("truncated_weights", r"model.safetensors \(5000 bytes\) is not a readable safetensors file"),
    ("no_tokenizer", r"no tokenizer files"),
    ("missing_shard", r"lists 1 weight shards, 1 missing"),
]


@pytest.mark.parametrize("kind, match", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_bad_model_path(kind, match, tmp_path, model_dir, capsys):
    line = console(["fit", "--config", CONFIG, "--model.model", _model_case(kind, tmp_path, model_dir)], capsys)
    assert line.startswith("logra: error: model.model='") and re.search(match, line), line


@pytest.mark.parametrize(
    "spec, match",
    [
        (
            "Qwen/Not-Cached-Model",
            r"not in the local Hugging Face cache .*HF_HUB_OFFLINE is set.*hf download Qwen/Not-Cached-Model",
        ),
        ("builtin:arithmetic-huge", r"unknown built-in model; choose one of \['arithmetic-tiny'"),
        ("", r"expected a model name or path"),
    ],
)
def test_bad_model_name(spec, match, capsys):
    assert re.search(match, console(["fit", "--config", CONFIG, "--model.model", spec], capsys))


def test_good_model_dir_passes_the_check(model_dir):
    from logra_lightning.config.model_spec import check_model_spec

    check_model_spec(str(model_dir))  # a directory build_tiny_model wrote is a model


# ------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def real_ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "real.ckpt"
    torch.save({"state_dict": {"policy.w": torch.randn(64, 64)}, "hyper_parameters": {"model": "x"}}, path)
    return path


def _ckpt_case(kind: str, tmp: Path, real: Path) -> str:
    if kind == "missing":
        return str(tmp / "last.ckpt")
    if kind == "empty":
        (tmp / "e.ckpt").write_bytes(b"")
        return str(tmp / "e.ckpt")
    if kind == "text":
        (tmp / "t.ckpt").write_text("not a checkpoint\n")
        return str(tmp / "t.ckpt")
    if kind == "truncated":
        (tmp / "half.ckpt").write_bytes(real.read_bytes()[: real.stat().st_size // 2])
        return str(tmp / "half.ckpt")
    if kind == "plain_dir":
        (tmp / "d").mkdir()
        return str(tmp / "d")
    import torch.distributed.checkpoint as dcp

    dcp.save({"state_dict": {"policy.w": torch.ones(4)}}, checkpoint_id=str(tmp / "dist.ckpt"))
    if kind == "dist_missing_shard":
        next((tmp / "dist.ckpt").glob("*.distcp")).unlink()
    return str(tmp / "dist.ckpt")


CKPT_CASES = [
    ("missing", r"--ckpt_path .*last.ckpt: no such file or directory; resume with --ckpt_path last"),
    ("empty", r"the file is empty"),
    ("text", r"not a PyTorch checkpoint, or truncated"),
    ("truncated", r"not a PyTorch checkpoint, or truncated|damaged checkpoint"),
    ("plain_dir", r"a directory but not a distributed checkpoint \(no .metadata file\)"),
    ("dist_missing_shard", r"distributed checkpoint is incomplete, 1 of 1 files missing"),
    ("dist_wrong_strategy", r"a distributed \(FSDP2\) checkpoint, which only ModelParallelStrategy can resume"),
]


@pytest.mark.parametrize("kind, match", CKPT_CASES, ids=[c[0] for c in CKPT_CASES])
def test_bad_ckpt_path(kind, match, tmp_path, real_ckpt, capsys):
    line = console(["fit", "--config", CONFIG, "--ckpt_path", _ckpt_case(kind, tmp_path, real_ckpt)], capsys)
    assert re.search(match, line), line


def test_whole_checkpoint_passes_the_check(real_ckpt):
    check_checkpoint_path(real_ckpt)


# ------------------------------------------------------------------ data files
DATA_CASES = [
    ("missing", None, r"/no/such/data.jsonl: data file not found \(JSONLSource.path\)"),
    ("dir", "DIR", r"is a directory, not a data file"),
    (
        "bad_json",
        '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=" "answer": "4"}\n',
        r"data.jsonl:2: invalid JSON",
    ),
    ("missing_field", '{"prompt": "1+1="}\n', r"data.jsonl:1: missing field\(s\) \['answer'\]"),
    ("null_field", '{"prompt": null, "answer": "2"}\n', r"data.jsonl:1: field\(s\) \['prompt'\] are null"),
    ("empty", "", r"data.jsonl: no records \(the file is empty\)"),
    ("binary", b'{"prompt": "\xff", "answer": "1"}\n', r"data.jsonl:1: not valid UTF-8"),
]


@pytest.mark.parametrize("name, text, match", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_data_file(name, text, match, tmp_path, capsys):
    path = "/no/such/data.jsonl" if text is None else tmp_path / "data.jsonl"
    if text == "DIR":
        path.mkdir()
    elif isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    args = [
        "fit",
        "--config",
        CONFIG,
        "--data.train",
        "logra_lightning.data.JSONLSource",
        "--data.train.path",
        str(path),
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "runs"),
    ]
    assert re.search(match, console(args, capsys))


def test_vllm_engine_without_vllm(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    line = console(["fit", "--config", CONFIG, "--model.engine", "logra_lightning.rollout.VLLMEngineSpec"], capsys)
    assert "vLLM is not installed; `pip install vllm`" in line and "HFEngineSpec" in line


# ------------------------------------------------------------------ the console itself
def _logra_at_once(commands: list[tuple[list[str], dict]]) -> list[subprocess.CompletedProcess]:
    """``python -m logra_lightning ARGS`` for each (ARGS, extra env), all started together: each is mostly imports."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "logra_lightning", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**env, **extra},
        )
        for args, extra in commands
    ]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


CONSOLE_CASES = [
    (["fit", "--config", "configs/no_such.yaml"], "logra: error: --config configs/no_such.yaml: no such file"),
    (
        ["fit", "--config", CONFIG, "--model.model", "/no/such/model"],
        "logra: error: model.model='/no/such/model': no such",
    ),
    (
        ["export", "--ckpt_path", "/no/such.ckpt", "--out", "/nonexistent-dir/x"],
        "logra: error: --ckpt_path /no/such.ckpt: no such",
    ),
]


@pytest.mark.parametrize("args, match", CONSOLE_CASES, ids=["config", "model", "export"])
def test_each_kind_of_mistake_is_one_line(args, match, capsys):
    assert match in console(args, capsys)


def test_console_prints_one_line_and_exits_2(tmp_path):
    """Mistakes as the console meets them, in real processes: exit status 2, one ``logra: error:`` line, no
    traceback. The first passes a file that is not a checkpoint as ``--ckpt_path``; the second is not offline, but the
    hub is unreachable (a closed local port) and the cache empty: nothing is downloaded."""
    hub = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    hub_args = ["fit", "--config", CONFIG, "--model.model", "Qwen/Qwen2.5-0.5B-Instruct"]
    ckpt_proc, hub_proc = _logra_at_once([(["fit", "--config", CONFIG, "--ckpt_path", __file__], {}), (hub_args, hub)])
    for proc in (ckpt_proc, hub_proc):
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in ckpt_proc.stderr.splitlines() if line.startswith("logra: error:")]
    assert len(lines) == 1 and "not a PyTorch checkpoint" in lines[0], ckpt_proc.stderr[-2000:]
    line = next(line for line in hub_proc.stderr.splitlines() if line.startswith("logra: error:"))
    assert "the hub cannot be reached" in line and "hf download Qwen/Qwen2.5-0.5B-Instruct" in line, line
    assert not list((tmp_path / "hf").glob("**/*.safetensors"))


# ------------------------------------------------------------------ properties
@fast(25)
@given(st.one_of(st.text(max_size=80), st.binary(max_size=80)))
def test_any_broken_config_file_is_one_line(tmp_path_factory, capsys, content):
    path = tmp_path_factory.mktemp("cfg") / "random.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = console(["fit", "--config", str(path)], capsys)  # no data.train, at least: never a valid config
    assert line.startswith("logra: error: ")


_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), st.text(max_size=6))
_TREE = st.recursive(
    _LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@fast(25)
@given(
    st.dictionaries(
        st.sampled_from(["trainer", "model", "data", "seed_everything", "ckpt_path", "optimizer", "x"]),
        _TREE,
        min_size=1,
        max_size=4,
    )
)
def test_any_malformed_config_mapping_is_one_line(tmp_path_factory, capsys, doc):
    path = tmp_path_factory.mktemp("cfg") / "random.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    assert console(["fit", "--config", str(path)], capsys).startswith("logra: error: ")


BAD_VALUES = {  # key -> values that are wrong for it (type or range)
    "trainer.max_steps": st.one_of(
        st.text(min_size=1, max_size=8).filter(lambda s: not s.strip().lstrip("-").isdigit()),
        st.lists(st.integers(), min_size=1, max_size=2),
    ),
    "data.batch_size": st.one_of(st.integers(-5, 0), st.text(alphabet="abc", min_size=1, max_size=5)),
    "model.group_size": st.integers(-5, 0),
    "model.max_new_tokens": st.integers(-5, 0),
    "model.top_p": st.floats(1.01, 10) | st.floats(-10, 0),
    "model.model": st.one_of(
        st.just(""),
        st.text(alphabet="abc/._-", min_size=1, max_size=12).map(lambda s: "./" + s),
        st.from_regex(r"\Abuiltin:[a-z]{1,6}\Z"),
    ),
    "model.optimizer.init_args.lr": st.floats(max_value=-1e-9) | st.sampled_from([float("nan"), float("inf")]),
}


@fast(30)
@given(st.sampled_from(sorted(BAD_VALUES)).flatmap(lambda k: st.tuples(st.just(k), BAD_VALUES[k])))
def test_any_single_bad_value_is_one_line(tmp_path_factory, capsys, key_value):
    key, value = key_value
    override = tmp_path_factory.mktemp("cfg") / "override.yaml"
    node: dict = {}
    parts = key.split(".")
    cur = node
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    # JSON is YAML, so the value keeps its type; unescaped, as PyYAML reads no JSON surrogate-pair escapes (\ud806)
    override.write_text(json.dumps(node, ensure_ascii=False), encoding="utf-8")
    line = console(["fit", "--config", CONFIG, "--config", str(override)], capsys)
    assert parts[-1] in line or key in line or "model" in line, line


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.binary(max_size=300))
def test_any_damaged_checkpoint_bytes_fail_with_a_config_error(data):
    import tempfile

    path = Path(tempfile.mkdtemp()) / "x.ckpt"
    path.write_bytes(data)
    try:
        check_checkpoint_path(path)
    except ConfigError as err:
        assert str(err).startswith(f"--ckpt_path {path}: ") and "\n" not in str(err)
    else:  # only a pickle could pass (b"\x80" first: pre-zip torch.save files); Lightning then reads it
        assert data[:1] == b"\x80"


@fast(15)
@given(st.lists(st.one_of(st.binary(max_size=30), st.text(max_size=30).map(str.encode)), min_size=1, max_size=4))
def test_any_bad_data_lines_are_one_line(tmp_path_factory, capsys, lines):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    body = b"\n".join(line.replace(b"\n", b" ") for line in lines) + b"\n"
    path.write_bytes(body)
    try:  # the lines may happen to be valid records: then this example says nothing
        from logra_lightning.data import JSONLSource

        JSONLSource(str(path)).load()
        return
    except LograError:
        pass
    args = [
        "fit",
        "--config",
        CONFIG,
        "--data.train",
        "logra_lightning.data.JSONLSource",
        "--data.train.path",
        str(path),
        "--trainer.logger.init_args.save_dir",
        str(path.parent / "runs"),
    ]
    line = console(args, capsys)
    assert line.startswith(f"logra: error: {path}"), line


# ------------------------------------------------------------ resuming with another config
LOGRA_CONFIG = str(ROOT / "configs" / "arithmetic_tiny_logra.yaml")


@pytest.mark.parametrize(
    "groups, config, match",
    [
        (
            [{"params": [0, 1], "lr": 1e-4}],
            LOGRA_CONFIG,
            r"its optimizer state was written by a dense optimizer \(no low-rank groups\), "
            r"but model.optimizer is LoGRA "
            r"with rank 16; resume with the optimizer settings that wrote it",
        ),
        (
            [{"params": [0], "rank": 16}, {"params": [1], "rank": None}],
            CONFIG,
            r"written by LoGRA \(rank 16\), but model.optimizer is AdamW \(dense\)",
        ),
        (
            [{"params": [0], "rank": 8}, {"params": [1], "rank": None}],
            LOGRA_CONFIG,
            r"its LoGRA state has rank 8, but model.optimizer.init_args.rank=16; .*logra export --ckpt_path",
        ),
    ],
    ids=["adamw_ckpt_logra_config", "logra_ckpt_adamw_config", "other_rank"],
)
def test_resume_with_another_optimizer(groups, config, match, tmp_path, capsys):
    """Before: 'loaded state dict has a different number of parameter groups' from deep inside Lightning."""
    path = tmp_path / "run.ckpt"
    torch.save(
        {
            "state_dict": {},
            "optimizer_states": [{"state": {}, "param_groups": groups}],
            "hyper_parameters": {"model": "builtin:arithmetic-tiny"},
        },
        path,
    )
    assert re.search(match, console(["fit", "--config", config, "--ckpt_path", str(path)], capsys))


def test_resume_says_which_settings_the_checkpoint_replaces(tmp_path, monkeypatch):
    from logra_lightning.cli import lightning_cli as cli

    said = []
    monkeypatch.setattr(cli, "rank_zero_warn", said.append)
    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"model": "builtin:arithmetic-tiny", "group_size": 4}}, path)
    with pytest.raises(AssertionError, match="a model was built"):  # the check runs, then the (forbidden) build
        run(["fit", "--config", CONFIG, "--model.group_size", "8", "--ckpt_path", str(path)])
    assert len(said) == 1 and "replace model.group_size=8 (now 4)" in said[0], said
