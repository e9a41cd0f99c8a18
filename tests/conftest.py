"""Shared fixtures and helpers: the built-in tiny policy (built once, cached in .cache/logra), thread settings,
"no model may be built" for start-up checks, the flags of a tiny ``logra fit`` run, the console's error line, and a
tiny random Qwen2.

Test modules import the helpers as ``from conftest import tiny_run`` (pytest puts tests/ on the path).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers.logger import Logger

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("LOGRA_CACHE_DIR", str(ROOT / ".cache" / "logra"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


# Modules that compare two computation paths in floating point (fast vs reference optimizer, engine vs HF copy,
# chunked vs whole logits, sharded or data-parallel vs one process, resumed vs uninterrupted) or that train on
# the built-in policy, which is warmed up on the machine that runs the suite and so differs by CPU. `make
# test-isa` runs them under other CPU code paths (MKL_CBWR, ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY).
NUMERICS_MODULES = {
    "test_architectures",
    "test_chunked_logprobs",
    "test_clipping",
    "test_ddp",
    "test_export",
    "test_faults",
    "test_fsdp2",
    "test_fsdp_lightning",
    "test_grad_features",
    "test_kl_control",
    "test_lora",
    "test_multinode",
    "test_optim_logra",
    "test_pi_old",
    "test_resume",
    "test_rounding",
    "test_token_budget",
    "test_vllm_engine",
    "test_vllm_server",
    "test_weight_sync",
}


# Seconds each test file took (setup and teardown included), written by `make test-durations`. `make test` hands
# whole files to its workers in collection order (`--dist loadfile --no-loadscope-reorder`); see _file_order.
DURATIONS = Path(__file__).with_name("durations.json")
_spent: dict[str, float] = {}


def pytest_addoption(parser) -> None:
    parser.addoption("--record-durations", action="store_true", help=f"write each file's seconds to {DURATIONS}")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module = getattr(item, "module", None)  # None for items that are not Python test functions
        if module is not None and module.__name__.rsplit(".", 1)[-1] in NUMERICS_MODULES:
            item.add_marker(pytest.mark.numerics)
    items[:] = _file_order(items)


def _file_order(items: list) -> list:
    """The items file by file, longest file first: a long vLLM file handed out last is a tail one worker runs alone.

    While the warmed-up policy is not built (a fresh clone: ~160 s of one core), the longest file that needs it
    (its tests take ``tiny_policy_path``) goes first, so one worker builds it at once, and the files that do not
    need it come next, so the other worker runs them instead of waiting on the build's file lock.
    """
    from logra_lightning.builtin import is_built

    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(files, key=lambda f: -seconds.get(f, 0.0))
    needs = [f for f in order if any("tiny_policy_path" in getattr(i, "fixturenames", ()) for i in files[f])]
    if needs and not is_built("builtin:arithmetic-tiny"):
        order = [needs[0], *(f for f in order if f not in needs), *needs[1:]]
    return [item for f in order for item in files[f]]


def pytest_runtest_logreport(report) -> None:
    file = report.nodeid.split("::")[0]
    _spent[file] = _spent.get(file, 0.0) + report.duration


def pytest_sessionfinish(session) -> None:
    config = session.config
    if config.getoption("--record-durations") and not hasattr(config, "workerinput") and _spent:
        old = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}  # files this run did not run stay
        new = {**old, **{f: round(s, 1) for f, s in _spent.items()}}
        DURATIONS.write_text(json.dumps(dict(sorted(new.items())), indent=0) + "\n")


@pytest.fixture(scope="session")
def tiny_policy_path() -> str:
    """The warmed-up ``builtin:arithmetic-tiny`` policy directory (the demo's base model)."""
    from logra_lightning.builtin import resolve_model

    return resolve_model("builtin:arithmetic-tiny")


@pytest.fixture(scope="session")
def raw_tiny_path() -> str:
    """A randomly initialised tiny Qwen2 directory (no warm-up)."""
    from logra_lightning.builtin import resolve_model

    return resolve_model("builtin:arithmetic-tiny-raw")


@pytest.fixture
def no_model_built(monkeypatch):
    """Fail the test if it gets as far as building a model: start-up checks must come before the (slow) build."""
    import logra_lightning.rl.module as module

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was built before the input was validated")

    monkeypatch.setattr(module, "load_policy", forbidden)
    monkeypatch.setattr(module, "resolve_model", forbidden)


def tiny_qwen2(seed: int = 0, **config):
    """A random 2-layer Qwen2 (hidden 32, vocab 50); ``config`` overrides its ``Qwen2Config`` fields."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    fields = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    return Qwen2ForCausalLM(Qwen2Config(**fields, num_key_value_heads=2, vocab_size=50, **config))


def tiny_run(save_dir, steps: int = 2, *, batch_size: int = 4, group_size: int | None = 4) -> list[str]:
    """Flags that shrink any ``logra fit`` config to ``steps`` RL steps and one held-out batch, logging to save_dir."""
    flags = ["--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps)]
    flags += ["--trainer.limit_val_batches", "1", "--trainer.logger.init_args.save_dir", str(save_dir)]
    flags += ["--data.batch_size", str(batch_size)]
    return flags + ([] if group_size is None else ["--model.group_size", str(group_size)])


def console(argv: list[str], capsys, error: type[BaseException] | None = None) -> str:
    """Run ``logra <argv>`` in-process as the console does; return its one ``logra: error:`` line.

    ``error``, when given, is the exception ``main`` must raise (``SystemExit`` for a command line that does not
    parse, a :class:`~logra_lightning.errors.LograError` subclass for a bad value).
    """
    from logra_lightning.cli import run
    from logra_lightning.cli.main import error_line
    from logra_lightning.errors import LograError

    capsys.readouterr()
    try:
        run(argv)
    except SystemExit as exit_:
        assert exit_.code == 2
        raised, err = exit_, capsys.readouterr().err
    except LograError as exc:  # run(args) lets these propagate; the console prints error_line(exc)
        raised, err = exc, capsys.readouterr().err + error_line(exc) + "\n"
    else:
        pytest.fail(f"no error for {argv}")
    assert error is None or isinstance(raised, error), f"{type(raised).__name__}, not {error.__name__}: {raised}"
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("logra: error:")]
    assert len(lines) == 1, err
    return lines[0]


def hf_greedy_answers(model, tokenizer, prompts: list[str], max_tokens: int = 5) -> list[str]:
    """Stripped greedy answers of a transformers model (the in-process HF engine), for comparing with vLLM's."""
    from logra_lightning.rollout import HFEngine
    from logra_lightning.rollout.greedy import greedy_completions

    texts = greedy_completions(
        HFEngine(model, tokenizer), tokenizer, prompts, max_new_tokens=max_tokens, batch_size=128
    )
    return [t.strip() for t in texts]


def vllm_greedy_answers(model_dir, prompts: list[str], max_tokens: int = 5) -> list[str]:
    """Greedy answers of a plain ``vllm.LLM(model=DIR)`` (own tokenizer, text prompts), as ``vllm serve`` does."""
    import vllm

    llm = vllm.LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=64,
        kv_cache_memory_bytes=1 << 30,
    )
    try:
        outs = llm.generate(prompts, vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        return [o.outputs[0].text.strip() for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()


class ListLogger(Logger):
    """Keeps every ``log_metrics`` call in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))

    def series(self, key: str) -> list[float]:
        return [m[key] for _, m in self.rows if key in m]
