"""Token log-probabilities and entropies of a causal LM on padded sequences.

The logits at position ``t`` predict token ``t+1``: for ids ``[n, L]`` the log-probabilities of the
targets ``ids[:, 1:]`` are ``[n, L-1]``. :func:`token_logprobs` is the one place the RL step turns a
forward pass into per-token values (with grad, for the loss); :func:`sequence_logprobs` runs it
without grad, micro-batch by micro-batch (``pi_old``, the reference).

Example::

    >>> import torch
    >>> logits = torch.zeros(1, 2, 4)  # uniform over 4 tokens
    >>> gather_logprobs(logits, torch.tensor([[1, 3]])).exp()
    tensor([[0.2500, 0.2500]])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from logra_lightning.rl.trajectory import PackedBatch


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[tokens]``: ``[N, T, V], [N, T] -> [N, T]``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [N, T, V]
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position: ``[..., V] -> [...]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    temperature: float,
    *,
    entropy: bool = False,
    on_logits: Callable[[torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities ``[n, L-1]`` of ``batch.targets`` under ``model`` (with grad when enabled), and entropies.

    Args:
        model: a causal LM returning ``.logits`` ``[n, L, V]``.
        batch: the rows to run (:class:`~logra_lightning.rl.trajectory.PackedBatch`).
        temperature: the sampling temperature (logits are divided by it).
        entropy: also return the entropy ``[n, L-1]`` of ``softmax(logits / temperature)`` (no grad).
        on_logits: called with the logits ``[n, L-1, V]`` (the KL probe keeps some of them).

    Returns:
        ``(logprobs, entropy or None)``.
    """
    logits = model(input_ids=batch.ids, attention_mask=batch.attention_mask).logits[:, :-1]  # [n, L-1, V]
    lp = gather_logprobs(logits, batch.targets, temperature)  # [n, L-1]
    ent = None
    if entropy:
        with torch.no_grad():
            ent = token_entropy(logits.detach() / temperature)  # [n, L-1]
    if on_logits is not None:
        on_logits(logits)
    return lp, ent


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module,
    seqs: PackedBatch,
    micro_batch_size: int | None,
    temperature: float,
    on_logits: Callable[[int, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Log-probabilities ``[N, L-1]`` of ``seqs.targets`` under ``model``, ``micro_batch_size`` rows at a time.

    ``on_logits(first_row, logits)`` sees each micro-batch's logits ``[n, L-1, V]``.
    """
    micro = micro_batch_size or len(seqs.ids)
    out = []
    for lo in range(0, len(seqs.ids), micro):
        mb = seqs.rows(slice(lo, lo + micro))
        hook = None if on_logits is None else (lambda logits, lo=lo: on_logits(lo, logits))
        out.append(token_logprobs(model, mb, temperature, on_logits=hook)[0])  # [n, L-1]
    return torch.cat(out)
