"""Where a rank's rows of an FSDP2-sharded matrix sit, and the collectives LoGRA needs there.

FSDP2 (``torch.distributed.fsdp.fully_shard``, Lightning's ``ModelParallelStrategy``)
turns each parameter into a DTensor sharded on dim 0 with ``torch.chunk`` semantics:
rank ``i`` of the shard group holds rows ``[i*c, min((i+1)*c, m))`` with
``c = ceil(m / world)`` (the last ranks may hold fewer rows, or none). LoGRA keeps
its per-row state (right-sketch moments, left-sketch basis rows) for exactly those
rows, and draws its random matrices from the global shapes so a sharded run takes
the same steps as a single-process one (docs/design.md §3).

"Sharded" means a DTensor with a ``Shard(0)`` placement. A plain tensor, or a
DTensor replicated on every mesh dim, is a whole matrix on this rank (as under DDP,
where gradients arrive already averaged): nothing is reduced for it, whether or not
``torch.distributed`` is initialized.

Example::

    >>> import torch
    >>> row_shard(torch.nn.Linear(4, 4).weight) is None  # a plain tensor is not sharded
    True
    >>> chunk_rows(7, world=2, index=1)
    (4, 7)

The state LoGRA keeps for a sharded matrix (``m_i``: W's rows on this rank,
``n_j``: this rank's ``torch.chunk`` of W's ``n`` columns); only the ``[r]`` factor of a
factored second moment (docs/design.md §2) is replicated::

    side      basis              moments      sketch                                       factored V
    right     Q rows [n_j, r]    [m_i, r]     [m_i, r]                                     [m_i] + [r]
    left      P rows [m_i, r]    [r, n_j]     [r, n]  (partial sum P_i.T @ G_i until the step)  [r] + [n_j]
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# torch >= 2.13 renames all_gather_into_tensor (and deprecates the old name)
_all_gather_single = getattr(dist, "all_gather_single", getattr(dist, "all_gather_into_tensor", None))


@dataclass(frozen=True)
class RowShard:
    """This rank's rows ``[start, stop)`` of a dim-0 sharded parameter, and the group that shards it."""

    start: int
    stop: int
    index: int  # this rank's position in the shard group
    world: int  # size of the shard group
    group: Any  # torch.distributed.ProcessGroup of the mesh dim that shards dim 0

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def chunk(self, size: int) -> slice:
        """This rank's ``torch.chunk`` piece of another dimension of length ``size`` (e.g. W's columns)."""
        return slice(*chunk_rows(size, self.world, self.index))


def chunk_rows(m: int, world: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` that ``torch.chunk`` (hence FSDP2) gives to shard ``index`` of ``world``."""
    size = math.ceil(m / world) if m else 0
    start = min(index * size, m)
    return start, min(start + size, m)


def row_shard(p: torch.Tensor, name: str = "param") -> RowShard | None:
    """The row shard of ``p`` if it is a DTensor sharded on dim 0, else ``None`` (a whole matrix here).

    Raises:
        NotImplementedError: ``p`` is sharded in another way (e.g. tensor parallel ``Shard(1)``,
            or dim 0 sharded over two mesh dims), which LoGRA does not support.
    """
    placements = getattr(p, "placements", None)
    if placements is None:
        return None
    from torch.distributed.tensor import Shard

    shard_dims = [d for d, pl in enumerate(placements) if not pl.is_replicate()]
    if not shard_dims:
        return None
    pl = placements[shard_dims[0]]
    if len(shard_dims) > 1 or type(pl) is not Shard or pl.dim != 0:  # _StridedShard (FSDP2 + TP) included
        raise NotImplementedError(
            f"LoGRA supports parameters sharded on dim 0 over one mesh dim (FSDP2's fully_shard); "
            f"{name!r} has placements {tuple(placements)}. Keep low-rank weights out of tensor parallelism, "
            "or pass exclude=[...] to keep them in the dense AdamW group."
        )
    mesh, d = p.device_mesh, shard_dims[0]
    index, world, group = mesh.get_local_rank(d), mesh.size(d), mesh.get_group(d)
    start, stop = chunk_rows(p.shape[0], world, index)
    local_rows = p.to_local().shape[0]
    # a layout change in FSDP would otherwise silently misplace rows
    if stop - start != local_rows or dist.get_rank(group) != index:
        raise RuntimeError(
            f"{name!r}: expected rows [{start}, {stop}) of {p.shape[0]} on shard {index}, found {local_rows} "
            f"local rows on group rank {dist.get_rank(group)}"
        )
    return RowShard(start, stop, index, world, group)


def flatten_rows(shard: RowShard, shape: tuple[int, ...], name: str = "param") -> RowShard:
    """The shard of a dim-0 sharded ``[E, m, n]`` tensor as rows of its ``[E*m, n]`` matrix.

    Exact ``torch.chunk`` layout of the matrix rows needs ``E`` divisible by the shard group size.

    Example::

        >>> s = flatten_rows(RowShard(2, 4, 1, 2, None), (4, 3, 5))
        >>> s.start, s.stop
        (6, 12)
    """
    per = math.prod(shape[1:-1])
    if shape[0] % shard.world:
        raise NotImplementedError(
            f"{name!r} {tuple(shape)}: LoGRA needs the experts ({shape[0]}) divisible by the FSDP2 group "
            f"size ({shard.world}) to sketch a sharded 3-D weight; pass exclude=[...] to keep it dense"
        )
    return RowShard(shard.start * per, shard.stop * per, shard.index, shard.world, shard.group)


def all_reduce_sum_(t: torch.Tensor, group: Any) -> torch.Tensor:
    """In-place sum over ``group``; the identity when ``group`` is ``None`` (a whole matrix on this rank)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def gather_chunks(local: torch.Tensor, shard: RowShard, total: int) -> torch.Tensor:
    """The full ``[total, ...]`` tensor from every rank's ``torch.chunk`` piece of dim 0 (uneven pieces welcome).

    Each rank pads its piece to ``ceil(total / world)`` rows; with ``torch.chunk``
    semantics, piece ``i`` starts at row ``i * ceil(total / world)``, so the padded
    pieces concatenated in group order hold the result in their first ``total`` rows.
    """
    if shard.world == 1:
        return local
    size = math.ceil(total / shard.world)
    padded = local.new_zeros((size, *local.shape[1:]))
    padded[: local.shape[0]] = local
    out = local.new_empty((size * shard.world, *local.shape[1:]))
    _all_gather_single(out, padded, group=shard.group)
    return out[:total]


def complete_sketches(
    members: list[tuple[Hashable, torch.Tensor, RowShard | None, bool, bool]],
) -> tuple[set[Hashable], dict[Hashable, torch.Tensor]]:
    """Complete the partial left sketches of row-sharded matrices; find the non-finite sketches.

    ``members`` holds ``(key, sketch, shard, is_left, sum_col_sq)`` per matrix. A whole matrix is
    only checked. Per shard group, one all-reduce carries one non-finite flag per sharded matrix
    (so every rank skips the same matrices), every partial left sketch ``P_i.T @ G_i`` (summed in
    place) and, where ``sum_col_sq``, the ``[r]`` column sums of ``S_i * S_i`` of a right sketch
    (a factored second moment's column means need all ``m`` rows; docs/design.md §2).

    Returns:
        The keys of non-finite sketches, and ``key -> [r]`` column sums of ``S*S`` over all rows.
    """
    nonfinite: set[Hashable] = set()
    by_group: dict[Any, list[tuple[Hashable, torch.Tensor, bool, bool]]] = {}
    for key, sketch, shard, is_left, sum_col_sq in members:
        if shard is not None:
            by_group.setdefault(shard.group, []).append((key, sketch, is_left, sum_col_sq))
        elif not bool(torch.isfinite(sketch).all()):
            nonfinite.add(key)
    col_sums: dict[Hashable, torch.Tensor] = {}
    for pg, group in by_group.items():
        left = [s for _, s, is_left, _ in group if is_left]
        cols = [(key, s.square().sum(dim=0)) for key, s, _, sum_col_sq in group if sum_col_sq]  # [r] over m_i rows
        flags = [(~torch.isfinite(s)).any().float().reshape(1) for _, s, _, _ in group]
        flat = all_reduce_sum_(torch.cat(flags + [s.reshape(-1) for s in left] + [c for _, c in cols]), pg)
        offset = len(group)
        for s in left:
            s.copy_(flat[offset : offset + s.numel()].view_as(s))  # [r, n]: P.T @ G
            offset += s.numel()
        for key, c in cols:
            col_sums[key] = flat[offset : offset + c.numel()]  # [r] over all m rows
            offset += c.numel()
        nonfinite.update(key for (key, *_), bad in zip(group, flat[: len(group)].tolist()) if bad > 0)
    return nonfinite, col_sums
