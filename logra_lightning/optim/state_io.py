"""LoGRA's checkpoint format: ``Optimizer.state_dict()`` with placeholders and DTensor pieces (docs/design.md §3).

:meth:`LoGRA.state_dict <logra_lightning.optim.LoGRA.state_dict>` and
:meth:`~logra_lightning.optim.LoGRA.load_state_dict` call these. Two additions to
``torch.optim``'s format:

1. Every param has an entry: one whose dense AdamW state does not exist yet (it has not
   stepped) appears with step 0 and zero moments (:func:`dense_placeholder`), which loading
   drops again. Distributed checkpointing (DCP) loads into the ``state_dict()`` of a fresh
   optimizer, so a param missing there would not be restored.
2. Under FSDP2, a state tensor that is this rank's piece of a larger one is returned as a
   DTensor with its global shape (:func:`dtensor_layout`), so DCP saves every rank's piece
   rather than one rank's as if replicated, and reshards on load. Step counts and seeds are
   equal on every rank and stay plain tensors.

Example::

    >>> import torch
    >>> sorted(dense_placeholder(torch.zeros(3)))
    ['exp_avg', 'exp_avg_sq', 'step']
    >>> dtensor_layout(torch.zeros(3), {}, None, pending_sketch=False)  # a plain tensor: nothing to lay out
    {}
"""

from __future__ import annotations

from typing import Any

import torch

from logra_lightning._util import local
from logra_lightning.optim.matrix import LowRankMatrix

Layout = dict[str, tuple[tuple, tuple[int, ...]]]  # state key -> (placements, global shape)
MOMENT_KEYS = frozenset({"exp_avg", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col"})  # full or factored V


def dense_placeholder(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Step 0 and zero fp32 moments shaped like the local weight ``w``: a dense param that has not stepped."""
    return {
        "step": torch.zeros((), dtype=torch.int64),
        "exp_avg": torch.zeros_like(w, dtype=torch.float32),
        "exp_avg_sq": torch.zeros_like(w, dtype=torch.float32),
    }


def dtensor_layout(p: torch.Tensor, st: dict, mat: LowRankMatrix | None, *, pending_sketch: bool) -> Layout:
    """``{key: (placements, global shape)}`` of the state tensors of ``p`` that are this rank's piece.

    Empty unless ``p`` is a sharded DTensor. Dense AdamW moments share the param's layout.
    A row-sharded matrix (see the table in :mod:`~logra_lightning.optim.sharding`): right
    sketch, ``Q`` rows ``Shard(0)`` of ``[n, r]`` and moments ``Shard(0)`` of ``[m, r]``;
    left sketch, ``P`` rows ``Shard(0)`` of ``[m, r]`` and moments ``Shard(1)`` of ``[r, n]``. A
    factored second moment (LoGRA choice 8): the ``[m]`` (right) or ``[n]`` (left) factor is sharded
    like the moments' rows or columns, the ``[r]`` factor is replicated.

    Args:
        p: the param; st: its state; mat: its low-rank view (``None`` for a dense param).
        pending_sketch: ``p`` has an accumulated gradient sketch (between backward and step).

    Raises:
        RuntimeError: a sharded matrix holds a partial sum over ranks (its left sketch or range
            sketch between backward and ``step()``), which is no rank's piece of anything.
    """
    placements = getattr(p, "placements", None)
    if placements is None or all(pl.is_replicate() for pl in placements):
        return {}
    if mat is None or mat.shard is None:
        return {k: (tuple(placements), tuple(p.shape)) for k in ("exp_avg", "exp_avg_sq") if k in st}
    from torch.distributed.tensor import Replicate, Shard

    mesh_dim = next(i for i, pl in enumerate(placements) if not pl.is_replicate())

    def shard(dim: int) -> tuple:
        return tuple(Shard(dim) if i == mesh_dim else Replicate() for i in range(len(placements)))

    (m, n), r = mat.shape, mat.rank
    if "range" in st or (mat.side == "left" and pending_sketch):
        raise RuntimeError(
            "LoGRA.state_dict() was called between backward and step() on an FSDP2-sharded run: the "
            "accumulated sketches of sharded matrices are partial sums over ranks and cannot be saved as "
            "shards. Save after optimizer.step() (Lightning's checkpoints are taken there)."
        )
    replicate = tuple(Replicate() for _ in placements)
    if mat.side == "right":
        layout = {
            "basis": (shard(0), (n, r)),
            "exp_avg": (shard(0), (m, r)),
            "exp_avg_sq": (shard(0), (m, r)),
            "exp_avg_sq_row": (shard(0), (m,)),
            "exp_avg_sq_col": (replicate, (r,)),
        }
    else:
        layout = {
            "basis": (shard(0), (m, r)),
            "exp_avg": (shard(1), (r, n)),
            "exp_avg_sq": (shard(1), (r, n)),
            "exp_avg_sq_row": (replicate, (r,)),
            "exp_avg_sq_col": (shard(0), (n,)),
        }
    return {k: v for k, v in layout.items() if k in st}


def with_dtensors(st: dict[str, Any], p: torch.Tensor, layout: Layout) -> dict[str, Any]:
    """A copy of ``st`` whose tensors named in ``layout`` are DTensors on ``p``'s mesh (``st`` itself if none)."""
    if not layout:
        return st
    from torch.distributed.tensor import DTensor

    pieces = {
        k: DTensor.from_local(
            st[k],
            p.device_mesh,
            placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
        for k, (placements, shape) in layout.items()
    }
    return {**st, **pieces}


def restored_states(
    state_dict: dict[str, Any],
    params: list[torch.Tensor],
    names: list[str],
    matrices: dict[int, LowRankMatrix],
    previous: dict,
) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """``(param, state)`` pairs to load from ``state_dict``, matched in param-group order.

    Keyed by position (``torch.save``) or by parameter name (DCP's ``set_optimizer_state_dict``),
    whichever ``state_dict["param_groups"]`` lists. Values are local pieces (of DTensors), detached
    copies on the param's device; dense placeholders (step 0) are dropped.

    Args:
        params, names: the optimizer's params and their names, in param-group order.
        matrices: ``id(p)`` -> low-rank view, for the low-rank params.
        previous: the state before loading, to check low-rank shapes against.

    Raises:
        ValueError: a saved low-rank state tensor has another shape than here (e.g. another ``rank``,
            or a whole-matrix checkpoint loaded into a sharded run without DCP), or the checkpoint
            keeps the second moment otherwise (another ``second_moment``).
    """
    keys = [k for g in state_dict["param_groups"] for k in g["params"]]
    by_key = dict(zip(keys, zip(params, names)))
    out = []
    for key, values in state_dict["state"].items():
        p, name = by_key[key]
        st = {
            k: local(v).detach().clone().to(p.device) if torch.is_tensor(v) else v
            for k, v in values.items()
            if k != "sketch"
        }  # checkpoints from before sketches left the state held zeros there
        if id(p) not in matrices:
            if int(st.get("step", 1)) == 0:
                continue  # the placeholder of a dense param that had not stepped: it still has no state
        else:
            ours_keys, saved_keys = set(previous.get(p, {})) & MOMENT_KEYS, set(st) & MOMENT_KEYS
            if ours_keys and ours_keys != saved_keys:
                raise ValueError(
                    f"LoGRA.load_state_dict: {name!r} has moment state {sorted(saved_keys)} in the checkpoint "
                    f"but {sorted(ours_keys)} here (same second_moment needed)"
                )
            for k, ours in previous.get(p, {}).items():
                if k in ("basis", *MOMENT_KEYS) and st[k].shape != ours.shape:
                    raise ValueError(
                        f"LoGRA.load_state_dict: {name!r} has {k} of shape {tuple(st[k].shape)} in the "
                        f"checkpoint but {tuple(ours.shape)} here (same rank, side and sharding needed)"
                    )
        out.append((p, st))
    return out


class Checkpointing:
    """``state_dict`` / ``load_state_dict`` of :class:`~logra_lightning.optim.LoGRA` (one of its bases).

    Reads the optimizer's ``named_params()``, ``lowrank_matrix(p)`` and ``step_state`` (forgotten on
    load); ``super()`` is ``torch.optim.Optimizer``.
    """

    def state_dict(self) -> dict[str, Any]:
        """``Optimizer.state_dict()`` with every param listed and, under FSDP2, sharded state as DTensors.

        Ready for ``torch.save`` and distributed checkpointing (the format: this module's docstring).

        Raises:
            RuntimeError: under FSDP2 between backward and ``step()`` (partial sums over ranks; Lightning
                checkpoints after ``step()``).
        """
        sd = super().state_dict()
        state = sd["state"]  # keyed by position in param-group order; values are our live dicts: copy, don't edit
        for idx, (_, p) in enumerate(self.named_params()):
            mat = self.lowrank_matrix(p)
            if idx not in state and mat is None:
                state[idx] = dense_placeholder(local(p))
            if idx in state:
                layout = dtensor_layout(p, state[idx], mat, pending_sketch=id(p) in self.step_state.sketches)
                state[idx] = with_dtensors(state[idx], p, layout)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` wrote, saved whole or through DCP (:func:`restored_states`).

        Raises:
            ValueError: a saved low-rank state tensor has another shape than here (another ``rank``, side or
                sharding), or the second moment is kept otherwise (another ``second_moment``).
        """
        previous = self.state
        super().load_state_dict({**state_dict, "state": {}})  # checks group sizes, restores hyperparameters
        named = self.named_params()
        matrices = {id(p): m for _, p in named if (m := self.lowrank_matrix(p)) is not None}
        for p, st in restored_states(state_dict, [p for _, p in named], [n for n, _ in named], matrices, previous):
            self.state[p] = st
        self.step_state.reset("all")  # a step in flight belongs to the weights before the load
