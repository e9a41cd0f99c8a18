"""Greedy decoding through any rollout engine, and the held-out accuracy it gives.

The one evaluator of the project: the RL module's held-out evaluation
(:mod:`~logra_lightning.rl.evaluation`), the built-in policies' warm-up reports
(:mod:`~logra_lightning.builtin`) and the benchmarks all decode greedily through an engine
(the in-process HF engine, vLLM, or a server) and score with a reward function.

Example::

    >>> import tempfile
    >>> from logra_lightning.models import TinyModelConfig, build_tiny_model, load_policy
    >>> from logra_lightning.rewards import ExactMatchReward
    >>> from logra_lightning.rollout import HFEngine
    >>> model, tok = load_policy(build_tiny_model(tempfile.mkdtemp(), TinyModelConfig(num_layers=1)))
    >>> records = [{"prompt": "1+1=", "answer": "2"}] * 3
    >>> acc = greedy_accuracy(HFEngine(model, tok), tok, records, ExactMatchReward(), max_new_tokens=2, batch_size=2)
    >>> 0.0 <= acc <= 1.0  # a random-init model: whatever it says, one share of the three records
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from logra_lightning.rollout.base import SamplingConfig

Score = Callable[[list[str], list[str], list[str]], Sequence[float] | torch.Tensor]


def greedy_completions(
    engine, tokenizer, prompts: Sequence[str], *, max_new_tokens: int, batch_size: int | None = None
) -> list[str]:
    """The greedy completion (text) of each prompt, ``batch_size`` prompts per ``engine.generate`` call."""
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    step = batch_size or max(len(prompts), 1)
    texts: list[str] = []
    for i in range(0, len(prompts), step):
        out = engine.generate([tokenizer.encode(p) for p in prompts[i : i + step]], n=1, sampling=sampling)
        texts += out.texts
    return texts


def correct(score: Score, prompts: list[str], completions: list[str], answers: list[str], correct_reward: float = 1.0):
    """``[B]`` floats: 1.0 where ``score`` gives a completion at least ``correct_reward``."""
    rewards = torch.as_tensor(score(prompts, completions, answers), dtype=torch.float32)
    return (rewards >= correct_reward).float()


def greedy_accuracy(
    engine,
    tokenizer,
    records: Sequence[dict[str, str]],
    score: Score,
    *,
    max_new_tokens: int,
    batch_size: int | None = None,
    correct_reward: float = 1.0,
) -> float:
    """Share of ``records`` (``{"prompt", "answer"}``) whose greedy completion scores at least ``correct_reward``."""
    prompts, answers = [r["prompt"] for r in records], [r["answer"] for r in records]
    texts = greedy_completions(engine, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    return correct(score, prompts, texts, answers, correct_reward).mean().item()
