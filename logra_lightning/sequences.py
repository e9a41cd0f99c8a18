"""Turn a rollout (prompt + sampled completion token lists) into padded training tensors.

Each row is ``prompt + completion``, right-padded, so positions are the natural
``0..L-1`` and no position ids are needed. The logits at position ``t`` predict
token ``t+1``, so the training targets are ``ids[:, 1:]`` and ``mask`` marks the
completion tokens among them.

Example::

    >>> b = pack_sequences([[5, 6], [7]], [[8, 1], [9]], pad_id=0)
    >>> b.ids.tolist(), b.mask.int().tolist()
    ([[5, 6, 8, 1], [7, 9, 0, 0]], [[0, 1, 1], [1, 0, 0]])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from logra_lightning.grpo import gather_logprobs


@dataclass
class PackedBatch:
    ids: torch.Tensor  # [N, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [N, L] 1 on real tokens
    targets: torch.Tensor  # [N, L-1] ids[:, 1:]
    mask: torch.Tensor  # [N, L-1] 1 where the target is a completion token

    def rows(self, index) -> "PackedBatch":
        """The sub-batch of rows ``index`` (a slice or index tensor)."""
        return PackedBatch(self.ids[index], self.attention_mask[index], self.targets[index], self.mask[index])

    def to(self, device) -> "PackedBatch":
        return PackedBatch(*(t.to(device) for t in (self.ids, self.attention_mask, self.targets, self.mask)))

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())


def pack_sequences(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> PackedBatch:
    """Pack ``N`` prompt/completion pairs (``prompts[i]`` goes with ``completions[i]``)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    n = len(prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)  # [N, L]
    attn = torch.zeros((n, width), dtype=torch.long)  # [N, L]
    mask = torch.zeros((n, width - 1), dtype=torch.float32)  # [N, L-1]
    for i, (p, c) in enumerate(zip(prompts, completions)):
        row = p + c
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attn[i, : len(row)] = 1
        mask[i, len(p) - 1 : len(row) - 1] = 1.0  # logits at len(p)-1 predict the first completion token
    return PackedBatch(ids, attn, ids[:, 1:], mask)


def right_align(values: list[list[float]], prompt_lens: list[int], width: int) -> torch.Tensor:
    """Place per-completion-token values (e.g. engine logprobs) at their target positions: ``[N, width]``."""
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for i, (v, plen) in enumerate(zip(values, prompt_lens)):
        out[i, plen - 1 : plen - 1 + len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


@torch.no_grad()
def sequence_logprobs(model: torch.nn.Module, seqs: PackedBatch, micro_batch_size: int | None, temperature: float,
                      on_logits: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:  # fmt: skip
    """Log-probabilities ``[N, L-1]`` of ``seqs.targets`` under ``model``, ``micro_batch_size`` rows at a time.

    ``on_logits(first_row, logits)`` sees each micro-batch's logits ``[n, L-1, V]`` (the KL probe
    keeps some of them).
    """
    micro = micro_batch_size or len(seqs.ids)
    out = []
    for lo in range(0, len(seqs.ids), micro):
        mb = seqs.rows(slice(lo, lo + micro))
        logits = model(input_ids=mb.ids, attention_mask=mb.attention_mask).logits[:, :-1]  # [n, L-1, V]
        out.append(gather_logprobs(logits, mb.targets, temperature))  # [n, L-1]
        if on_logits is not None:
            on_logits(lo, logits)
    return torch.cat(out)


def logprob_gap(logprobs: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """``(mean, max)`` of ``|logprobs - other|`` over the ``mask``ed tokens (``[N, T]`` each)."""
    diff = (other - logprobs).abs() * mask  # [N, T]
    return (diff.sum() / mask.sum().clamp_min(1)).item(), diff.max().item()
