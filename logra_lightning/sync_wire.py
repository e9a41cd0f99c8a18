"""The sync wire: what the trainer sends an engine, used by the callback, the engines and the vLLM worker.

* :class:`LowRankUpdate` — one matrix update ``W <- c * W + left @ right``, named by the
  parameter's HF name. :class:`~logra_lightning.optim.LoGRA` records the factors it applied
  in this type; :class:`~logra_lightning.callbacks.LowRankWeightSync` sends them.
* :func:`pack_payload` / :func:`unpack_payload` — updates and dense values as safetensors
  bytes (format ``logra-sync-v1``): tensors do not cross vLLM's multiprocess engine, bytes do.

Example::

    >>> import torch
    >>> u = LowRankUpdate("w", 0.9, torch.ones(4, 2), torch.ones(2, 3))
    >>> u.nbytes, tensor_nbytes(torch.zeros(5))
    (56, 20)
    >>> ups, dense = unpack_payload(pack_payload([u], [("b", torch.zeros(3))]))
    >>> ups[0][0], ups[0][1], dense[0][0]
    ('w', 0.9, 'b')
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

import torch


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (for a DTensor: of the global tensor)."""
    return t.numel() * t.element_size()


@dataclass
class LowRankUpdate:
    """One matrix update ``W <- c * W + left @ right`` named by its HF parameter name.

    ``left`` is ``[m, r]`` and ``right`` is ``[r, n]`` for a weight of shape ``[m, n]``
    (a 3-D expert weight ``[E, m', n]`` is its ``[E*m', n]`` matrix).
    """

    name: str
    c: float
    left: torch.Tensor
    right: torch.Tensor

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.left) + tensor_nbytes(self.right)


PAYLOAD_FORMAT = "logra-sync-v1"

def _plain(t: torch.Tensor, seen: set[int]) -> torch.Tensor:
    """A contiguous CPU tensor owning its storage and sharing none with the payload (safetensors needs that)."""
    t = t.detach().to("cpu").contiguous()
    ptr = t.untyped_storage().data_ptr()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or ptr in seen:
        t = t.clone()
        ptr = t.untyped_storage().data_ptr()
    seen.add(ptr)
    return t


def pack_payload(
    updates: Iterable = (), dense: Iterable[tuple[str, torch.Tensor]] = ()
) -> bytes:
    """Serialize low-rank updates (objects with ``name, c, left, right``) and dense values to bytes."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    meta_updates, meta_dense = [], []
    seen: set[int] = set()
    for i, u in enumerate(updates):
        tensors[f"u{i}.left"], tensors[f"u{i}.right"] = _plain(u.left, seen), _plain(u.right, seen)
        meta_updates.append([u.name, float(u.c)])
    for i, (name, value) in enumerate(dense):
        tensors[f"d{i}"] = _plain(value, seen)
        meta_dense.append(name)
    meta = {"format": PAYLOAD_FORMAT, "updates": json.dumps(meta_updates), "dense": json.dumps(meta_dense)}
    return save(tensors, metadata=meta)


def unpack_payload(payload: bytes) -> tuple[list[tuple[str, float, torch.Tensor, torch.Tensor]], list]:
    """Inverse of :func:`pack_payload`: ``([(name, c, left, right)], [(name, value)])``."""
    from safetensors.torch import load

    tensors = load(payload)
    header_len = int.from_bytes(payload[:8], "little")
    meta = json.loads(payload[8 : 8 + header_len]).get("__metadata__", {})
    if meta.get("format") != PAYLOAD_FORMAT:
        raise ValueError(f"not a weight-sync payload (format={meta.get('format')!r}, expected {PAYLOAD_FORMAT!r})")
    names = json.loads(meta["updates"])
    updates = [(n, c, tensors[f"u{i}.left"], tensors[f"u{i}.right"]) for i, (n, c) in enumerate(names)]
    dense = [(n, tensors[f"d{i}"]) for i, n in enumerate(json.loads(meta["dense"]))]
    return updates, dense
