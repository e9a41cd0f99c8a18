"""The base policy of the demo: a tiny Qwen2 given a short supervised warm-up, cached.

RL post-training starts from a model that is sometimes right. The built-in model
``builtin:arithmetic-tiny`` is a randomly initialised tiny Qwen2
(:func:`~logra_lightning.models.build_tiny_model`) trained for a few hundred AdamW
steps on the train split of the arithmetic task (loss on answer tokens only). The result
is a normal HF directory cached under ``$LOGRA_CACHE_DIR`` (default ``.cache/logra``),
keyed by a hash of every setting, and deterministic for a seed on one machine.

**Sloppy demonstrations.** The warm-up data imitate demonstrations written carelessly on
the harder problems: 90% of the answers whose ones digits carry (``37+48=`` -> ``85.``)
and 10% of the others end in a stray ``.``, which the exact-match reward rejects. The
warmed-up policy can add (with the ``.`` ignored, 98.8% of held-out greedy answers are
right) but copies the habit, so its held-out greedy accuracy is 57.8% and its sampled
(T=1) accuracy 54%: RL has to find, from the reward alone, which of two behaviours the
model already has is wanted. That is the situation RL post-training of LLMs is mostly in
(it sharpens behaviour the model can already produce; see the README for numbers).
``builtin:arithmetic-tiny-clean`` is the same warm-up on clean answers (600 steps:
41.0% held-out greedy); measured here, 200 RL steps did not raise its greedy accuracy in
any setting tried (README, "What RL does on a clean warm-up").

Run it alone: ``python -m logra_lightning.warmup`` (prints the path and accuracy).

Example::

    >>> from logra_lightning.warmup import BUILTIN_MODELS
    >>> sorted(BUILTIN_MODELS)
    ['arithmetic-tiny', 'arithmetic-tiny-clean', 'arithmetic-tiny-gemma3', 'arithmetic-tiny-llama', 'arithmetic-tiny-raw', 'reasoning-20m', 'reasoning-20m-stage1']
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator

import torch

from logra_lightning.data.arithmetic import ArithmeticSource, ones_carry
from logra_lightning.errors import ConfigError
from logra_lightning.models import TinyModelConfig, build_tiny_model, load_policy
from logra_lightning.reasoning_policy import ReasoningWarmupConfig

BUILTIN_PREFIX = "builtin:"
WARMUP_VERSION = 3  # bump when the warm-up code changes its result


@dataclass
class WarmupConfig:
    """Supervised warm-up on the arithmetic train split. ``steps=0`` keeps the random init."""

    steps: int = 600
    lr: float = 1e-3  # peak; linear warm-up over `lr_warmup` steps, then cosine decay to 0
    lr_warmup: int = 50
    batch_size: int = 64
    seed: int = 0
    max_digits: int = 2
    ops: str = "+"
    test_size: int = 256
    # Sloppy demonstrations (see the module doc): the share of answers written with `noise_suffix`,
    # for problems whose ones digits carry/borrow and for the others.
    format_noise: tuple[float, float] = (0.0, 0.0)
    noise_suffix: str = "."
    model: TinyModelConfig = field(default_factory=TinyModelConfig)


# Measured here (1 thread, clean answers): hidden 128 reached only 6-11% held-out accuracy after
# 300-1200 warm-up steps; hidden 256 reached 13% after 450, 41% after 600 (of 800) and 67% after 800.
# With the sloppy answers, hidden 256: 800 steps -> 57.8% greedy (98.8% ignoring the "."),
# 1000 steps -> 57.8% (100%); uniform noise instead (every answer, p=0.5 / 0.7, 1000 steps) gave
# 34.8% / 0.0% greedy, as the argmax then takes the same side on nearly every problem.
ARITHMETIC_TINY = TinyModelConfig(hidden_size=256, num_heads=4, num_kv_heads=4, intermediate_size=704, num_layers=4)

BUILTIN_MODELS: dict[str, WarmupConfig | ReasoningWarmupConfig] = {
    "arithmetic-tiny": WarmupConfig(steps=800, format_noise=(0.9, 0.1), model=ARITHMETIC_TINY),
    "arithmetic-tiny-clean": WarmupConfig(model=ARITHMETIC_TINY),
    "arithmetic-tiny-raw": WarmupConfig(steps=0),
    # The same demo on other families (configs/arithmetic_tiny_{llama,gemma3}.yaml): same sizes and warm-up.
    "arithmetic-tiny-llama": WarmupConfig(steps=800, format_noise=(0.9, 0.1),
                                          model=replace(ARITHMETIC_TINY, architecture="llama")),
    "arithmetic-tiny-gemma3": WarmupConfig(steps=800, format_noise=(0.9, 0.1),
                                           model=replace(ARITHMETIC_TINY, architecture="gemma3", tie_word_embeddings=True)),
    # ~20M Llama, BPE tokenizer, three reasoning tasks (logra_lightning.reasoning_policy; benchmarks/reasoning_tasks.py):
    # a first stage of 1200 steps, then 800 more from its weights (module doc, "Cost and result")
    "reasoning-20m-stage1": ReasoningWarmupConfig(),
    "reasoning-20m": ReasoningWarmupConfig(init_from="reasoning-20m-stage1", steps=800, lr=1e-3, lr_warmup=20),
}


def cache_dir() -> Path:
    return Path(os.environ.get("LOGRA_CACHE_DIR", ".cache/logra")).expanduser()


def _key(cfg: WarmupConfig | ReasoningWarmupConfig) -> str:
    base = getattr(cfg, "init_from", None)  # a second stage: its key changes with its first stage's
    blob = json.dumps({"v": WARMUP_VERSION, **asdict(cfg), **({"init_key": _key(BUILTIN_MODELS[base])} if base else {})},
                      sort_keys=True)  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@contextlib.contextmanager
def _build_lock(target: Path, spec: str) -> Iterator[None]:
    """Hold an exclusive lock on ``<target>.lock`` (released when the process dies, however it dies).

    Without it every process that starts while the cache is empty (DDP ranks, parallel test
    workers, two ``logra fit`` runs) warms up its own copy, each slower for the others.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[logra] waiting for another process to finish building {spec} in {target.parent}", flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_stale_builds(target: Path) -> None:
    """Remove ``<target>.tmp<pid>`` directories left by builds whose process is gone (killed mid-build)."""
    for tmp in target.parent.glob(target.name + ".tmp*"):
        pid = tmp.name.rsplit(".tmp", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(tmp, ignore_errors=True)


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """LR multiplier: linear ramp over ``warmup`` steps, then cosine from 1 to 0 at ``total``."""
    ramp = min(1.0, (step + 1) / max(warmup, 1))
    return ramp * 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


def sft_batch(tokenizer, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + answer + EOS`` ids, attention mask and labels (-100 outside the answer)."""
    rows, labels = [], []
    for r in records:
        p = tokenizer.encode(r["prompt"])
        a = tokenizer.encode(r["answer"]) + [tokenizer.eos_token_id]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # [B, L]
    lab = torch.full((len(rows), width), -100, dtype=torch.long)  # [B, L]
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, lr) in enumerate(zip(rows, labels)):
        ids[i, : len(row)] = torch.tensor(row)
        lab[i, : len(lr)] = torch.tensor(lr)
        mask[i, : len(row)] = 1
    return ids, mask, lab


@torch.no_grad()
def greedy_completions(model, tokenizer, records: list[dict], max_new_tokens: int = 6, batch_size: int = 128) -> list[str]:
    """Stripped greedy completions of ``records``' prompts (HF ``generate``)."""
    from logra_lightning.rollout.base import SamplingConfig
    from logra_lightning.rollout.hf import HFEngine

    engine, texts = HFEngine(model, tokenizer), []
    for i in range(0, len(records), batch_size):
        chunk = records[i : i + batch_size]
        out = engine.generate([tokenizer.encode(r["prompt"]) for r in chunk], n=1,
                              sampling=SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0))  # fmt: skip
        texts += [t.strip() for t in out.texts]
    return texts


def _answer_share(texts: list[str], records: list[dict], suffix: str = "") -> float:
    """Fraction of ``texts`` equal to their record's answer (or, with ``suffix``, the answer plus it)."""
    return sum(t in (r["answer"], r["answer"] + suffix) for t, r in zip(texts, records)) / len(records)


def greedy_accuracy(model, tokenizer, records: list[dict], max_new_tokens: int = 6, batch_size: int = 128) -> float:
    """Fraction of ``records`` whose greedy completion equals the answer."""
    return _answer_share(greedy_completions(model, tokenizer, records, max_new_tokens, batch_size), records)


def warm_up(path: str | Path, cfg: WarmupConfig) -> dict:
    """Build the tiny model at ``path`` and train it on the task; return a summary dict."""
    build_tiny_model(path, cfg.model)
    model, tok = load_policy(str(path))
    train = ArithmeticSource("train", cfg.max_digits, cfg.ops, cfg.test_size, cfg.seed).load()
    test = ArithmeticSource("test", cfg.max_digits, cfg.ops, cfg.test_size, cfg.seed).load()
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, cfg.lr_warmup, cfg.steps))
    model.train()
    start, loss = time.perf_counter(), float("nan")
    noise = [cfg.format_noise[0 if ones_carry(r["prompt"]) else 1] for r in train]  # per train problem
    for _ in range(cfg.steps):
        records = [dict(train[i], answer=train[i]["answer"] + cfg.noise_suffix) if rng.random() < noise[i] else train[i]
                   for i in rng.sample(range(len(train)), cfg.batch_size)]  # fmt: skip
        ids, mask, labels = sft_batch(tok, records)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        loss = out.loss.item()
    model.eval()
    texts = greedy_completions(model, tok, test)
    summary = {"steps": cfg.steps, "final_loss": loss, "seconds": time.perf_counter() - start,
               "test_accuracy": _answer_share(texts, test)}  # fmt: skip
    if any(cfg.format_noise):
        summary["test_accuracy_ignoring_suffix"] = _answer_share(texts, test, suffix=cfg.noise_suffix)
    model.save_pretrained(path, safe_serialization=True)
    (Path(path) / "warmup.json").write_text(json.dumps({"config": asdict(cfg), **summary}, indent=2))
    return summary


def resolve_model(spec: str) -> str:
    """Turn a model spec into a path or hub name ``transformers`` can load.

    ``builtin:<name>`` (see :data:`BUILTIN_MODELS`) builds and warms up the model once
    and returns its cached directory; anything else is returned unchanged.

    Raises:
        ConfigError: an unknown ``builtin:`` name.
    """
    if not spec.startswith(BUILTIN_PREFIX):
        return spec
    name = spec[len(BUILTIN_PREFIX) :]
    if name not in BUILTIN_MODELS:
        raise ConfigError(f"model={spec!r}: unknown built-in model; choose one of {sorted(BUILTIN_MODELS)}")
    cfg = BUILTIN_MODELS[name]
    target = cache_dir() / f"{name}-{_key(cfg)}"
    if (target / "warmup.json").exists():
        return str(target)
    with _build_lock(target, spec):  # one process builds; the others (ranks, parallel runs) wait for it
        if (target / "warmup.json").exists():
            return str(target)
        _remove_stale_builds(target)
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny model: 1 thread is several times faster here (docs/design.md §7)
        try:
            summary = cfg.warm_up(tmp) if isinstance(cfg, ReasoningWarmupConfig) else warm_up(tmp, cfg)
        finally:
            torch.set_num_threads(threads)
        shutil.rmtree(target, ignore_errors=True)  # a directory without warmup.json is an unfinished build
        tmp.rename(target)  # atomic: a half-written directory is never picked up
    print(f"[logra] built {spec} at {target}: warm-up {summary['seconds']:.0f}s, "
          f"held-out greedy accuracy {summary['test_accuracy']:.1%}"
          + (f" ({summary['test_accuracy_ignoring_suffix']:.1%} ignoring a trailing {cfg.noise_suffix!r})"
             if "test_accuracy_ignoring_suffix" in summary else ""))  # fmt: skip
    return str(target)


if __name__ == "__main__":
    print(resolve_model("builtin:arithmetic-tiny"))
