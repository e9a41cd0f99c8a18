"""Data parallelism (DDP) for LoGRA: who averages a low-rank matrix's gradient across replicas.

Under ``DistributedDataParallel`` every replica computes a gradient on its own batch and DDP
averages them with a bucketed all-reduce *after* each parameter's gradient is complete. LoGRA's
post-accumulate-grad hook runs before that reduce, so a hook that sketches and frees the
gradient sees the local one (replicas diverge). Each low-rank parameter therefore gets one of
three modes when the optimizer is built (:func:`reduce_mode`):

============  ====================================================  ==================================
mode          when                                                  who averages, and what
============  ====================================================  ==================================
``"local"``   one process, or an FSDP2 row shard (its reduce-        nobody / FSDP2's reduce-scatter
              scatter runs before the hook; ``optim/sharding.py``)
``"sketch"``  several processes and the parameter is kept out of    LoGRA: one all-reduce (mean) of
              DDP (``param._ddp_ignored``, set by                   the gradient sketches, and on
              :func:`keep_out_of_ddp`)                              refresh steps the range sketches
``"grad"``    several processes and the parameter is not kept       DDP: the full gradient; LoGRA keeps
              out of DDP (plain ``Trainer(strategy="ddp")``)        it through backward and sketches
                                                                    the averaged one in the step
============  ====================================================  ==================================

``"sketch"`` is the communication-saving mode: a sketch is linear in the gradient, and every
replica holds the same basis (seeded identically), so the mean of the replicas' sketches is the
sketch of the mean gradient. Per step it all-reduces ``m*r`` (right) or ``r*n`` (left) numbers per
matrix instead of ``m*n``, plus ``n*(r+p)`` / ``m*(r+p)`` on a basis refresh, and DDP allocates no
gradient bucket for the matrix (DDP's buckets are a full fp32 copy of every gradient it reduces).
Lightning wraps the model in DDP *before* it calls ``configure_optimizers``, so LoGRA's matrices
can only be kept out by a strategy that builds the optimizer first:
:class:`~logra_lightning.optim.ddp_strategy.LoGRADDPStrategy` (``strategy="logra_ddp"``).

``"grad"`` keeps plain DDP correct (replicas bit-identical) at DDP's usual cost: full gradients
and buckets, a dense all-reduce. LoGRA warns once and names the fix.

A parameter in ``"sketch"`` mode is also no longer broadcast from rank 0 by DDP at wrap time,
so :meth:`LoGRA.setup_data_parallel` broadcasts it (a collective: every rank builds the optimizer).

:class:`Replicas` is LoGRA's side of all this: the modes, and the one all-reduce of a step's
sketches, run once per step by whichever comes first of clipping and ``prepare_update``.

Example::

    >>> import torch
    >>> reduce_mode(torch.nn.Linear(4, 4).weight, shard=None)  # no process group: one process
    'local'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from logra_lightning._util import WarnOnce

MODES = ("local", "sketch", "grad")


def world_size() -> int:
    """Processes in the default group (1 when ``torch.distributed`` is not initialized)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def reduce_mode(p: torch.Tensor, shard) -> str:
    """How low-rank param ``p`` (with its FSDP2 row ``shard`` or ``None``) is averaged across replicas.

    A DTensor replicated on every mesh dim (no shard) under FSDP2 is reduced by FSDP2, like a
    shard: only a plain tensor in a multi-process run is DDP's business.
    """
    if shard is not None or hasattr(p, "placements") or world_size() <= 1:
        return "local"
    return "sketch" if getattr(p, "_ddp_ignored", False) else "grad"


def keep_out_of_ddp(module: torch.nn.Module, params: Iterable[torch.Tensor]) -> list[str]:
    """Mark ``params`` (of ``module``) for DDP to ignore; call before ``module`` is wrapped in DDP.

    Uses DDP's own ``_set_params_and_buffers_to_ignore_for_model`` (which also sets
    ``param._ddp_ignored``), keeping names already ignored. Returns the names added.

    Raises:
        ValueError: a parameter is not one of ``module``'s.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    wanted = {id(p) for p in params}
    names = [n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in wanted]
    found = {id(p) for n, p in module.named_parameters(remove_duplicate=False) if id(p) in wanted}
    if found != wanted:
        raise ValueError(f"{len(wanted - found)} parameter(s) to keep out of DDP are not parameters of the module")
    before = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []) or [])
    DDP._set_params_and_buffers_to_ignore_for_model(module, list(dict.fromkeys(before + names)))
    return [n for n in names if n not in before]


def all_reduce_mean_(tensors: Sequence[torch.Tensor], group=None) -> int:
    """Average ``tensors`` over ``group`` in place with one flat all-reduce; returns the bytes reduced.

    All ranks must pass tensors of the same shapes in the same order.
    """
    if not tensors:
        return 0
    flat = torch.cat([t.reshape(-1).float() for t in tensors])  # [sum numel]
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat.div_(dist.get_world_size(group))
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return flat.numel() * flat.element_size()


def broadcast_(tensors: Iterable[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values (DDP's start-up broadcast, for what it ignores)."""
    for t in tensors:
        dist.broadcast(t.data, src=src)


class Replicas:
    """LoGRA's side of data parallelism: each low-rank param's mode and the per-step sketch all-reduce.

    Reads the optimizer through its public methods (``lowrank_params``, ``lowrank_matrix``,
    ``param_group``, ``named_params``, ``state``, ``step_state``, ``sketch_in_backward``).

    Attributes:
        modes: ``id(p)`` -> the mode of each low-rank param (:func:`reduce_mode`).
        bytes: bytes all-reduced for mode ``"sketch"`` so far.
    """

    def __init__(self) -> None:
        self.modes: dict[int, str] = {}
        self.bytes = 0
        self._checked = False  # modes compared with the process group since the last setup
        self._warn_once = WarnOnce()

    def setup(self, opt) -> dict[str, int]:
        """Set every low-rank param's mode; broadcast those entering ``"sketch"`` from rank 0 (a collective)."""
        entering = []
        for p in opt.lowrank_params():
            mode = reduce_mode(p, opt.lowrank_matrix(p).shard)
            if mode == "sketch" and self.modes.get(id(p)) != "sketch":
                entering.append(p)
            self.modes[id(p)] = mode
        if entering:
            broadcast_(entering)
        self._checked = False
        return {m: sum(v == m for v in self.modes.values()) for m in MODES}

    def _check(self, opt) -> None:
        """Once: the modes still match the process group and DDP marks (a mismatch would let replicas drift)."""
        if self._checked:
            return
        self._checked = True
        for name, p in opt.named_params():
            mat = opt.lowrank_matrix(p)
            if mat is not None and reduce_mode(p, mat.shard) != self.modes[id(p)]:
                raise RuntimeError(
                    f"LoGRA: {name!r} was set up for data-parallel mode {self.modes[id(p)]!r} but is now in "
                    f"{reduce_mode(p, mat.shard)!r}: build LoGRA after torch.distributed.init_process_group, and "
                    "call opt.setup_data_parallel() after keep_out_of_ddp() (LoGRADDPStrategy does both)"
                )

    def average_(self, opt) -> None:
        """Average this step's sketches (and range sketches) of mode-``"sketch"`` params over the replicas.

        One flat all-reduce per step, once (``step_state.reduced``). Every rank contributes every such
        param in the same order: a zero sketch where it had no gradient, and a touched flag, so a
        matrix that got a gradient on any replica steps on all of them. With
        ``sketch_in_backward=False`` the full gradients are averaged instead.
        """
        step = opt.step_state
        if step.reduced:
            return
        step.reduced = True
        self._check(opt)
        if "grad" in self.modes.values():
            self._warn_once(
                "ddp_grad",
                "LoGRA under DDP that reduces its low-rank matrices: their full gradients are kept and "
                "all-reduced (correct, but no gradient-memory or communication saving). Use "
                "`Trainer(strategy='logra_ddp')` (logra_lightning.optim.LoGRADDPStrategy): it keeps them out of "
                "DDP and LoGRA all-reduces their low-rank sketches instead",
            )
        members = [p for p in opt.lowrank_params() if self.modes[id(p)] == "sketch"]
        if not members:
            return
        flags = torch.zeros(len(members), device=members[0].device)  # [P]: had a gradient here
        tensors = [flags]
        for i, p in enumerate(members):
            if not opt.sketch_in_backward:
                flags[i] = float(p.grad is not None)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                tensors.append(p.grad)
                continue
            mat, group, st = opt.lowrank_matrix(p), opt.param_group(p), opt.state[p]
            flags[i] = float(id(p) in step.touched)
            if id(p) not in step.sketches:
                step.sketches[id(p)] = torch.zeros(mat.sketch_shape(), device=p.device)
            tensors.append(step.sketches[id(p)])
            if group["refresh"] == "randomized" and mat.refresh_due(st, group["update_proj_gap"]):
                if "range" not in st:
                    st["range"] = torch.zeros(mat.range_shape(group["oversample"]), device=p.device)
                tensors.append(st["range"])
        self.bytes += all_reduce_mean_(tensors)
        for p, flag in zip(members, flags.tolist()):
            if flag > 0:
                step.touched.add(id(p))
                continue
            step.touched.discard(id(p))  # no replica had a gradient: no step, like one process
            step.sketches.pop(id(p), None)
            opt.state[p].pop("range", None)
            if not opt.sketch_in_backward:
                p.grad = None
