"""One RL step's data: the rollout as padded training tensors, and everything fixed over its PPO epochs.

Each row is ``prompt + completion``, right-padded, so positions are the natural ``0..L-1`` and no
position ids are needed. The logits at position ``t`` predict token ``t+1``, so the training
targets are ``ids[:, 1:]`` and ``mask`` marks the completion tokens among them.

:class:`Trajectory` is built once per step, after rewards (and ``pi_old``'s log-probs where a separate
pass computes them), and carried through the step: the loss reads a micro-batch of it (:meth:`Trajectory.rows`).

Example::

    >>> b = pack_sequences([[5, 6], [7]], [[8, 1], [9]], pad_id=0)
    >>> b.ids.tolist(), b.mask.int().tolist()
    ([[5, 6, 8, 1], [7, 9, 0, 0]], [[0, 1, 1], [1, 0, 0]])
    >>> t = Trajectory(b, torch.zeros(2), torch.tensor([1.0, -1.0]), torch.zeros(2, 3))
    >>> t.rows(slice(1, 2)).advantages, t.num_tokens
    (tensor([-1.]), 3)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    ids: torch.Tensor  # [N, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [N, L] 1 on real tokens
    targets: torch.Tensor  # [N, L-1] ids[:, 1:]
    mask: torch.Tensor  # [N, L-1] 1 where the target is a completion token

    def rows(self, index) -> PackedBatch:
        """The sub-batch of rows ``index`` (a slice or index tensor)."""
        return PackedBatch(self.ids[index], self.attention_mask[index], self.targets[index], self.mask[index])

    def to(self, device) -> PackedBatch:
        return PackedBatch(*(t.to(device) for t in (self.ids, self.attention_mask, self.targets, self.mask)))

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def lengths(self) -> torch.Tensor:
        """``[N]`` real tokens per row (prompt + completion)."""
        return self.attention_mask.sum(dim=1)

    def trimmed(self) -> PackedBatch:
        """These rows without the padding columns that none of them uses (``L`` = the longest row)."""
        w = max(int(self.lengths.max()), 2) if len(self.ids) else self.ids.shape[1]
        if w >= self.ids.shape[1]:
            return self
        return PackedBatch(self.ids[:, :w], self.attention_mask[:, :w], self.targets[:, : w - 1], self.mask[:, : w - 1])


@dataclass
class Trajectory:
    """A step's samples and what stays fixed over its PPO epochs (torchtune's ``GRPOTrajectory``).

    Tensors have one row per sample (``N = B * G``); per-token ones are aligned with ``seqs.targets``.
    """

    seqs: PackedBatch  # ids [N, L], targets and mask [N, L-1]
    rewards: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N] group-normalized
    # [N, L-1] log pi_old of the targets (no grad); None: the training forward's own, detached (one epoch)
    old_logprobs: torch.Tensor | None
    tis_weights: torch.Tensor | None = None  # [N, L-1] min(pi_old / pi_engine, cap), or None (TIS off or not yet)
    ref_logprobs: torch.Tensor | None = None  # [N, L-1] log pi_ref, or None (no KL penalty)
    engine_logprobs: torch.Tensor | None = None  # [N, L-1] the engine's sampling logprobs of the targets

    def rows(self, index) -> Trajectory:
        """The micro-batch of rows ``index`` (a slice or index tensor)."""
        return Trajectory(
            **{
                f.name: (getattr(self, f.name).rows(index) if f.name == "seqs" else _take(getattr(self, f.name), index))
                for f in dataclasses.fields(self)
            }
        )

    @property
    def num_tokens(self) -> int:
        """Completion tokens of these rows."""
        return self.seqs.num_tokens

    def trimmed(self) -> Trajectory:
        """These rows without the padding columns none of them uses (per-token tensors cut to match)."""
        seqs = self.seqs.trimmed()
        if seqs is self.seqs:
            return self
        t = seqs.targets.shape[1]
        cut = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("old_logprobs", "tis_weights", "ref_logprobs", "engine_logprobs"):
            cut[name] = None if cut[name] is None else cut[name][:, :t]
        return Trajectory(**{**cut, "seqs": seqs})


def _take(t: torch.Tensor | None, index) -> torch.Tensor | None:
    return None if t is None else t[index]


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


def logprob_gap(logprobs: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """``(mean, max)`` of ``|logprobs - other|`` over the ``mask``ed tokens (``[N, T]`` each)."""
    diff = (other - logprobs).abs() * mask  # [N, T]
    return (diff.sum() / mask.sum().clamp_min(1)).item(), diff.max().item()
