"""The field's lossless sync, as a baseline: sparse bitwise deltas of bf16 weights (slime, verl, TRL, NeMo-RL).

At RL learning rates most bf16 weights round to the same value before and after a step, so
those frameworks send, per step, only the bf16 weights whose bits changed: their flat ``int32``
indices and new ``bf16`` values (6 bytes per changed weight; TRL's and slime's ``sparse_indices``
transport), or slime's alternative, a 1-bit-per-weight mask plus the values (``numel / 8 + 2``
bytes per changed weight). The receiver overwrites those entries, so the engine holds exactly
``bf16(trainer weights)``: no drift, no periodic full sync. (slime compresses with zstd only what
it writes to disk, TRL relies on its storage's deduplication; neither compresses the wire, so
neither is done here.) This module is our own implementation of that scheme, for
``benchmarks/sync_cost.py``.

Example::

    >>> import torch
    >>> w = torch.nn.Parameter(torch.tensor([0.02, 0.5, 1.0, -0.3]))
    >>> delta = SparseDelta({"w": w})
    >>> with torch.no_grad():
    ...     _ = w.add_(torch.tensor([1e-6, 1e-2, 0.0, 0.0]))  # only 0.5 -> 0.51 is visible in bf16
    >>> row = delta.step({"w": w})
    >>> row["changed"], row["bytes"], row["bitmask_bytes"], row["drift_max"]
    (1, 6, 3, 0.0)
"""

from __future__ import annotations

import math
import time

import torch

INDEX_BYTES, VALUE_BYTES = 4, 2  # int32 flat index, bf16 value


def bf16_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16, as its 16-bit patterns (``int16``), flat."""
    return t.detach().to(torch.bfloat16).reshape(-1).view(torch.int16)


def sparse_patch(prev_bits: torch.Tensor, current: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indices int32, values bf16, current bits)``: the entries whose bf16 bits differ from ``prev_bits``."""
    bits = bf16_bits(current)  # [numel] int16
    indices = (bits != prev_bits).nonzero().squeeze(1)  # [nnz] int64
    values = bits[indices].view(torch.bfloat16)  # [nnz]
    return indices.to(torch.int32), values, bits


class SparseDelta:
    """Sender and receiver of the sparse bf16 sync for a set of named tensors (see the module notes).

    Keeps the sender's last sent bf16 bits and a receiver's bf16 replica, both starting from a
    full sync of ``params``; :meth:`step` builds the patch of what changed since, applies it to the
    replica, and checks the replica against ``bf16(params)`` bit for bit.
    """

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.sent = {n: bf16_bits(p) for n, p in params.items()}
        self.replica = {n: b.clone() for n, b in self.sent.items()}
        self.numel = sum(b.numel() for b in self.sent.values())

    def step(self, params: dict[str, torch.Tensor]) -> dict:
        """One sync of ``params``: bytes (indices / bitmask encodings), changed weights, seconds, drift."""
        changed = index_bytes = bitmask_bytes = 0
        build = apply = 0.0
        for name, p in params.items():
            t0 = time.perf_counter()
            indices, values, bits = sparse_patch(self.sent[name], p)
            self.sent[name] = bits
            t1 = time.perf_counter()
            self.replica[name][indices.long()] = values.view(torch.int16)  # the receiver overwrites those entries
            apply += time.perf_counter() - t1
            build += t1 - t0
            nnz = indices.numel()
            changed += nnz
            if nnz:
                index_bytes += nnz * (INDEX_BYTES + VALUE_BYTES)
                bitmask_bytes += math.ceil(bits.numel() / 8) + nnz * VALUE_BYTES
        drift = 0.0  # the receiver's weights against bf16(trainer's), largest |difference|
        for n, p in params.items():
            diff = self.replica[n].view(torch.bfloat16).float() - bf16_bits(p).view(torch.bfloat16).float()
            drift = max(drift, float(diff.abs().max())) if diff.numel() else drift
        return {
            "changed": changed,
            "changed_fraction": changed / self.numel,
            "bytes": index_bytes,
            "bitmask_bytes": bitmask_bytes,
            "seconds": build + apply,
            "build_seconds": build,
            "apply_seconds": apply,
            "drift_max": drift,
        }
