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

import torch


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
