"""The demo's base policy: a tiny Qwen2 (or Llama, Gemma 3) given a short supervised warm-up on arithmetic.

``builtin:arithmetic-tiny`` is a randomly initialised tiny model
(:func:`~logra_lightning.models.build_tiny_model`) trained for a few hundred AdamW steps on the
train split of the arithmetic task (loss on answer tokens only), then saved as a normal HF
directory by :mod:`~logra_lightning.builtin.registry`.

**Sloppy demonstrations.** The warm-up data imitate demonstrations written carelessly on
the harder problems: 90% of the answers whose ones digits carry (``37+48=`` -> ``85.``)
and 10% of the others end in a stray ``.``, which the exact-match reward rejects. The
warmed-up policy can add (with the ``.`` ignored, 98.8% of held-out greedy answers are
right) but copies the habit, so its held-out greedy accuracy is about 57% and its sampled
(T=1) accuracy 54%: RL has to find, from the reward alone, which of two behaviours the
model already has is wanted. That is the situation RL post-training of LLMs is mostly in
(it sharpens behaviour the model can already produce; docs/results.md has the numbers).
``builtin:arithmetic-tiny-clean`` is the same warm-up on clean answers (600 steps:
41.0% held-out greedy); 200 RL steps did not raise its greedy accuracy in any setting tried
(docs/results.md, "What RL does on a clean warm-up").
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from logra_lightning.builtin.sft import sft_loop
from logra_lightning.data.arithmetic import ArithmeticSource, ones_carry
from logra_lightning.models import TinyModelConfig, build_tiny_model, load_policy
from logra_lightning.rollout.greedy import greedy_completions
from logra_lightning.rollout.hf import HFEngine


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

    def hf_config(self):
        """The transformers config of the built model (shapes only; no build, no tokenizer)."""
        return self.model.hf_config()

    def warm_up(self, path: str | Path, init_dir: str | None = None) -> dict:
        """Build and warm up at ``path`` (:func:`warm_up`); ``init_dir`` is unused (no second stage)."""
        return warm_up(path, self)


# Sizes chosen by measurement (1 thread, clean answers): hidden 128 reached only 6-11% held-out accuracy after
# 300-1200 warm-up steps; hidden 256 reached 13% after 450, 41% after 600 (of 800) and 67% after 800.
# With the sloppy answers, hidden 256: 800 steps -> 57.8% greedy (98.8% ignoring the "."),
# 1000 steps -> 57.8% (100%); uniform noise instead (every answer, p=0.5 / 0.7, 1000 steps) gave
# 34.8% / 0.0% greedy, as the argmax then takes the same side on nearly every problem.
ARITHMETIC_TINY = TinyModelConfig(hidden_size=256, num_heads=4, num_kv_heads=4, intermediate_size=704, num_layers=4)


def answer_share(texts: list[str], records: list[dict], suffix: str = "") -> float:
    """Fraction of ``texts`` (stripped) equal to their record's answer (or, with ``suffix``, the answer plus it)."""
    return sum(t.strip() in (r["answer"], r["answer"] + suffix) for t, r in zip(texts, records)) / len(records)


def warm_up(path: str | Path, cfg: WarmupConfig) -> dict:
    """Build the tiny model at ``path`` and train it on the task; return a summary dict."""
    build_tiny_model(path, cfg.model)
    model, tok = load_policy(str(path))
    train = ArithmeticSource("train", cfg.max_digits, cfg.ops, cfg.test_size, cfg.seed).load()
    test = ArithmeticSource("test", cfg.max_digits, cfg.ops, cfg.test_size, cfg.seed).load()
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    noise = [cfg.format_noise[0 if ones_carry(r["prompt"]) else 1] for r in train]  # per train problem

    def sloppy_batch(step: int) -> list[dict]:  # each answer written with the stray suffix at its problem's rate
        picked = rng.sample(range(len(train)), cfg.batch_size)
        return [
            dict(train[i], answer=train[i]["answer"] + cfg.noise_suffix) if rng.random() < noise[i] else train[i]
            for i in picked
        ]

    start = time.perf_counter()
    loss = sft_loop(model, tok, sloppy_batch, steps=cfg.steps, lr=cfg.lr, lr_warmup=cfg.lr_warmup)
    prompts = [r["prompt"] for r in test]
    texts = greedy_completions(HFEngine(model, tok), tok, prompts, max_new_tokens=6, batch_size=128)
    summary = {
        "steps": cfg.steps,
        "final_loss": loss,
        "seconds": time.perf_counter() - start,
        "test_accuracy": answer_share(texts, test),
    }
    if any(cfg.format_noise):
        summary["test_accuracy_ignoring_suffix"] = answer_share(texts, test, suffix=cfg.noise_suffix)
    model.save_pretrained(path, safe_serialization=True)
    (Path(path) / "warmup.json").write_text(json.dumps({"config": asdict(cfg), **summary}, indent=2))
    return summary
