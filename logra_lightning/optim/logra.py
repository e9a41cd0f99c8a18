"""LoGRA: Adam on low-rank gradient sketches, with dense AdamW for the rest (docs/design.md §2).

The math lives in :mod:`logra_lightning.optim.sketch`; this class holds state
and orchestrates: backward hooks that sketch and free gradients, the two-phase
step (``prepare_update`` / ``perturb_`` / ``set_step_scale`` / ``step``) used by
predicted-KL step control, basis refreshes, and factored update records for
low-rank weight sync. Tested against :class:`LoGRAReference` in
``tests/test_optim_logra.py``; memory in ``benchmarks/optimizer_memory.py``.

Choices and departures (numbered, as promised by the house style):

1. **First basis.** Each matrix starts from a seeded random orthonormal basis
   (the identity when ``rank`` equals the sketched dimension). Step 0 is a
   refresh step: its backward also accumulates the range sketch, so step 1's
   update uses the random basis (still a descent direction, ``<G, G Q Q^T> >= 0``)
   and step 2 onward uses a basis fitted to the gradients. No step ever holds
   a full gradient, so the first step's memory peak is the same as the others.
2. **Refresh.** With ``refresh="randomized"``, on steps ``k`` (completed steps)
   with ``k % update_proj_gap == 0`` the hook also adds ``Y += G.T @ Omega``
   (``Omega`` Gaussian ``[m, rank + oversample]`` from ``(seed, param index, k)``).
   The new basis is the top-``rank`` left singular vectors of ``Y`` and takes
   effect after this step's update is applied. ``refresh="svd"`` (exact SVD of
   ``G``, GaLore's projector) needs ``sketch_in_backward=False``.
3. **Moments across a refresh.** ``M <- M @ R``, ``V <- V @ (R*R)`` with
   ``R = Q_old.T @ Q_new`` (see :func:`~logra_lightning.optim.sketch.rotate_moments`);
   the step count and bias correction keep running.
4. **Non-finite values.** A NaN/inf range sketch skips that refresh (old basis
   kept, ``skipped_refreshes`` += 1, warned once). A NaN/inf gradient sketch
   skips that matrix's step (``skipped_updates`` += 1); nothing non-finite is
   written to the moments.
5. **Gradients are gone after backward** for low-rank params in the default
   mode (``p.grad is None``): gradient clipping or grad-norm logging on them
   sees nothing. Use ``sketch_in_backward=False`` if you need them. The
   accumulated sketch takes the gradient's place and lifetime: it is allocated
   by the first backward hook of a step, consumed by ``prepare_update`` and
   dropped by ``zero_grad``; it is not optimizer state and is not checkpointed
   (checkpoints are taken after ``step()``, when there is none).
6. **FSDP2 (row-sharded DTensors; layout table in :mod:`~logra_lightning.optim.sharding`).**
   Sides and random matrices come from the *global* shape, so a sharded run
   takes the same steps as one process (``tests/test_fsdp2.py``). Every state
   tensor is sharded, none replicated, so a rank holds about ``1/world`` of the
   single-process state: right sketch: moments/sketch ``[m_i, r]`` (W's rows
   here), basis rows ``Q_j`` (a chunk of W's columns), all-gathered when used
   (in the hook, and once per step from ``prepare_update`` until the update is
   applied); the refresh sums ``G_i.T @ Omega_i`` (``Omega_i``: this rank's rows
   of the global ``Omega``) with one all-reduce. Left sketch: basis rows
   ``P_i``; the partial ``P_i.T @ G_i`` is summed over ranks once per step (all
   sharded left sketches and the non-finite flags of all sharded matrices in one
   all-reduce), Adam runs on this rank's column chunk ``[r, n_j]`` and the
   direction is all-gathered; the refresh gathers the ``[m, r + p]`` range
   sketch. Rotations ``R`` are summed over ranks (one ``[r, r]`` all-reduce).
   Dense AdamW state is the local shard. State tensors are plain local tensors;
   ``state_dict()`` returns the sharded ones as DTensors, so Lightning's
   ``ModelParallelStrategy`` saves and restores them with distributed checkpointing
   (``tests/test_fsdp_lightning.py``). ``refresh="svd"``
   gathers the full gradient. ``update_max_abs`` and recorded factors are local:
   the left factor holds this rank's rows (see :meth:`LoGRA.row_shard`).
7. **3-D expert weights** (transformers' fused MoE experts, ``[E, m, n]``) are one
   ``[E*m, n]`` matrix with a right sketch by default: one input-space basis
   ``Q [n, r]`` shared by the experts, moments ``[E*m, r]`` per expert row, so each
   expert's update ``U_e @ Q.T`` has rank <= r of its own, and experts the router did
   not pick have zero sketch rows (like Adam, they move only by momentum), as with
   embeddings. A left sketch would give all experts together one rank-r update.
   Under FSDP2 (sharded by experts) the number of experts must divide by the group size.
8. **Low-precision weights** (``trainer.precision: bf16-true``; moments, bases and sketches
   stay fp32): the update is computed in fp32 and added with one rounding, by the rule
   ``bf16_update`` (:mod:`~logra_lightning.optim.rounding`): ``"nearest"`` loses every entry
   whose update is below half a bf16 ulp of its weight (counted in ``lost_updates`` out of
   ``low_precision_updates``); ``"stochastic"`` rounds up or down without bias (random bits
   from ``(seed, step, param index)``, so a resumed run rounds the same way; no extra memory);
   ``"kahan"`` keeps the rounding error in a bf16 buffer ``bf16_comp`` in the state (2 bytes
   per weight) and adds it back next step. Measured on the RL task (README, bf16 row):
   at lr 1e-4 ``"nearest"`` lost 94.9% of the entries' updates and RL stalled (57.4% -> 66.4%
   held-out accuracy in 100 steps), ``"stochastic"`` and ``"kahan"`` both reached 96.5%; use
   ``"stochastic"`` (no extra memory). The other answer, fp32 master weights with bf16 autocast,
   is Lightning's ``bf16-mixed``; the hook and the step run with autocast off, so the sketches,
   moments and updates stay fp32 there.

Example::

    >>> import torch, lightning as L
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    >>> opt = LoGRA(list(model.named_parameters()), lr=1e-3, rank=4, update_proj_gap=50)
    >>> model(torch.randn(8, 16)).pow(2).mean().backward()
    >>> model[0].weight.grad is None
    True
    >>> opt.step(); opt.zero_grad()
    >>> # In a LightningModule: return LoGRA(list(self.policy.named_parameters()), rank=8)
    >>> # from configure_optimizers, then L.Trainer(...).fit(module).
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from typing import Any, Callable

import torch

from logra_lightning.optim import sharding as sh
from logra_lightning.optim import rounding
from logra_lightning.optim import sketch as sk
from logra_lightning.optim.groups import normalize_params, split_named_params
from logra_lightning.sync_wire import LowRankUpdate

_SIDES = ("auto", "left", "right")
_REFRESH = ("randomized", "svd")


def resolve_side(side: str, shape: torch.Size) -> str:
    """``"auto"`` -> the side with the smaller state: right (``[m, r]``) if ``m <= n`` else left (``[r, n]``)."""
    if side != "auto":
        return side
    m, n = shape
    return "right" if m <= n else "left"


def _mshape(p: torch.Tensor) -> torch.Size:
    """The matrix LoGRA sees: a 3-D expert weight ``[E, m, n]`` is one ``[E*m, n]`` matrix (choice 7)."""
    return torch.Size((math.prod(p.shape[:-1]), p.shape[-1])) if p.ndim > 2 else p.shape


def _matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as :func:`_mshape` (a view: in-place changes reach the parameter)."""
    return t.view(-1, t.shape[-1]) if t.ndim > 2 else t


def _side(group: dict, p: torch.Tensor) -> str:
    """The sketched side of ``p``: a 3-D expert weight defaults to right (per-expert moments; choice 7)."""
    return "right" if p.ndim > 2 and group["side"] == "auto" else resolve_side(group["side"], _mshape(p))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _autocast_off() -> contextlib.ExitStack:
    """Autocast switched off where it is on. Lightning's ``bf16-mixed`` runs a manual-optimization
    ``training_step`` (backward hooks and ``optimizer.step()`` included) under autocast, which would
    compute sketches, moments and updates in bf16; they are fp32 by design."""
    stack = contextlib.ExitStack()
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def _outside_autocast(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _autocast_off():
            return fn(*args, **kwargs)

    return wrapper


def _validate_hparams(lr, betas, eps, weight_decay, update_proj_gap, scale, side, refresh, oversample, rank) -> None:
    if not lr >= 0:
        raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
    if not eps >= 0:
        raise ValueError(f"Invalid epsilon value: {eps} (must be >= 0)")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Invalid betas: {betas} (each must be in [0, 1))")
    if not weight_decay >= 0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
    if not (isinstance(update_proj_gap, int) and update_proj_gap >= 1):
        raise ValueError(f"Invalid update_proj_gap: {update_proj_gap} (must be an int >= 1)")
    if not scale > 0:
        raise ValueError(f"Invalid scale: {scale} (must be > 0)")
    if side not in _SIDES:
        raise ValueError(f"Invalid side: {side!r} (allowed: {', '.join(map(repr, _SIDES))})")
    if refresh not in _REFRESH:
        raise ValueError(f"Invalid refresh: {refresh!r} (allowed: {', '.join(map(repr, _REFRESH))})")
    if not (isinstance(oversample, int) and oversample >= 0):
        raise ValueError(f"Invalid oversample: {oversample} (must be an int >= 0)")
    if rank is not None and not (isinstance(rank, int) and rank >= 1):
        raise ValueError(f"Invalid rank: {rank} (must be an int >= 1, or None for dense AdamW)")


class LoGRA(torch.optim.Optimizer):
    """Adam whose moments live in rank-``r`` gradient sketches; dense AdamW for groups without ``rank``.

    Args:
        params: param groups (dicts, optionally with ``param_names`` and the per-group
            keys below), an iterable of tensors, or of ``(name, tensor)`` pairs.
        lr: learning rate. betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled decay).
        rank: if given and no group carries its own ``rank``, split the params by the
            name+shape rule of :func:`~logra_lightning.optim.groups.split_named_params`
            (2-D, ``include``/``exclude`` regexes) into low-rank and dense groups.
        update_proj_gap: steps between basis refreshes (per group).
        scale: multiplier of the low-rank update (GaLore's ``scale``).
        side: ``"auto"`` (smaller state), ``"left"`` or ``"right"``.
        refresh: ``"randomized"`` (range sketch, default) or ``"svd"`` (exact, needs
            ``sketch_in_backward=False``).
        oversample: extra range-sketch columns ``p``.
        sketch_in_backward: sketch and free each gradient in a post-accumulate-grad
            hook (default). ``False``: keep full grads and project in ``step`` (GaLore-style).
        include, exclude: regexes for the automatic split (only with ``rank``).
        seed: base seed of the initial bases and range-sketch test matrices.
        bf16_update: how the fp32 update is added to bf16/fp16 weights (choice 8):
            ``"nearest"``, ``"stochastic"`` (bf16 only) or ``"kahan"``. fp32 weights are
            updated in fp32 whatever this says.

    Raises:
        ValueError: a hyperparameter out of range, ``rank`` larger than a matrix's
            smaller side (names the param and its shape), or ``refresh="svd"`` with
            ``sketch_in_backward=True``.

    Example::

        >>> import torch
        >>> from logra_lightning.optim import LoGRA, logra_param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 2))
        >>> opt = LoGRA(logra_param_groups(model, rank=2, update_proj_gap=10), lr=1e-3)
        >>> model(torch.randn(4, 32)).sum().backward()
        >>> opt.prepare_update(); opt.set_step_scale(0.5); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        rank: int | None = None,
        update_proj_gap: int = 200,
        scale: float = 1.0,
        side: str = "auto",
        refresh: str = "randomized",
        oversample: int = 8,
        sketch_in_backward: bool = True,
        include=None,
        exclude=None,
        seed: int = 0,
        bf16_update: str = "nearest",
    ) -> None:
        if bf16_update not in rounding.MODES:
            raise ValueError(f"Invalid bf16_update: {bf16_update!r} (allowed: {', '.join(rounding.MODES)})")
        _validate_hparams(lr, betas, eps, weight_decay, update_proj_gap, scale, side, refresh, oversample, rank)
        groups = normalize_params(params)
        if rank is not None and not any("rank" in g for g in groups):
            split = []
            for g in groups:
                extra = {k: v for k, v in g.items() if k not in ("params", "param_names")}
                for sub in split_named_params(
                    zip(g["param_names"], g["params"]), rank, include=include, exclude=exclude
                ):
                    split.append({**extra, **sub})
            groups = split
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            update_proj_gap=update_proj_gap, scale=scale, side=side, refresh=refresh, oversample=oversample,
        )  # fmt: skip
        self.sketch_in_backward = bool(sketch_in_backward)
        self.seed = int(seed)
        self.bf16_update = bf16_update
        self.lost_updates = 0  # bf16/fp16 weight entries whose nonzero update rounded to no change
        self.low_precision_updates = 0  # bf16/fp16 weight entries updated
        self.skipped_refreshes = 0
        self.skipped_updates = 0
        self.record_updates = False
        self._applied: list[list[LowRankUpdate]] = []
        self._pending: dict[torch.Tensor, dict[str, Any]] = {}
        self._prepared = False
        self._perturb_total = 0.0
        self._step_scale = 1.0
        self._touched: set[int] = set()
        self._warned: set[str] = set()
        self._hooks: list = []
        self._param_index: dict[int, int] = {}
        self._group_of: dict[int, dict] = {}
        # id(p) -> accumulated gradient sketch: like p.grad, not state. Allocated by the first
        # backward hook of a step, consumed by prepare_update(), dropped by zero_grad().
        self._sketches: dict[int, torch.Tensor] = {}
        self._shards: dict[int, sh.RowShard] = {}  # id(p) -> this rank's rows of a row-sharded low-rank matrix
        super().__init__(groups, defaults)
        for group in self.param_groups:
            self._init_group(group)
        if not any(self._is_lowrank(g) for g in self.param_groups):
            self._warn_once(
                "dense", "LoGRA has no low-rank param group: every param gets dense AdamW. Pass `rank=` "
                "or use `logra_param_groups(model, rank=...)`.",
            )  # fmt: skip

    # ----------------------------------------------------------------- setup
    @staticmethod
    def _is_lowrank(group: dict) -> bool:
        return group.get("rank") is not None

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=3)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_hooks") and self.param_groups[-1] is not None and self._group_of:
            self._init_group(self.param_groups[-1])

    def _init_group(self, group: dict) -> None:
        _validate_hparams(
            group["lr"], group["betas"], group["eps"], group["weight_decay"], group["update_proj_gap"],
            group["scale"], group["side"], group["refresh"], group["oversample"], group.get("rank"),
        )  # fmt: skip
        lowrank = self._is_lowrank(group)
        if lowrank and group["refresh"] == "svd" and self.sketch_in_backward:
            raise ValueError(
                "refresh='svd' needs the full gradient: set sketch_in_backward=False, or use refresh='randomized'"
            )
        for name, p in zip(group["param_names"], group["params"]):
            self._param_index.setdefault(id(p), len(self._param_index))
            self._group_of[id(p)] = group
            if not lowrank:
                continue
            if p.ndim not in (2, 3):
                raise ValueError(
                    f"Low-rank param {name!r} has shape {tuple(p.shape)}; only 2-D (and 3-D expert) params can be low-rank"
                )
            rank, side = group["rank"], _side(group, p)
            if rank > min(_mshape(p)):
                raise ValueError(
                    f"rank={rank} is larger than min(m, n)={min(_mshape(p))} of {name!r} with shape "
                    f"{tuple(p.shape)} (allowed: 1 <= rank <= {min(_mshape(p))})"
                )
            if rank > (_mshape(p)[1] if side == "right" else _mshape(p)[0]):
                raise ValueError(f"rank={rank} exceeds the {side} dimension of {name!r} with shape {tuple(p.shape)}")
            shard = sh.row_shard(p, name)
            if shard is not None and p.ndim > 2:
                shard = sh.flatten_rows(shard, tuple(p.shape), name)  # experts' rows of the [E*m, n] matrix
            if shard is not None:
                self._shards[id(p)] = shard
            self._init_lowrank_state(p, rank, side)
            if self.sketch_in_backward:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._sketch_hook))

    def _init_lowrank_state(self, p: torch.Tensor, rank: int, side: str) -> None:
        m, n = _mshape(p)  # global shape, also for a row-sharded DTensor
        shard = self._shards.get(id(p))
        seed = sk.mix_seed(self.seed, self._param_index[id(p)])
        dim = n if side == "right" else m
        moment_shape = (m, rank) if side == "right" else (rank, n)
        dev = p.device
        basis = sk.random_orthonormal(dim, rank, seed, device=dev)  # [n, r] | [m, r]
        if shard is not None:
            basis = basis[self._basis_rows(p, side)].clone()  # [n_j, r] | [m_i, r], own storage
            if side == "right":
                moment_shape = (shard.rows, rank)  # [m_i, r]
            else:
                cols = shard.chunk(n)
                moment_shape = (rank, cols.stop - cols.start)  # [r, n_j]
        self.state[p] = {
            "step": torch.zeros((), dtype=torch.int64),
            "seed": torch.tensor(seed, dtype=torch.int64),
            "basis": basis,  # [n, r] | [m, r]
            "exp_avg": torch.zeros(moment_shape, dtype=torch.float32, device=dev),  # [m, r] | [r, n]
            "exp_avg_sq": torch.zeros(moment_shape, dtype=torch.float32, device=dev),
        }

    def _basis_rows(self, p: torch.Tensor, side: str) -> slice:
        """Rows of the basis a sharded matrix keeps here: W's rows (``P``, left) or a chunk of W's columns (``Q``)."""
        shard = self._shards[id(p)]
        return slice(shard.start, shard.stop) if side == "left" else shard.chunk(_mshape(p)[1])

    def _full_basis(self, p: torch.Tensor, side: str) -> torch.Tensor:
        """The basis as the matmuls need it: ``Q`` gathered for a sharded right sketch, else the stored one."""
        shard = self._shards.get(id(p))
        if shard is None or side == "left":
            return self.state[p]["basis"]  # [n, r] | [m_i, r]
        return sh.gather_chunks(self.state[p]["basis"], shard, _mshape(p)[1])  # [n, r]

    # -------------------------------------------------------------- sketching
    def _refresh_due(self, group: dict, st: dict, p: torch.Tensor) -> bool:
        side = _side(group, p)
        fixed = group["rank"] == _mshape(p)[1 if side == "right" else 0]  # full rank: identity basis, nothing to pick
        return not fixed and int(st["step"]) % group["update_proj_gap"] == 0

    def _omega(self, st: dict, group: dict, p: torch.Tensor, side: str) -> torch.Tensor:
        k = group["rank"] + group["oversample"]
        rows, cols = sk.range_test_matrix_shape(tuple(_mshape(p)), k, side)
        omega = sk.gaussian(rows, cols, sk.mix_seed(int(st["seed"]), int(st["step"]), 1), device=p.device)
        shard = self._shards.get(id(p))
        if shard is not None and side == "right":
            omega = omega[shard.start : shard.stop]  # [m_i, k]: this rank's rows of the global Omega
        return omega

    def row_shard(self, p: torch.Tensor) -> sh.RowShard | None:
        """This rank's rows of low-rank param ``p`` under FSDP2, or ``None`` when ``p`` is whole here."""
        return self._shards.get(id(p))

    def _accumulate(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        """Add one gradient's sketch (and range sketch on refresh steps) into the state."""
        st = self.state[p]
        side = _side(group, p)
        g = _matrix(_local(grad))  # [m_i, n]
        s = sk.project(g, self._full_basis(p, side), side)  # [m_i, r] | [r, n], fp32
        if id(p) in self._sketches:
            self._sketches[id(p)].add_(s)
        else:
            self._sketches[id(p)] = s
        if group["refresh"] == "randomized" and self._refresh_due(group, st, p):
            y = sk.range_sketch(g, self._omega(st, group, p, side), side)  # [n, k] | [m, k]
            if "range" in st:
                st["range"].add_(y)
            else:
                st["range"] = y
        self._touched.add(id(p))

    @torch.no_grad()
    @_outside_autocast
    def _sketch_hook(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        self._accumulate(p, p.grad, self._group_of[id(p)])
        p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop grads and the accumulated sketches, like grads (pending candidate updates are kept)."""
        super().zero_grad(set_to_none=set_to_none)
        if self.sketch_in_backward:
            self._sketches.clear()
            for group in self.param_groups:
                if self._is_lowrank(group):
                    for p in group["params"]:
                        self.state[p].pop("range", None)
        self._touched.clear()

    # ------------------------------------------------------------ two phases
    @torch.no_grad()
    @_outside_autocast
    def prepare_update(self) -> None:
        """Advance step counts and moments and hold the candidate update Δ. Idempotent until applied."""
        if self._prepared:
            return
        if not self.sketch_in_backward:
            self._sketch_full_grads()
        nonfinite = self._sync_sketches()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            info = {"lr": group["lr"], "wd": group["weight_decay"]}
            for p in group["params"]:
                if self._is_lowrank(group):
                    pend = self._prepare_lowrank(p, group, beta1, beta2, nonfinite)
                else:
                    pend = self._prepare_dense(p, beta1, beta2)
                if pend is not None:
                    self._pending[p] = {**info, **pend}
        self._prepared = True

    def _sketch_full_grads(self) -> None:
        """``sketch_in_backward=False``: sketch this step's full gradients now (GaLore-style)."""
        for group in self.param_groups:
            if not self._is_lowrank(group):
                continue
            for p in group["params"]:
                self._touched.discard(id(p))
                if p.grad is not None:
                    self._sketches.pop(id(p), None)
                    self.state[p].pop("range", None)
                    self._accumulate(p, p.grad, group)

    def gradient_sketches(self) -> list[torch.Tensor]:
        """The accumulated gradient sketches of this step (what backward left in place of ``p.grad``)."""
        return list(self._sketches.values())

    def _sync_sketches(self) -> set[int]:
        """Complete the sketches of row-sharded matrices; return the ids of non-finite ones (skipped everywhere).

        Per shard group, one all-reduce carries every partial left sketch ``P_i.T @ G_i``
        and one non-finite flag per sharded matrix, so all ranks skip the same steps.
        """
        nonfinite: set[int] = set()
        by_group: dict[Any, list[tuple[torch.Tensor, str]]] = {}
        for group in self.param_groups:
            if not self._is_lowrank(group):
                continue
            for p in group["params"]:
                if id(p) not in self._touched:
                    continue
                shard = self._shards.get(id(p))
                if shard is not None:
                    by_group.setdefault(shard.group, []).append((p, _side(group, p)))
                elif not bool(torch.isfinite(self._sketches[id(p)]).all()):
                    nonfinite.add(id(p))
        for pg, members in by_group.items():
            sketches = [self._sketches[id(p)] for p, side in members if side == "left"]
            flags = [(~torch.isfinite(self._sketches[id(p)])).any().float().reshape(1) for p, _ in members]
            flat = sh.all_reduce_sum_(torch.cat(flags + [s.reshape(-1) for s in sketches]), pg)
            offset = len(members)
            for s in sketches:
                s.copy_(flat[offset : offset + s.numel()].view_as(s))  # [r, n]: P.T @ G
                offset += s.numel()
            nonfinite.update(id(p) for (p, _), bad in zip(members, flat[: len(members)].tolist()) if bad > 0)
        return nonfinite

    def _next_basis(self, p, group, st, side) -> torch.Tensor | None:
        """The refreshed basis (this rank's chunk of its rows when sharded), or ``None`` to keep the old one."""
        shard = self._shards.get(id(p))
        if group["refresh"] == "svd":
            g = _matrix(p.grad.full_tensor() if shard is not None else _local(p.grad))  # the reference mode gathers G
            y = sk.exact_basis(g, group["rank"], side)
        else:
            y = st.pop("range", None)
            if y is None:
                return None  # no gradient reached this matrix on its refresh step: keep the basis
            if shard is not None and side == "right":
                y = sk.reduce_range_sketch(y, shard.group)  # [n, k]: sum_i G_i.T @ Omega_i
            elif shard is not None:
                y = sh.gather_chunks(y, shard, _mshape(p)[0])  # [m, k]: rows G_i @ Omega from every rank
        if not bool(torch.isfinite(y).all()):
            self.skipped_refreshes += 1
            self._warn_once("nan_refresh", "LoGRA: non-finite range sketch; keeping the old basis")
            return None
        basis = y if group["refresh"] == "svd" else sk.basis_from_range(y, group["rank"])
        if shard is not None:
            basis = basis[self._basis_rows(p, side)].clone()  # own storage: a row slice would pin all rows
        return basis

    def _prepare_lowrank(self, p, group, beta1, beta2, nonfinite: set[int]) -> dict | None:
        st = self.state[p]
        side = _side(group, p)
        if id(p) not in self._touched:
            return None
        sketch = self._sketches.pop(id(p))  # consumed here: freed when this step's moments are updated
        if id(p) in nonfinite:
            self.skipped_updates += 1
            self._warn_once("nan_update", "LoGRA: non-finite gradient sketch; skipping that matrix's step")
            st.pop("range", None)
            return None
        next_basis = self._next_basis(p, group, st, side) if self._refresh_due(group, st, p) else None
        st["step"] += 1
        shard = self._shards.get(id(p))
        s = sketch[:, shard.chunk(_mshape(p)[1])] if shard is not None and side == "left" else sketch  # [r, n_j]
        sk.adam_moments_(st["exp_avg"], st["exp_avg_sq"], s, beta1, beta2)
        del sketch, s
        u = sk.adam_direction(st["exp_avg"], st["exp_avg_sq"], int(st["step"]), beta1, beta2, group["eps"])
        pend = {"u": u, "side": side, "scale": group["scale"], "next_basis": next_basis}
        if shard is not None and side == "left":
            pend["u"] = sh.gather_chunks(u.T, shard, _mshape(p)[1]).T  # [r, n] from every rank's [r, n_j]
        elif shard is not None:
            pend["basis"] = self._full_basis(p, side)  # [n, r], held until the update is applied
        return pend

    def _prepare_dense(self, p, beta1, beta2) -> dict | None:
        if p.grad is None:
            return None
        st = self.state[p]
        if not st:  # moments of the local shard under FSDP2
            w = _local(p)
            st["step"] = torch.zeros((), dtype=torch.int64)
            st["exp_avg"] = torch.zeros_like(w, dtype=torch.float32, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(w, dtype=torch.float32, memory_format=torch.preserve_format)
        st["step"] += 1
        sk.adam_moments_(st["exp_avg"], st["exp_avg_sq"], _local(p.grad).float(), beta1, beta2)
        return {"u": None}

    def _dense_direction(self, p, group) -> torch.Tensor:
        st = self.state[p]
        beta1, beta2 = group["betas"]
        return sk.adam_direction(st["exp_avg"], st["exp_avg_sq"], int(st["step"]), beta1, beta2, group["eps"])

    def _require_prepared(self, what: str) -> None:
        if not self._prepared:
            raise RuntimeError(f"{what} needs a candidate update: call opt.prepare_update() after backward first")

    @torch.no_grad()
    @_outside_autocast
    def update_max_abs(self) -> float:
        """Max ``|element|`` of the scale-1 candidate update Δ (incl. weight decay) over all params."""
        self._require_prepared("update_max_abs()")
        best = 0.0
        for group in self.param_groups:
            for p in group["params"]:
                pend = self._pending.get(p)
                if pend is None:
                    continue
                lr, wd = pend["lr"], pend["wd"]
                if pend["u"] is None:
                    delta = self._dense_direction(p, group).mul_(-lr)
                else:
                    basis = pend.get("basis", self.state[p]["basis"])
                    delta = sk.lowrank_delta(pend["u"], basis, pend["side"]).mul_(-lr * pend["scale"])
                if wd:
                    delta.add_(_matrix(_local(p)).float() if pend["u"] is not None else _local(p).float(), alpha=-lr * wd)
                if delta.numel():  # a rank may hold no rows of a small sharded matrix
                    best = max(best, float(delta.abs().max()))
        return best

    def _move(self, p, group, pend, start: float, end: float) -> None:
        """Take W from ``c(start)*W0 + start*Δ_add`` to ``c(end)*W0 + end*Δ_add``; ``c(a) = 1 - a*lr*wd``."""
        lr, wd = pend["lr"], pend["wd"]
        k = (1 - end * lr * wd) / (1 - start * lr * wd) if wd else 1.0
        coef = end - start * k
        w = _local(p)
        if k != 1.0:
            w.mul_(k)
        if coef == 0.0:
            return
        if pend["u"] is None:
            if w.dtype in (torch.float32, torch.float64):
                w.add_(self._dense_direction(p, group).to(w.dtype), alpha=-lr * coef)
            else:
                self._add_low_precision(p, w, self._dense_direction(p, group).mul_(-lr * coef))
            return
        w = _matrix(w)  # [m, n]
        u, basis, side = pend["u"], pend.get("basis", self.state[p]["basis"]), pend["side"]
        alpha = -lr * pend["scale"] * coef
        if w.dtype == u.dtype:
            if side == "right":
                w.addmm_(u, basis.T, alpha=alpha)  # [m, r] @ [r, n]
            else:
                w.addmm_(basis, u, alpha=alpha)  # [m, r] @ [r, n]
        else:
            self._add_low_precision(p, w, sk.lowrank_delta(u, basis, side).mul_(alpha))

    def _add_low_precision(self, p: torch.Tensor, w: torch.Tensor, delta: torch.Tensor) -> None:
        """``w += delta`` for bf16/fp16 weights with the ``bf16_update`` rule (choice 8); counts lost entries."""
        if self.bf16_update == "kahan":
            comp = self.state[p].setdefault("bf16_comp", torch.zeros_like(w))
            new, comp_new = rounding.add_kahan(w, delta, comp)
            comp.copy_(comp_new)
        elif self.bf16_update == "stochastic" and w.dtype == torch.bfloat16:
            step = int(self.state[p].get("step", 0))
            gen = torch.Generator().manual_seed(sk.mix_seed(sk.mix_seed(self.seed, 0x5EED), step, self._param_index[id(p)]))
            new = rounding.add_stochastic(w, delta, gen)
        else:
            new = rounding.add_nearest(w, delta)
        self.lost_updates += rounding.lost_updates(w, new, delta)
        self.low_precision_updates += delta.numel()
        w.copy_(new)

    @torch.no_grad()
    @_outside_autocast
    def perturb_(self, alpha: float) -> None:
        """In place ``W += alpha * Δ`` for every param with a candidate; ``+a`` then ``-a`` restores W."""
        self._require_prepared("perturb_()")
        alpha = float(alpha)
        for group in self.param_groups:
            for p in group["params"]:
                if p in self._pending:
                    self._move(p, group, self._pending[p], self._perturb_total, self._perturb_total + alpha)
        self._perturb_total += alpha

    def set_step_scale(self, eta: float) -> None:
        """The next ``step()`` applies ``eta * Δ`` (then the scale resets to 1)."""
        eta = float(eta)
        if not (math.isfinite(eta) and eta >= 0):
            raise ValueError(f"Invalid step scale: {eta} (must be finite and >= 0)")
        self._step_scale = eta

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Run ``closure`` (backward inside), prepare if needed, apply ``eta * Δ``, reset ``eta`` to 1."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with _autocast_off():
            self.prepare_update()
            self._apply(self._step_scale)
        self._step_scale = 1.0
        return loss

    def _apply(self, eta: float) -> None:
        records: list[LowRankUpdate] = []
        names = {id(p): n for g in self.param_groups for n, p in zip(g["param_names"], g["params"])}
        for group in self.param_groups:
            for p in group["params"]:
                pend = self._pending.get(p)
                if pend is None:
                    continue
                self._move(p, group, pend, self._perturb_total, eta)
                if pend["u"] is None:
                    continue
                st = self.state[p]
                if self.record_updates:
                    left, right = sk.lowrank_factors(
                        pend["u"], pend.get("basis", st["basis"]), pend["side"], -eta * pend["lr"] * pend["scale"]
                    )
                    c = 1.0 - eta * pend["lr"] * pend["wd"]
                    records.append(LowRankUpdate(names[id(p)], c, left.detach(), right.detach()))
                if pend["next_basis"] is not None:
                    rot = sk.basis_rotation(st["basis"], pend["next_basis"])  # [r, r]
                    shard = self._shards.get(id(p))
                    if shard is not None:
                        sh.all_reduce_sum_(rot, shard.group)  # both bases are row chunks: sum the partial products
                    st["exp_avg"], st["exp_avg_sq"] = sk.rotate_moments(
                        st["exp_avg"], st["exp_avg_sq"], rot, pend["side"]
                    )
                    st["basis"] = pend["next_basis"]
        if self.record_updates:
            self._applied.append(records)
        self._pending.clear()
        self._prepared = False
        self._perturb_total = 0.0

    # ----------------------------------------------------------- weight sync
    def pop_applied_updates(self) -> list[list[LowRankUpdate]]:
        """Factored updates of the steps since the last pop (one list per step; needs ``record_updates``)."""
        out, self._applied = self._applied, []
        return out

    def dense_param_names(self) -> list[str]:
        """Names of params in dense (AdamW) groups: sync these as values."""
        return [n for g in self.param_groups if not self._is_lowrank(g) for n in g["param_names"]]

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """``Optimizer.state_dict()``, ready for ``torch.save`` and for distributed checkpointing (FSDP2).

        Two additions to ``torch.optim``'s format:

        1. Every param has an entry: one whose dense AdamW state does not exist yet (it has
           not stepped) appears with step 0 and zero moments, which :meth:`load_state_dict`
           drops again. DCP loads into the ``state_dict()`` of a fresh optimizer, so a param
           missing there would not be restored.
        2. Under FSDP2, a state tensor that is this rank's piece of a larger one is returned
           as a DTensor with its global shape (layouts in :meth:`_dtensor_layout`), so DCP
           saves every rank's piece rather than one rank's as if replicated, and reshards on
           load. Step counts and seeds are equal on every rank and stay plain tensors.

        Raises:
            RuntimeError: called between backward and ``step()`` under FSDP2 while a sharded
                matrix holds a partial sum over ranks (left sketch, range sketch), which is no
                rank's piece of anything. Checkpoint after ``step()`` (Lightning does).
        """
        sd = super().state_dict()
        state = sd["state"]  # keyed by position in param-group order; values are our live dicts: copy, don't edit
        for idx, p in enumerate(p for g in self.param_groups for p in g["params"]):
            group = self._group_of[id(p)]
            if idx not in state and not self._is_lowrank(group):
                w = _local(p)
                state[idx] = {
                    "step": torch.zeros((), dtype=torch.int64),
                    "exp_avg": torch.zeros_like(w, dtype=torch.float32),
                    "exp_avg_sq": torch.zeros_like(w, dtype=torch.float32),
                }
            layout = self._dtensor_layout(p, group, state[idx]) if idx in state else {}
            if layout:
                from torch.distributed.tensor import DTensor

                state[idx] = {**state[idx], **{
                    k: DTensor.from_local(state[idx][k], p.device_mesh, placements, run_check=False,
                                          shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
                    for k, (placements, shape) in layout.items()
                }}  # fmt: skip
        return sd

    def _dtensor_layout(self, p: torch.Tensor, group: dict, st: dict) -> dict[str, tuple[tuple, tuple[int, ...]]]:
        """``{key: (placements, global shape)}`` of the state tensors of ``p`` that are this rank's piece.

        Empty unless ``p`` is a sharded DTensor. Dense AdamW moments share the param's layout.
        A row-sharded matrix (see the table in :mod:`~logra_lightning.optim.sharding`): right
        sketch, ``Q`` rows ``Shard(0)`` of ``[n, r]`` and moments and sketch ``Shard(0)`` of
        ``[m, r]``; left sketch, ``P`` rows ``Shard(0)`` of ``[m, r]`` and moments ``Shard(1)``
        of ``[r, n]``; its sketch is a partial sum over ranks, zero after ``step()``, left plain.
        """
        placements = getattr(p, "placements", None)
        if placements is None or all(pl.is_replicate() for pl in placements):
            return {}
        if id(p) not in self._shards:
            return {k: (tuple(placements), tuple(p.shape)) for k in ("exp_avg", "exp_avg_sq") if k in st}
        from torch.distributed.tensor import Replicate, Shard

        mesh_dim = next(i for i, pl in enumerate(placements) if not pl.is_replicate())

        def shard(dim: int) -> tuple:
            return tuple(Shard(dim) if i == mesh_dim else Replicate() for i in range(len(placements)))

        (m, n), r, side = _mshape(p), group["rank"], _side(group, p)
        partial = "range" in st or (side == "left" and id(p) in self._sketches)
        if partial:
            raise RuntimeError(
                "LoGRA.state_dict() was called between backward and step() on an FSDP2-sharded run: the "
                "accumulated sketches of sharded matrices are partial sums over ranks and cannot be saved as "
                "shards. Save after optimizer.step() (Lightning's checkpoints are taken there)."
            )
        if side == "right":
            return {"basis": (shard(0), (n, r)), **{k: (shard(0), (m, r)) for k in ("exp_avg", "exp_avg_sq")}}
        return {"basis": (shard(0), (m, r)), **{k: (shard(1), (r, n)) for k in ("exp_avg", "exp_avg_sq")}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``Optimizer.load_state_dict`` for what :meth:`state_dict` wrote, saved whole or through DCP.

        Keeps fp32 moments/bases and int64 counters as saved; takes the local piece of DTensor
        values; matches state to params in param-group order, whether keyed by position
        (``torch.save``) or by parameter name (DCP's ``set_optimizer_state_dict``).

        Raises:
            ValueError: a saved low-rank state tensor has another shape than here (e.g. another
                ``rank``, or a whole-matrix checkpoint loaded into a sharded run without DCP).
        """
        keys = [k for g in state_dict["param_groups"] for k in g["params"]]
        previous = self.state
        super().load_state_dict({**state_dict, "state": {}})  # checks group sizes, restores hyperparameters
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        names = {id(p): n for g in self.param_groups for n, p in zip(g["param_names"], g["params"])}
        by_key = dict(zip(keys, (p for g in self.param_groups for p in g["params"])))
        for key, values in state_dict["state"].items():
            p = by_key[key]
            st = {k: _local(v).detach().clone().to(p.device) if torch.is_tensor(v) else v for k, v in values.items()
                  if k != "sketch"}  # checkpoints from before sketches left the state held zeros there
            if not self._is_lowrank(self._group_of[id(p)]):
                if int(st.get("step", 1)) == 0:
                    continue  # the placeholder of a dense param that had not stepped: it still has no state
            else:
                for k, ours in previous.get(p, {}).items():
                    if k in ("basis", "exp_avg", "exp_avg_sq") and st[k].shape != ours.shape:
                        raise ValueError(
                            f"LoGRA.load_state_dict: {names[id(p)]!r} has {k} of shape {tuple(st[k].shape)} in the "
                            f"checkpoint but {tuple(ours.shape)} here (same rank, side and sharding needed)"
                        )
            self.state[p] = st
        self._pending.clear()
        self._prepared = False
        self._perturb_total = 0.0
        self._touched.clear()
