"""Token log-probabilities and entropies of a causal LM on a step's sequences.

The logits at position ``t`` predict token ``t+1``: for ids ``[n, L]`` the log-probabilities of the
targets ``ids[:, 1:]`` are ``[n, L-1]``. :func:`token_logprobs` is the one place the RL step turns a
forward pass into per-token values (with grad, for the loss); :func:`sequence_logprobs` runs it
without grad, micro-batch by micro-batch (``pi_old``, the reference).

Values are computed at the completion tokens (``batch.mask``) only and are 0 elsewhere; every
consumer (the loss, the TIS weights, the drift stat, the KL probe) reads them through the mask.
By default the logits never exist whole: the head runs on ``chunk_size`` tokens at a time from the
last hidden states (:mod:`~logra_lightning.rl.lm_head`). ``chunk_size=None`` computes the whole
``[n, L, V]`` logits as the model returns them (the reference the chunked path is tested against,
and the path for a model whose head :class:`~logra_lightning.rl.lm_head.LMHead` does not
reproduce). With ``packed=True`` the rows run padding-free, back to back in one row
(:mod:`~logra_lightning.rl.micro_batches`).

Example::

    >>> import torch
    >>> logits = torch.zeros(1, 2, 4)  # uniform over 4 tokens
    >>> gather_logprobs(logits, torch.tensor([[1, 3]])).exp()
    tensor([[0.2500, 0.2500]])
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from lightning.pytorch.utilities import rank_zero_warn

from logra_lightning.rl.lm_head import DEFAULT_CHUNK_SIZE, LMHead, chunked_logprobs, forward_hidden

if TYPE_CHECKING:
    from logra_lightning.rl.trajectory import PackedBatch

LogitsAt = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows [m], positions [m]) -> fp32 logits [m, V]
_WHOLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # models whose head did not match: whole logits


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[tokens]``: ``[N, T, V], [N, T] -> [N, T]``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [N, T, V]
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position: ``[..., V] -> [...]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


class _Inputs:
    """The forward pass's inputs for a batch, padded or packed, and where each ``(row, t)`` lands in its output."""

    def __init__(self, batch: PackedBatch, packed: bool) -> None:
        self.packed = packed and len(batch.ids) > 1
        if not self.packed:
            self.ids, self.attention_mask, self.position_ids = batch.ids, batch.attention_mask, None
            self.width = batch.ids.shape[1]
            return
        lengths = batch.lengths  # [n]
        keep = batch.attention_mask.bool()  # right-padded: row-major order is the rows back to back
        self.ids = batch.ids[keep][None]  # [1, S]
        self.attention_mask = None  # the restarting position ids are the mask
        self.position_ids = torch.cat([torch.arange(int(n), device=batch.ids.device) for n in lengths])[None]  # [1, S]
        self.offsets = torch.cumsum(lengths, 0) - lengths  # [n]

    def flat(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Index into the output flattened to ``[n' * L', ...]`` of the token at ``(rows, pos)`` of the padded batch."""
        return self.offsets[rows] + pos if self.packed else rows * self.width + pos


def token_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    temperature: float,
    *,
    entropy: bool = False,
    on_logits: Callable[[LogitsAt], None] | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities ``[n, L-1]`` of ``batch.targets`` under ``model`` (with grad when enabled), and entropies.

    Args:
        model: an HF causal LM.
        batch: the rows to run (:class:`~logra_lightning.rl.trajectory.PackedBatch`).
        temperature: the sampling temperature (logits are divided by it).
        entropy: also return the entropy ``[n, L-1]`` of ``softmax(logits / temperature)`` (no grad).
        on_logits: called with a function that returns the fp32 logits ``[m, V]`` at target
            positions ``(rows [m], t [m])`` of this batch (the KL probe keeps some of them).
        chunk_size: tokens per block through the LM head; ``None``: the whole logits.
        packed: run the rows padding-free in one packed row (the model must support it:
            :func:`~logra_lightning.rl.micro_batches.packing_supported`).

    Returns:
        ``(logprobs, entropy or None)``, each ``[n, L-1]`` fp32, 0 outside ``batch.mask``.
    """
    inputs = _Inputs(batch, packed)
    rows, pos = batch.mask.nonzero(as_tuple=True)  # [M] each: the completion tokens
    targets = batch.targets[rows, pos]  # [M]
    head = None if chunk_size is None or model in _WHOLE else LMHead.of(model)
    if head is None:
        return _whole_logits(model, batch, inputs, temperature, entropy, on_logits, (rows, pos, targets))
    hidden, last = forward_hidden(model, inputs.ids, inputs.attention_mask, inputs.position_ids)  # [n', L', h]
    diff = head.matches(hidden[:, -1:], last)
    if diff is not None:
        _WHOLE[model] = True
        rank_zero_warn(
            f"{type(model).__name__}: lm_head(last hidden state) differs from the model's logits by {diff:.3g}; "
            "computing whole logits for this model (set model.lm_head_chunk_size: null to silence this)"
        )
        return token_logprobs(model, batch, temperature, entropy=entropy, on_logits=on_logits, packed=packed)
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # [n' L', h]
    lp, ent = chunked_logprobs(head, flat_h[inputs.flat(rows, pos)], targets, temperature, chunk_size, entropy)
    if on_logits is not None:
        with torch.no_grad():
            on_logits(lambda r, t: head.logits(flat_h[inputs.flat(r, t)]).float())
    shape = batch.targets.shape
    out = torch.zeros(shape, dtype=lp.dtype, device=lp.device).index_put((rows, pos), lp)  # [n, L-1]
    if ent is not None:
        ent = torch.zeros(shape, dtype=ent.dtype, device=ent.device).index_put((rows, pos), ent.detach())
    return out, ent


def _whole_logits(model, batch, inputs, temperature, entropy, on_logits, picked):
    """:func:`token_logprobs` through the whole logits ``[n, L, V]``; padded rows get a value at every position."""
    rows, pos, targets = picked
    logits = model(
        input_ids=inputs.ids, attention_mask=inputs.attention_mask, position_ids=inputs.position_ids, use_cache=False
    ).logits  # [n', L', V]
    if inputs.packed:
        flat = logits.reshape(-1, logits.shape[-1])  # [S, V]
        sel = flat[inputs.flat(rows, pos)]  # [M, V]
        lp = torch.zeros(batch.targets.shape, device=sel.device)  # [n, L-1]
        lp = lp.index_put((rows, pos), gather_logprobs(sel, targets, temperature))
        ent = None
        if entropy:
            with torch.no_grad():
                ent = torch.zeros_like(lp).index_put((rows, pos), token_entropy(sel / temperature))
        at = lambda r, t: flat[inputs.flat(r, t)].float()  # noqa: E731
    else:
        logits = logits[:, :-1]  # [n, L-1, V]
        lp = gather_logprobs(logits, batch.targets, temperature)  # [n, L-1]
        ent = None
        if entropy:
            with torch.no_grad():
                ent = token_entropy(logits.detach() / temperature)  # [n, L-1]
        at = lambda r, t: logits[r, t].float()  # noqa: E731
    if on_logits is not None:
        with torch.no_grad():
            on_logits(at)
    return lp, ent


@torch.no_grad()
def position_logits(
    model: torch.nn.Module,
    batch: PackedBatch,
    rows: torch.Tensor,
    pos: torch.Tensor,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """The model's fp32 logits ``[M, V]`` at target positions ``(rows [M], pos [M])`` of ``batch`` (the KL probe's).

    With ``chunk_size`` set, the head runs only on those ``M`` hidden states; ``None``: through the whole logits.
    """
    head = None if chunk_size is None or model in _WHOLE else LMHead.of(model)
    if head is not None:
        hidden, last = forward_hidden(model, batch.ids, batch.attention_mask)  # [R, L, h]
        if head.matches(hidden[:, -1:], last) is None:
            return head.logits(hidden[rows, pos]).float()  # [M, V]
        _WHOLE[model] = True
    return model(input_ids=batch.ids, attention_mask=batch.attention_mask, use_cache=False).logits[rows, pos].float()


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module,
    seqs: PackedBatch,
    micro_batches: int | None | Sequence[Sequence[int]],
    temperature: float,
    on_logits: Callable[[torch.Tensor, LogitsAt], None] | None = None,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    packed: bool = False,
) -> torch.Tensor:
    """Log-probabilities ``[N, L-1]`` of ``seqs.targets`` under ``model``, one micro-batch at a time.

    Args:
        micro_batches: rows per micro-batch (``None``: all at once), or the row indices of each
            micro-batch (:func:`~logra_lightning.rl.micro_batches.plan_micro_batches`); each runs
            trimmed to its longest row.
        on_logits: ``on_logits(rows, logits_at)`` per micro-batch: ``rows`` ``[n]`` are the batch's row
            indices of the micro-batch, ``logits_at`` as in :func:`token_logprobs` (micro-batch rows).
        chunk_size, packed: as in :func:`token_logprobs`.
    """
    n = len(seqs.ids)
    if micro_batches is None or isinstance(micro_batches, int):
        step = micro_batches or max(n, 1)
        micro_batches = [list(range(lo, min(lo + step, n))) for lo in range(0, n, step)]
    out = torch.zeros(seqs.targets.shape, dtype=torch.float32, device=seqs.ids.device)  # [N, L-1]
    for group in micro_batches:
        rows = torch.as_tensor(group, dtype=torch.long, device=seqs.ids.device)
        mb = seqs.rows(rows).trimmed()
        hook = None if on_logits is None else (lambda logits_at, rows=rows: on_logits(rows, logits_at))
        lp = token_logprobs(model, mb, temperature, on_logits=hook, chunk_size=chunk_size, packed=packed)[0]
        out[rows, : lp.shape[1]] = lp  # [n, w-1]
    return out
