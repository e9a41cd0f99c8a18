"""One weight-sync message as a JSON-able header plus one flat byte buffer: what crosses to the engine's workers.

The engines send a sync through vLLM's weight-transfer API
(:mod:`~logra_lightning.rollout.vllm.transfer`): the header travels through the control plane
(``LLM.update_weights`` or the ``/update_weights`` route of ``vllm serve``) and the buffer through a
torch.distributed broadcast (gloo on CPU, NCCL on GPU, :mod:`~logra_lightning.sync.channel`), so the
tensors never become HTTP bodies. :func:`encode` lays every tensor of a list of
:class:`~logra_lightning.sync.wire.LowRankUpdate` and dense ``(name, value)`` pairs into one ``uint8``
buffer (64-byte aligned, so each tensor is a view on the receiving side); :func:`decode` is its
inverse. A basis shared by several updates (same key and version, the pieces of a 3-D expert weight)
is stored once. :func:`chunks` splits a sync into messages of bounded size.

Example::

    >>> import torch
    >>> from logra_lightning.sync.wire import LowRankUpdate
    >>> u = LowRankUpdate("w", 0.9, torch.ones(4, 2), torch.ones(2, 3), basis="right", version="a.1")
    >>> header, buffer = encode([u], [("b", torch.zeros(3, dtype=torch.bfloat16))])
    >>> header["nbytes"] == buffer.numel(), buffer.dtype
    (True, torch.uint8)
    >>> ups, dense = decode(header, buffer)
    >>> ups[0].name, ups[0].c, ups[0].version, tuple(ups[0].right.shape), dense[0][1].dtype
    ('w', 0.9, 'a.1', (2, 3), torch.bfloat16)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from logra_lightning.sync.wire import LowRankUpdate, tensor_nbytes

FORMAT = "logra-transfer-v1"
ALIGN = 64  # bytes: every tensor starts at a multiple, so a dtype view of the buffer is always legal
_SIDES = ("left", "right")

Item = tuple[LowRankUpdate | None, tuple[str, torch.Tensor] | None]  # an update, or a dense (name, value)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def encode(
    updates: Iterable[LowRankUpdate] = (),
    dense: Iterable[tuple[str, torch.Tensor]] = (),
    device: torch.device | str | None = None,
) -> tuple[dict, torch.Tensor]:
    """``(header, buffer)``: the header names every update and dense value and where its tensors lie in ``buffer``.

    Args:
        updates: low-rank updates (a factor may be ``None`` when only the coefficient goes).
        dense: ``(name, value)`` pairs, sent as they are (their dtype kept).
        device: where ``buffer`` lives (the broadcast's device); default: the first tensor's.

    Returns:
        A JSON-able dict (``format``, ``updates``, ``dense``, ``tensors``, ``nbytes``) and a ``uint8``
        tensor of ``nbytes`` bytes.
    """
    tensors: list[torch.Tensor] = []
    basis_index: dict[tuple[str, str], int] = {}
    meta_updates, meta_dense = [], []
    for u in updates:
        entry = {"n": u.name, "c": float(u.c), "s": u.basis, "v": u.version, "k": u.key, "left": None, "right": None}
        for side in _SIDES:
            t = getattr(u, side)
            if t is None:
                continue
            if side == u.basis:
                slot = (u.basis_key, u.version)
                if slot not in basis_index:
                    basis_index[slot] = len(tensors)
                    tensors.append(t)
                entry[side] = basis_index[slot]
            else:
                entry[side] = len(tensors)
                tensors.append(t)
        meta_updates.append(entry)
    for name, value in dense:
        meta_dense.append({"n": name, "t": len(tensors)})
        tensors.append(value)
    specs, offset = [], 0
    for t in tensors:
        specs.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset})
        offset = _aligned(offset + tensor_nbytes(t))
    if device is None:
        device = tensors[0].device if tensors else "cpu"
    buffer = torch.zeros(offset, dtype=torch.uint8, device=device)
    for t, spec in zip(tensors, specs):
        _view(buffer, spec).copy_(t.detach())
    header = {"format": FORMAT, "updates": meta_updates, "dense": meta_dense, "tensors": specs, "nbytes": offset}
    return header, buffer


def _view(buffer: torch.Tensor, spec: dict) -> torch.Tensor:
    """The tensor ``spec`` describes, as a view of ``buffer``."""
    dtype = getattr(torch, spec["dtype"])
    shape = tuple(spec["shape"])
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    start = spec["offset"]
    return buffer[start : start + nbytes].view(dtype).view(shape)


def decode(header: dict, buffer: torch.Tensor) -> tuple[list[LowRankUpdate], list[tuple[str, torch.Tensor]]]:
    """Inverse of :func:`encode`: the updates and dense values, their tensors views of ``buffer``.

    Raises:
        ValueError: ``header`` is not a message of this format, or ``buffer`` is not its size.
    """
    if header.get("format") != FORMAT:
        raise ValueError(f"not a weight-sync message (format={header.get('format')!r}, expected {FORMAT!r})")
    if buffer.numel() != header["nbytes"]:
        raise ValueError(f"weight-sync buffer has {buffer.numel()} bytes, its header says {header['nbytes']}")
    views = [_view(buffer, spec) for spec in header["tensors"]]
    updates = []
    for e in header["updates"]:
        left, right = (None if e[s] is None else views[e[s]] for s in _SIDES)
        updates.append(LowRankUpdate(e["n"], e["c"], left, right, e["s"], e["v"], e["k"]))
    dense = [(e["n"], views[e["t"]]) for e in header["dense"]]
    return updates, dense


def chunks(
    items: Iterable[Item], max_bytes: int
) -> Iterator[tuple[list[LowRankUpdate], list[tuple[str, torch.Tensor]]]]:
    """Group ``(update, None)`` / ``(None, (name, value))`` items, in order, into ``(updates, dense)`` messages of
    at most ``max_bytes`` of tensors each (an item larger than that goes alone)."""
    ups: list[LowRankUpdate] = []
    dense: list[tuple[str, torch.Tensor]] = []
    size = 0
    for u, d in items:
        n = u.nbytes if u is not None else tensor_nbytes(d[1])
        if (ups or dense) and size + n > max_bytes:
            yield ups, dense
            ups, dense, size = [], [], 0
        if u is not None:
            ups.append(u)
        else:
            dense.append(d)
        size += n
    if ups or dense:
        yield ups, dense
