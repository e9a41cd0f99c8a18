"""The reasoning policy: a ~20M-parameter Llama with a BPE tokenizer trained here, warmed up on three tasks.

``builtin:reasoning-20m`` is built locally, like the demo's policy (:mod:`logra_lightning.builtin.registry`),
and cached under ``$LOGRA_CACHE_DIR`` keyed by a hash of every setting:

1. **Tokenizer.** A byte-level BPE (``tokenizers``) trained on text of the three tasks
   (:func:`train_bpe_tokenizer`): digits are split one per token (as Llama and Qwen do, so
   numbers are read digit by digit), everything else is merged by BPE (``" Answer"``,
   ``" from"``, ``")*"``). Byte-level means every string round-trips, spaces and newlines
   included, under ``tokenizers``, transformers' ``AutoTokenizer`` and vLLM alike.
2. **Model.** A randomly initialised Llama (:data:`REASONING_20M`: hidden 512, 6 layers, 8 heads
   of 64, MLP 1408; 19.8M parameters), saved as a normal Hugging Face directory.
3. **Warm-up.** Supervised steps on reference completions of the three tasks mixed
   (:data:`TASKS`: chain-of-thought arithmetic, countdown, sorting), loss on completion tokens
   only, AdamW with linear warm-up and cosine decay.

**Sloppy demonstrations**, as in the demo: on each task 90% of the demonstrations of one kind
of problem (``slip_prone`` in the records: a carry in the ones column, a solution that
multiplies, a list whose smallest number is below 10) and 10% of the others end in a stray
``.``, which every task's reward rejects. The policy learns the task and the habit, so its
held-out greedy accuracy is well below what it can do (measured: ``warmup.json`` in the model
directory gives both, per task); RL has to find, from the reward alone, which of two behaviours
it already has is wanted, as RL post-training of LLMs mostly does.

Run it alone: ``python -m logra_lightning.builtin reasoning-20m`` (prints the path and accuracies).

**Problem ranges.** :data:`TASK_ARGS` sizes the tasks to what the 20M policy can learn in the warm-up
budget (2-digit arithmetic, countdown with numbers up to 12 and targets up to 60, sorting 4 numbers up to
49): on harder ranges (3-digit arithmetic, countdown up to 20/99, sorting 5 numbers up to 99) it learns
nothing a reward could select. The configs ``configs/reasoning_<task>.yaml`` ask for the same ranges (a
test checks it).

**Two stages.** ``builtin:reasoning-20m-stage1`` is 1200 steps from the random init (peak lr 2e-3);
``builtin:reasoning-20m`` continues from its weights for 800 steps (peak lr 1e-3, ``init_from``). The split
lets a longer warm-up reuse a cached first stage; building ``reasoning-20m`` from an empty cache builds both.

**What it reaches** is written to ``warmup.json`` in the model directory (loss, held-out greedy accuracy
per task with and without a trailing ``.``); the shipped settings' numbers and cost are in docs/results.md
(Reasoning tasks): arithmetic is learned with room for RL, countdown and sorting barely.

Example::

    >>> import tempfile
    >>> path = build_reasoning_model(tempfile.mkdtemp(), ReasoningWarmupConfig(model=TINY_REASONING))
    >>> from logra_lightning.models import load_policy
    >>> _, tok = load_policy(path)
    >>> text = "Make 46 from 7 25 3: 3*7=21, 25+21=46; Answer: 25+(3*7)"
    >>> tok.decode(tok.encode(text)) == text, tok.tokenize(" Answer: 25")
    (True, ['ĠAnswer', ':', 'Ġ', '2', '5'])
"""

from __future__ import annotations

import importlib
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from logra_lightning.builtin.sft import sft_loop
from logra_lightning.data.chain_arithmetic import ChainArithmeticSource
from logra_lightning.data.countdown import CountdownSource
from logra_lightning.data.sorting import SortingSource
from logra_lightning.errors import ConfigError
from logra_lightning.models import EOS, PAD, TinyModelConfig, load_policy
from logra_lightning.rollout.greedy import greedy_completions
from logra_lightning.rollout.hf import HFEngine

# task name -> (source class, reward class path)
TASKS = {
    "arithmetic": (ChainArithmeticSource, "logra_lightning.rewards.AnswerMatchReward"),
    "countdown": (CountdownSource, "logra_lightning.rewards.CountdownReward"),
    "sorting": (SortingSource, "logra_lightning.rewards.AnswerMatchReward"),
}
# The suite's problem ranges (source arguments), sized so that the 20M policy learns each task in the warm-up
# budget of this machine (module doc, "Cost"); configs/reasoning_<task>.yaml use the same
# (tests/test_reasoning_tasks.py).
TASK_ARGS = {
    "arithmetic": {"digits": 2, "ops": "+-", "train_size": 8000},
    "countdown": {"max_number": 12, "max_target": 60, "train_size": 2500},
    "sorting": {"length": 4, "max_value": 49},
}

# Head dim 64 (vLLM rejects 16). 19.8M parameters with the 512-row embedding and head.
REASONING_20M = TinyModelConfig(
    architecture="llama",
    hidden_size=512,
    num_layers=6,
    num_heads=8,
    num_kv_heads=8,
    intermediate_size=1408,
    vocab_size=512,
    max_position_embeddings=128,
)
TINY_REASONING = TinyModelConfig(
    architecture="llama",
    hidden_size=64,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=128,
)


@dataclass
class ReasoningWarmupConfig:
    """Tokenizer, model and supervised warm-up of a reasoning policy. ``steps=0`` keeps the random init."""

    steps: int = 1200  # sized to the 2-core machine (module doc, "Cost")
    lr: float = 2e-3  # peak; linear warm-up over `lr_warmup` steps, then cosine decay to 0
    lr_warmup: int = 50
    batch_size: int = 32
    seed: int = 0
    tasks: tuple[str, ...] = tuple(TASKS)
    task_args: dict[str, dict] = field(default_factory=lambda: {t: dict(a) for t, a in TASK_ARGS.items()})
    test_size: int = 256  # held-out problems per task (the sources' default: the benchmark's held-out set)
    bpe_vocab_size: int = 512  # BPE stops earlier when no pair is left to merge (about 280 on this text)
    tokenizer_texts: int = 3000  # problems per task in the tokenizer's training text
    # Sloppy demonstrations (module doc): share of completions ending in `noise_suffix`, for slip-prone problems
    # and for the others.
    format_noise: tuple[float, float] = (0.9, 0.1)
    noise_suffix: str = "."
    threads: int = 2  # torch threads of the warm-up (results differ in the last bits between thread counts)
    eval_max_new_tokens: int = 40
    model: TinyModelConfig = field(default_factory=lambda: REASONING_20M)
    # A second stage: the built-in model (a name in builtin.registry.BUILTIN_MODELS, same tokenizer settings)
    # whose weights
    # start this warm-up instead of the random init; its own lr schedule runs again from the start.
    init_from: str | None = None

    def build(self, path: str | Path) -> str:
        """Random-init model and trained tokenizer at ``path`` (what :func:`build_reasoning_model` does)."""
        return build_reasoning_model(path, self)

    def hf_config(self):
        """The transformers config of the built model (shapes only; no build, no tokenizer)."""
        return self.model.hf_config()

    def warm_up(self, path: str | Path, init_dir: str | None = None) -> dict:
        """Build and warm up at ``path``, from ``init_dir``'s weights for a second stage (:func:`warm_up_reasoning`)."""
        return warm_up_reasoning(path, self, init_dir=init_dir)


def task_records(cfg: ReasoningWarmupConfig, task: str, split: str) -> list[dict]:
    """The records of ``task``'s ``split`` with the suite's problem ranges (``cfg.task_args``)."""
    source, _ = TASKS[task]
    return source(split, **cfg.task_args.get(task, {}), test_size=cfg.test_size, seed=cfg.seed).load()


def train_bpe_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts``, digits one per token, with ``<pad>`` and ``<eos>``.

    Example::

        >>> tok = train_bpe_tokenizer(["Sort 3 1 2: Answer: 1 2 3"] * 10, vocab_size=300)
        >>> tok.decode(tok.encode("Sort 10 2:\\n Answer:")), tok.tokenize("Sort 10")
        ('Sort 10 2:\\n Answer:', ['Sort', 'Ġ', '1', '0'])
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)


def tokenizer_texts(cfg: ReasoningWarmupConfig) -> list[str]:
    """Training text of the tokenizer: prompts and reference completions of every task, some with the slip."""
    texts = []
    for task in cfg.tasks:
        for i, r in enumerate(task_records(cfg, task, "train")[: cfg.tokenizer_texts]):
            texts.append(f"{r['prompt']} {r['solution']}{cfg.noise_suffix if i % 5 == 0 else ''}")
    return texts


def build_reasoning_model(path: str | Path, cfg: ReasoningWarmupConfig) -> str:
    """Train the tokenizer and write a randomly initialised ``cfg.model`` with it at ``path``; return the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_bpe_tokenizer(tokenizer_texts(cfg), cfg.bpe_vocab_size)
    if len(tokenizer) > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but model.vocab_size={cfg.model.vocab_size}")
    torch.manual_seed(cfg.model.seed)
    model = AutoModelForCausalLM.from_config(cfg.model.hf_config(tokenizer), dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


def demonstrations(cfg: ReasoningWarmupConfig, rng: random.Random) -> list[list[dict]]:
    """Per task, the training records as ``{"prompt", "answer": completion}``, each with or without the slip."""
    out = []
    for task in cfg.tasks:
        recs = []
        for r in task_records(cfg, task, "train"):
            slip = rng.random() < cfg.format_noise[0 if r["slip_prone"] else 1]
            recs.append({"prompt": r["prompt"], "answer": f" {r['solution']}{cfg.noise_suffix if slip else ''}"})
        out.append(recs)
    return out


def evaluate_tasks(
    model, tokenizer, cfg: ReasoningWarmupConfig, limit: int | None = None
) -> dict[str, dict[str, float]]:
    """Per task: held-out greedy accuracy under the task's reward, and with a trailing ``noise_suffix`` removed.

    ``limit`` evaluates only the first ``limit`` held-out problems of each task.
    """
    out = {}
    for task in cfg.tasks:
        _, reward_path = TASKS[task]
        module, name = reward_path.rsplit(".", 1)
        reward = getattr(importlib.import_module(module), name)()
        test = task_records(cfg, task, "test")[:limit]
        prompts, answers = [r["prompt"] for r in test], [r["answer"] for r in test]
        limit = cfg.eval_max_new_tokens
        texts = greedy_completions(HFEngine(model, tokenizer), tokenizer, prompts, max_new_tokens=limit, batch_size=128)
        texts = [t.strip() for t in texts]
        clean = [t[: -len(cfg.noise_suffix)] if t.endswith(cfg.noise_suffix) else t for t in texts]
        out[task] = {
            "greedy_accuracy": sum(reward(prompts, texts, answers)) / len(test),
            "greedy_accuracy_ignoring_suffix": sum(reward(prompts, clean, answers)) / len(test),
            "suffix_share": sum(t.endswith(cfg.noise_suffix) for t in texts) / len(test),
        }
    return out


def _load_stage(model, tokenizer, name: str, init_dir: str) -> None:
    """Copy the weights of the first stage ``name`` (its directory ``init_dir``) into ``model``."""
    base, base_tok = load_policy(init_dir)
    if base_tok.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"init_from={name!r}: its tokenizer differs from this warm-up's (tasks or BPE settings differ)"
        )
    model.load_state_dict(base.state_dict())


def warm_up_reasoning(
    path: str | Path,
    cfg: ReasoningWarmupConfig,
    log_every: int = 25,
    eval_every: int = 200,
    init_dir: str | None = None,
) -> dict:
    """Build the policy at ``path``, train it on the tasks' demonstrations, evaluate, save; return a summary.

    A second stage (``cfg.init_from``) starts from the weights in ``init_dir``, the first stage's built directory.
    Every ``eval_every`` steps the held-out accuracy on the first 32 problems per task is printed (progress only;
    greedy decoding draws no random numbers, so the result does not depend on it).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        build_reasoning_model(path, cfg)
        model, tok = load_policy(str(path))
        if cfg.init_from:
            if init_dir is None:
                raise ConfigError(f"init_from={cfg.init_from!r}: a second stage needs the first stage's directory")
            _load_stage(model, tok, cfg.init_from, init_dir)
        rng = random.Random(cfg.seed)
        demos = demonstrations(cfg, rng)
        torch.manual_seed(cfg.seed)
        start, load_start = time.perf_counter(), os.getloadavg()

        def mixed_batch(step: int) -> list[dict]:  # a task at random for each record
            return [rng.choice(demos[rng.randrange(len(demos))]) for _ in range(cfg.batch_size)]

        def progress(step: int, loss: float) -> None:
            if log_every and (step + 1) % log_every == 0:
                print(
                    f"[reasoning warm-up] step {step + 1}/{cfg.steps} loss {loss:.4f} "
                    f"{time.perf_counter() - start:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            if eval_every and (step + 1) % eval_every == 0 and step + 1 < cfg.steps:
                model.eval()
                acc = evaluate_tasks(model, tok, cfg, limit=32)
                model.train()
                print(
                    f"[reasoning warm-up] step {step + 1}: held-out greedy accuracy on 32 problems (ignoring the slip) "
                    + ", ".join(
                        f"{t} {a['greedy_accuracy']:.0%} ({a['greedy_accuracy_ignoring_suffix']:.0%})"
                        for t, a in acc.items()
                    ),
                    file=sys.stderr,
                    flush=True,
                )

        loss = sft_loop(
            model,
            tok,
            mixed_batch,
            steps=cfg.steps,
            lr=cfg.lr,
            lr_warmup=cfg.lr_warmup,
            clip_norm=1.0,
            on_step=progress,
        )
        train_seconds = time.perf_counter() - start
        tasks = evaluate_tasks(model, tok, cfg)
    finally:
        torch.set_num_threads(threads)
    mean = lambda key: sum(t[key] for t in tasks.values()) / len(tasks)  # noqa: E731
    summary = {
        "steps": cfg.steps,
        "final_loss": loss,
        "seconds": train_seconds,
        "eval_seconds": time.perf_counter() - start - train_seconds,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tok),
        "init_from": cfg.init_from,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "test_accuracy": mean("greedy_accuracy"),
        "test_accuracy_ignoring_suffix": mean("greedy_accuracy_ignoring_suffix"),
        "tasks": tasks,
    }
    model.save_pretrained(path, safe_serialization=True)
    (Path(path) / "warmup.json").write_text(json.dumps({"config": asdict(cfg), **summary}, indent=2))
    return summary
