"""The supervised warm-up loop of the built-in policies: AdamW on the answer tokens of demonstrations.

:func:`sft_loop` is the one loop (every built-in warm-up runs it); :func:`sft_batch` turns
``{"prompt", "answer"}`` records into right-padded ids with the loss on the answer only;
:func:`warmup_cosine` is the learning-rate multiplier (linear warm-up, then cosine to 0).

Example::

    >>> [round(warmup_cosine(s, warmup=2, total=4), 3) for s in range(5)]
    [0.5, 0.854, 0.5, 0.146, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """LR multiplier: a linear ramp over ``warmup`` steps times a cosine from 1 to 0 over all ``total`` steps.

    Kept by hand because no library ships this product (transformers' ``get_cosine_schedule_with_warmup``
    starts the cosine after the ramp): the cached built-in policies and every result measured on them
    were trained with it, and a different schedule would rebuild them with other weights.
    """
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


def sft_loop(
    model: torch.nn.Module,
    tokenizer,
    next_batch: Callable[[int], list[dict]],
    *,
    steps: int,
    lr: float,
    lr_warmup: int,
    clip_norm: float | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> float:
    """Train ``model`` for ``steps`` AdamW steps on ``next_batch(step)``'s records; return the last loss.

    AdamW with betas (0.9, 0.98) and no weight decay, the learning rate ramped over ``lr_warmup``
    steps and then decayed to 0 (:func:`warmup_cosine`), gradients clipped to ``clip_norm`` if
    given. ``on_step(step, loss)`` runs after each step (progress lines, evaluation); the model is
    in train mode during the loop and in eval mode after it.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, lr_warmup, steps))
    model.train()
    loss = float("nan")
    for step in range(steps):
        ids, mask, labels = sft_batch(tokenizer, next_batch(step))  # [B, L] each
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        loss = out.loss.item()
        if on_step is not None:
            on_step(step, loss)
    model.eval()
    return loss
