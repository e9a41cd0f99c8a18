"""Supervised fine-tuning pieces shared by the built-in policies' warm-ups, and their greedy evaluation.

:func:`sft_batch` turns ``{"prompt", "answer"}`` records into right-padded ids with the loss on
the answer only; :func:`warmup_cosine` is the warm-ups' learning-rate multiplier;
:func:`greedy_completions` decodes greedily through the in-process HF engine (the same path
held-out evaluation takes in the RL loop).

Example::

    >>> [round(warmup_cosine(s, warmup=2, total=4), 3) for s in range(5)]
    [0.5, 0.854, 0.5, 0.146, 0.0]
"""

from __future__ import annotations

import math

import torch

from logra_lightning.rollout.base import SamplingConfig
from logra_lightning.rollout.hf import HFEngine


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
def greedy_completions(
    model, tokenizer, records: list[dict], max_new_tokens: int = 6, batch_size: int = 128
) -> list[str]:
    """Stripped greedy completions of ``records``' prompts (HF ``generate``)."""
    engine, texts = HFEngine(model, tokenizer), []
    for i in range(0, len(records), batch_size):
        chunk = records[i : i + batch_size]
        out = engine.generate(
            [tokenizer.encode(r["prompt"]) for r in chunk],
            n=1,
            sampling=SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0),
        )
        texts += [t.strip() for t in out.texts]
    return texts


def answer_share(texts: list[str], records: list[dict], suffix: str = "") -> float:
    """Fraction of ``texts`` equal to their record's answer (or, with ``suffix``, the answer plus it)."""
    return sum(t in (r["answer"], r["answer"] + suffix) for t, r in zip(texts, records)) / len(records)


def greedy_accuracy(model, tokenizer, records: list[dict], max_new_tokens: int = 6, batch_size: int = 128) -> float:
    """Fraction of ``records`` whose greedy completion equals the answer."""
    return answer_share(greedy_completions(model, tokenizer, records, max_new_tokens, batch_size), records)
