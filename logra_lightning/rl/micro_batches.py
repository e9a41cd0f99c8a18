"""Which rows of a step's batch go through forward/backward together: fixed row counts, or a token budget.

With ``micro_batch_size`` a batch is cut into runs of that many rows, in order, each padded to
the batch's longest row. With ``max_tokens_per_micro_batch`` the rows are sorted by length and
packed first-fit into micro-batches that each process at most that many tokens (verl's
``use_dynamic_bsz``), so one long completion does not make every row pay for its padding:

* **padding-free** (:func:`packing_supported` models): a micro-batch is one packed row, the
  sequences back to back with position ids restarting at 0 (transformers turns those into a
  block-diagonal causal mask); its cost is the sum of the lengths;
* **bucketed** (other models): a micro-batch is right-padded to its own longest row; its cost is
  ``rows x longest``.

A row longer than the budget gets a micro-batch of its own. Under DDP/FSDP every rank must run
as many forward/backward passes as the others: :func:`split_to_count` splits the largest
micro-batches until a rank has the count all ranks agreed on (the largest).

The loss is a sum over tokens divided by the batch's token count
(:func:`~logra_lightning.rl.loss.grpo_loss`), so any grouping of rows gives the same loss,
gradients and stats up to the order of floating-point additions.

Example::

    >>> plan_micro_batches([10, 3, 9, 4], max_tokens=13, packed=True)
    [[0, 1], [2, 3]]
    >>> plan_micro_batches([10, 3, 9, 4], max_tokens=20, packed=False)  # 2 rows x 10 tokens, 2 x 4
    [[0, 2], [1, 3]]
    >>> plan_micro_batches([10, 3, 9, 4], max_rows=3)
    [[0, 1, 2], [3]]
"""

from __future__ import annotations

from collections.abc import Sequence

from logra_lightning.errors import ConfigError

# HF model types whose attention (via transformers' masking_utils) turns restarting position ids
# into a block-diagonal mask; each is checked against the padded forward in tests/test_chunked_logprobs.py.
PACKED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3", "qwen3_moe"})


def packing_supported(config) -> bool:
    """Whether a model with this HF ``config`` runs several sequences packed in one row (padding-free)."""
    return getattr(config, "model_type", None) in PACKED_MODEL_TYPES


def use_padding_free(max_tokens: int | None, padding_free: bool | None, config) -> bool:
    """Whether micro-batches run packed: only with a token budget, and when the model supports it.

    Raises:
        ConfigError: ``padding_free=True`` for a model family that is not known to support it.
    """
    if max_tokens is None or padding_free is False:
        return False
    if padding_free and not packing_supported(config):
        raise ConfigError(
            f"model.padding_free=true: model_type {getattr(config, 'model_type', None)!r} is not known to run packed "
            f"sequences (supported: {', '.join(sorted(PACKED_MODEL_TYPES))}); set model.padding_free: null "
            "(bucketed micro-batches, padded to each one's longest row)"
        )
    return packing_supported(config)


def micro_batch_cost(lengths: Sequence[int], packed: bool) -> int:
    """Tokens a forward pass over rows of these ``lengths`` processes: their sum packed, else rows x longest."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def plan_micro_batches(
    lengths: Sequence[int], *, max_rows: int | None = None, max_tokens: int | None = None, packed: bool = False
) -> list[list[int]]:
    """Row indices of each micro-batch.

    Args:
        lengths: real tokens (prompt + completion) of each row.
        max_rows: rows per micro-batch (``None``: no limit).
        max_tokens: tokens per micro-batch (:func:`micro_batch_cost`); ``None``: rows in order,
            ``max_rows`` at a time (today's fixed micro-batches).
        packed: the micro-batches will run padding-free.

    Returns:
        Lists of row indices (each sorted), covering every row once.
    """
    n = len(lengths)
    if max_tokens is None:
        step = max_rows or max(n, 1)
        return [list(range(lo, min(lo + step, n))) for lo in range(0, n, step)]
    groups: list[list[int]] = []
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):  # first-fit decreasing
        for g in groups:
            room = max_rows is None or len(g) < max_rows
            if room and micro_batch_cost([lengths[j] for j in g] + [lengths[i]], packed) <= max_tokens:
                g.append(i)
                break
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


def split_to_count(groups: list[list[int]], count: int, lengths: Sequence[int], packed: bool) -> list[list[int]]:
    """``groups`` with the costliest multi-row micro-batch halved until there are ``count`` (as many as other ranks).

    Raises:
        ValueError: ``count`` exceeds the number of rows (no split can reach it).
    """
    groups = [list(g) for g in groups]
    if count > sum(len(g) for g in groups):
        raise ValueError(f"cannot split {sum(len(g) for g in groups)} rows into {count} micro-batches")
    while len(groups) < count:
        splittable = [g for g in groups if len(g) > 1]
        big = max(splittable, key=lambda g: micro_batch_cost([lengths[i] for i in g], packed))
        by_length = sorted(big, key=lambda i: (-lengths[i], i))
        groups.remove(big)
        groups += [sorted(by_length[::2]), sorted(by_length[1::2])]
    return groups
