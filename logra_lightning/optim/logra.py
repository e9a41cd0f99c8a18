"""LoGRA: Adam on low-rank gradient sketches, with dense AdamW for the rest (docs/design.md §2).

The math lives in :mod:`logra_lightning.optim.sketch`; this class holds state and orchestrates
the two-phase step (``prepare_update`` / ``perturb_`` / ``set_step_scale`` / ``step``) used by
predicted-KL step control and basis refreshes. Its bases hold the other jobs: backward hooks that
sketch and free gradients (:class:`~logra_lightning.optim.gradients.SketchedGradients`), factored
update records for low-rank weight sync (:class:`~logra_lightning.optim.candidate.AppliedUpdates`),
checkpoints (:class:`~logra_lightning.optim.state_io.Checkpointing`); one step's sketches and
candidate are a :class:`~logra_lightning.optim.step_state.StepState`, the replicas' average a
:class:`~logra_lightning.optim.data_parallel.Replicas`. Tested against :class:`LoGRAReference` in
``tests/test_optim_logra.py``; memory in ``benchmarks/optimizer_memory.py``.

Choices and departures:

1. **First basis.** A seeded random orthonormal basis (the identity when ``rank`` equals the
   sketched dimension). Step 0 is a refresh step, so step 1 uses the random basis (still a descent
   direction, ``<G, G Q Q^T> >= 0``) and step 2 onward a fitted one. No step holds a full gradient.
2. **Refresh.** ``refresh="randomized"``: on steps ``k % update_proj_gap == 0`` the hook also adds
   ``Y += G.T @ Omega`` (``Omega`` Gaussian ``[m, rank + oversample]`` from ``(seed, param, k)``); the
   new basis (top-``rank`` left singular vectors of ``Y``) takes effect after this step's update.
   ``refresh="svd"`` (exact SVD of ``G``, GaLore's projector) needs ``sketch_in_backward=False``.
3. **Moments across a refresh.** ``M <- M @ R``, ``V <- V @ (R*R)`` with ``R = Q_old.T @ Q_new``
   (:func:`~logra_lightning.optim.sketch.rotate_moments`, ``rotate_factored``); step counts run on.
4. **Non-finite values.** A NaN/inf range sketch keeps the old basis (``skipped_refreshes``); a
   NaN/inf gradient sketch skips that matrix's step (``skipped_updates``); both warn once.
5. **Gradients are gone after backward** for low-rank params (``p.grad is None``; clipping covers
   their sketches, choice 13; ``sketch_in_backward=False`` keeps them). The sketch lives like a gradient (first hook
   of a step to ``prepare_update``, dropped by ``zero_grad``) and is not checkpointed.
6. **FSDP2 (row-sharded DTensors).** Sides and random matrices come from the *global* shape, so a
   sharded run takes the same steps as one process (``tests/test_fsdp2.py``); every state tensor is
   sharded (layout in :mod:`~logra_lightning.optim.sharding`) and ``state_dict()`` returns DTensors for
   distributed checkpointing (:mod:`~logra_lightning.optim.state_io`). Recorded factors hold this
   rank's rows (:meth:`LoGRA.gather_updates` completes them).
7. **3-D expert weights** ``[E, m, n]`` are one ``[E*m, n]`` matrix with a right sketch: one shared
   input-space basis, per-expert moments (why: :mod:`~logra_lightning.optim.matrix`).
8. **Factored second moment where the sketch is tall** (``second_moment="auto"``): a right sketch of
   an ``[m, n]`` matrix with ``m > n`` (tied embedding, experts) keeps ``V`` as Adafactor's row and
   column means, ``[m] + [r]`` instead of ``[m, r]`` (docs/design.md §2). ``"full"`` / ``"factored"``:
   Adam's ``V`` everywhere / factored everywhere.
9. **bf16 storage of bases and first moments** (``basis_dtype``, ``exp_avg_dtype``), fp32 arithmetic;
   the second moment stays fp32 (a ``beta2 = 0.999`` EMA stalls in bf16). Effect on the update:
   ``benchmarks/results/direction_error.json`` (rendered in benchmarks/README.md).
10. **Host memory back to the OS** (``release_host_memory=True``): on CPU the sketch hooks, once every
    64 MiB of freed gradients, and the end of ``step()`` call glibc's ``malloc_trim``
    (:mod:`~logra_lightning.optim.host_memory`).
11. **Low-precision weights** (``bf16-true``): the fp32 update is added with one rounding by
    ``bf16_update`` (:mod:`~logra_lightning.optim.rounding`; ``"stochastic"`` by default: round to
    nearest drops most updates at RL learning rates, docs/results.md). Under ``bf16-mixed`` the hook
    and the step run with autocast off. fp16 with a loss scaler (``16-mixed``) is refused at the
    first step: the scaler unscales and inf-checks ``.grad`` only, not the sketches.
12. **Data parallelism (DDP).** A low-rank matrix kept out of DDP (``strategy="logra_ddp"``) has its
    sketches (and range sketches) averaged by one all-reduce in the step instead of its gradient in
    backward; under plain DDP its full gradient is kept for DDP to average and sketched in the step
    (:mod:`~logra_lightning.optim.data_parallel`). Replicas stay bit-identical either way.
13. **Clipping** covers what LoGRA holds: the sketches of low-rank matrices and the gradients of the
    rest (:meth:`LoGRA.clip_grad_norm_`; while a LoGRA lives, ``torch.nn.utils.clip_grad_norm_`` and
    Lightning's ``gradient_clip_val`` are routed to it, :mod:`~logra_lightning.optim.clipping`). A sketch's norm
    is the norm of the gradient's projection onto the basis, at most the full gradient's norm.

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

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from logra_lightning._util import WarnOnce, local, weak_method
from logra_lightning.optim import candidate as cand
from logra_lightning.optim import clipping, host_memory, rounding, state_io
from logra_lightning.optim import data_parallel as dp
from logra_lightning.optim import sharding as sh
from logra_lightning.optim import sketch as sk
from logra_lightning.optim.candidate import PendingUpdate
from logra_lightning.optim.gradients import SketchedGradients
from logra_lightning.optim.groups import (
    normalize_params,
    split_by_rank,
    storage_dtype,
    validate_group,
    validate_hparams,
)
from logra_lightning.optim.matrix import LowRankMatrix, resolve_side
from logra_lightning.optim.step_state import StepState
from logra_lightning.sync.wire import BasisVersions, LowRankUpdate

__all__ = ["LoGRA", "resolve_side"]


class LoGRA(cand.AppliedUpdates, state_io.Checkpointing, SketchedGradients, torch.optim.Optimizer):
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
        second_moment: ``"auto"`` (default: factored for right sketches of matrices with ``m > n``),
            ``"factored"`` or ``"full"`` (choice 8).
        basis_dtype, exp_avg_dtype: storage of the bases and low-rank first moments, ``"bfloat16"``
            (default) or ``"float32"`` (choice 9). Second moments and dense AdamW state are fp32.
        sketch_in_backward: sketch and free each gradient in a post-accumulate-grad
            hook (default). ``False``: keep full grads and project in ``step`` (GaLore-style).
        include, exclude: regexes for the automatic split (only with ``rank``).
        seed: base seed of the initial bases and range-sketch test matrices.
        release_host_memory: with params on the CPU, return freed heap pages to the OS from the
            sketch hooks (every 64 MiB of freed gradients) and at the end of ``step()`` (choice 10).
        bf16_update: how the fp32 update is added to bf16/fp16 weights (choice 11):
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
        second_moment: str = "auto",
        basis_dtype: str | torch.dtype = "bfloat16",
        exp_avg_dtype: str | torch.dtype = "bfloat16",
        sketch_in_backward: bool = True,
        include=None,
        exclude=None,
        seed: int = 0,
        release_host_memory: bool = True,
        bf16_update: str = "stochastic",
    ) -> None:
        if bf16_update not in rounding.MODES:
            raise ValueError(f"Invalid bf16_update: {bf16_update!r} (allowed: {', '.join(rounding.MODES)})")
        validate_hparams(lr, betas, eps, weight_decay, update_proj_gap, scale, side, refresh, oversample, rank)
        groups = normalize_params(params)
        if rank is not None and not any("rank" in g for g in groups):
            groups = split_by_rank(groups, rank, include=include, exclude=exclude)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            update_proj_gap=update_proj_gap,
            scale=scale,
            side=side,
            refresh=refresh,
            oversample=oversample,
            second_moment=second_moment,
            basis_dtype=basis_dtype,
            exp_avg_dtype=exp_avg_dtype,
        )
        self.sketch_in_backward = bool(sketch_in_backward)
        self.release_host_memory = bool(release_host_memory)
        self.trimmer = host_memory.Trimmer()  # choice 10
        self.seed = int(seed)
        self.bf16_update = bf16_update
        # bf16/fp16 weight entries whose nonzero update rounded to no change, of all such entries updated
        self.lost_updates = self.low_precision_updates = 0
        self.skipped_refreshes = self.skipped_updates = 0  # choice 4
        self.record_updates = False
        self._applied: list[list[LowRankUpdate]] = []  # AppliedUpdates' records, popped by weight sync
        self._basis_versions = BasisVersions()  # recorded with each update: the engine may keep the basis
        # like p.grad, not state: the sketches, their completion and the candidate update (step_state.py)
        self.step_state = StepState()
        self._warn_once = WarnOnce()
        self._hooks: list = []
        self._param_index: dict[int, int] = {}
        self._group_of: dict[int, dict] = {}
        self._matrices: dict[int, LowRankMatrix] = {}  # id(p) -> how a low-rank param is sketched
        self._replicas = dp.Replicas()  # who averages each low-rank gradient across replicas (choice 12)
        super().__init__(groups, defaults)
        for group in self.param_groups:
            self._init_group(group)
        self.setup_data_parallel()
        clipping.register(self)  # choice 13
        if not any(g.get("rank") is not None for g in self.param_groups):
            self._warn_once(
                "dense",
                "LoGRA has no low-rank param group: every param gets dense AdamW. Pass `rank=` "
                "or use `logra_param_groups(model, rank=...)`.",
            )

    # ----------------------------------------------------------------- setup
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def named_params(self) -> list[tuple[str, torch.Tensor]]:
        """Every ``(name, param)`` in param-group order."""
        return [(n, p) for g in self.param_groups for n, p in zip(g["param_names"], g["params"])]

    def param_group(self, p: torch.Tensor) -> dict:
        """The param group holding ``p``."""
        return self._group_of[id(p)]

    def lowrank_matrix(self, p: torch.Tensor) -> LowRankMatrix | None:
        """How low-rank param ``p`` is sketched (side, shape, FSDP2 rows), or ``None`` for a dense param."""
        return self._matrices.get(id(p))

    def data_parallel_mode(self, p: torch.Tensor) -> str | None:
        """Who averages low-rank param ``p``'s gradient across replicas (choice 12), ``None`` for a dense param."""
        return self._replicas.modes.get(id(p))

    @property
    def data_parallel_bytes(self) -> int:
        """Bytes LoGRA all-reduced for replicas so far (mode ``"sketch"``)."""
        return self._replicas.bytes

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_hooks") and self.param_groups[-1] is not None and self._group_of:
            self._init_group(self.param_groups[-1])
            self.setup_data_parallel()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`Checkpointing.load_state_dict <logra_lightning.optim.state_io.Checkpointing.load_state_dict>`."""
        try:
            super().load_state_dict(state_dict)
        finally:  # loading replaced the group dicts (also when a state tensor was then refused)
            self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}

    def lowrank_params(self) -> list[torch.Tensor]:
        """The params LoGRA sketches (the rest get dense AdamW)."""
        return [p for p in self._params() if id(p) in self._matrices]

    def setup_data_parallel(self) -> dict[str, int]:
        """Decide, per low-rank param, who averages its gradient across replicas (choice 12); count the modes.

        Called when the optimizer is built, and again by
        :class:`~logra_lightning.optim.ddp_strategy.LoGRADDPStrategy` after it kept LoGRA's params out
        of DDP. A param that enters mode ``"sketch"`` is broadcast from rank 0, as DDP would have done
        at wrap time: a collective, so every rank calls this at the same point.
        """
        return self._replicas.setup(self)

    def _init_group(self, group: dict) -> None:
        validate_group(group, sketch_in_backward=self.sketch_in_backward)
        lowrank = group.get("rank") is not None
        for name, p in zip(group["param_names"], group["params"]):
            self._param_index.setdefault(id(p), len(self._param_index))
            self._group_of[id(p)] = group
            if not lowrank:
                continue
            mat = LowRankMatrix.build(p, name, group["rank"], group["side"], group["second_moment"])
            self._matrices[id(p)] = mat
            dtypes = [storage_dtype(group[key], key) for key in ("basis_dtype", "exp_avg_dtype")]  # choice 9
            self.state[p] = mat.init_state(sk.mix_seed(self.seed, self._param_index[id(p)]), p.device, *dtypes)
            if self.sketch_in_backward:
                # weakly: torch never collects a cycle through a tensor's hooks (param -> hook -> LoGRA -> param)
                self._hooks.append(p.register_post_accumulate_grad_hook(weak_method(self._sketch_hook)))

    def row_shard(self, p: torch.Tensor) -> sh.RowShard | None:
        """This rank's rows of low-rank param ``p`` under FSDP2, or ``None`` when ``p`` is whole here (or dense)."""
        mat = self._matrices.get(id(p))
        return mat.shard if mat is not None else None

    def complete_gradients(self) -> None:
        """Make this step's gradients what the step will use: averaged over replicas, FSDP2 sketches whole.

        Idempotent within a step; clipping calls it before measuring the norm.
        """
        self._replicas.average_(self)
        self._complete_sketches()

    # ------------------------------------------------------------ two phases
    @torch.no_grad()
    @rounding.outside_autocast
    def prepare_update(self) -> None:
        """Advance step counts and moments and hold the candidate update Δ. Idempotent until applied."""
        step = self.step_state
        if step.prepared:
            return
        self._replicas.average_(self)
        self._sketch_full_grads()
        nonfinite, col_sums = self._complete_sketches()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in self._matrices and id(p) in step.touched:
                    pend = self._prepare_lowrank(p, group, id(p) in nonfinite, col_sums.get(id(p)))
                elif id(p) not in self._matrices and p.grad is not None:
                    pend = cand.dense_candidate(self.state[p], local(p.grad), group)
                else:
                    continue
                if pend is not None:
                    step.pending[p] = pend
        step.prepared = True
        step.reset("completion")  # consumed: a step without optimizer.zero_grad() must not see it again

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """Clip this step's gradients by their global L2 norm, low-rank sketches included (choice 13).

        The norm covers what the optimizer holds after backward: the sketch of each low-rank matrix
        (the norm of its gradient projected onto the basis, ``||G Q|| <= ||G||``) and the gradient
        of every other param. Both are scaled by ``min(1, max_norm / (norm + 1e-6))``, as
        ``torch.nn.utils.clip_grad_norm_`` does. Under DDP and FSDP2 the norm is the global one,
        the same on every rank (a collective). Returns the norm before clipping.
        """
        return clipping.clip_grad_norm_(self._params(), max_norm, norm_type, error_if_nonfinite)

    def _next_basis(self, p: torch.Tensor, group: dict, st: dict) -> torch.Tensor | None:
        """The refreshed basis (this rank's rows of it when sharded), or ``None`` to keep the old one."""
        mat = self._matrices[id(p)]
        y = mat.refresh_input(st, p.grad, group["refresh"])
        if y is None:
            return None  # no gradient reached this matrix on its refresh step: keep the basis
        if not bool(torch.isfinite(y).all()):
            self.skipped_refreshes += 1
            self._warn_once("nan_refresh", "LoGRA: non-finite range sketch; keeping the old basis")
            return None
        basis = mat.own_rows(y if group["refresh"] == "svd" else sk.basis_from_range(y, group["rank"]))
        return basis.to(st["basis"].dtype)  # stored dtype (choice 9), rounded before the moments turn into it

    def _prepare_lowrank(self, p: torch.Tensor, group: dict, nonfinite: bool, col_sq_sum=None) -> PendingUpdate | None:
        st, mat = self.state[p], self._matrices[id(p)]
        if nonfinite:
            del self.step_state.sketches[id(p)]
            self.skipped_updates += 1
            self._warn_once("nan_update", "LoGRA: non-finite gradient sketch; skipping that matrix's step")
            st.pop("range", None)
            return None
        next_basis = self._next_basis(p, group, st) if mat.refresh_due(st, group["update_proj_gap"]) else None
        sketch = self.step_state.sketches.pop(id(p))  # consumed here: freed once this step's moments are updated
        cand.advance_lowrank_moments_(st, mat, sketch, group, col_sq_sum)
        del sketch
        return cand.lowrank_candidate(st, mat, group, next_basis)

    def _require_prepared(self, what: str) -> None:
        if not self.step_state.prepared:
            raise RuntimeError(f"{what} needs a candidate update: call opt.prepare_update() after backward first")

    def update_max_abs(self) -> float:
        """Max ``|element|`` of the scale-1 candidate update Δ (incl. weight decay) over all params."""
        self._require_prepared("update_max_abs()")
        deltas = (self.update_delta(p) for p in self.step_state.pending)  # one matrix at a time
        return max((sk.max_abs(d) for d in deltas if d.numel()), default=0.0)  # a rank may hold no rows

    @torch.no_grad()
    @rounding.outside_autocast
    def update_delta(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s scale-1 Δ (incl. weight decay), fp32, shaped like ``p``, a new tensor; ``None``: no update."""
        self._require_prepared("update_delta()")
        pend = self.step_state.pending.get(p)
        return None if pend is None else cand.update_delta(pend, local(p)).view_as(local(p))

    def _add_low_precision(self, p: torch.Tensor, w: torch.Tensor, delta: torch.Tensor) -> None:
        """``w += delta`` for bf16/fp16 weights by the ``bf16_update`` rule (choice 11); counts lost entries."""
        seed = sk.mix_seed(sk.mix_seed(self.seed, 0x5EED), int(self.state[p].get("step", 0)), self._param_index[id(p)])
        self.lost_updates += rounding.add_by_rule(self.bf16_update, w, delta, self.state[p], seed)
        self.low_precision_updates += delta.numel()

    @torch.no_grad()
    @rounding.outside_autocast
    def perturb_(self, alpha: float) -> None:
        """In place ``W += alpha * Δ`` for every param with a candidate; ``+a`` then ``-a`` restores W."""
        self._require_prepared("perturb_()")
        alpha, step = float(alpha), self.step_state
        for p, pend in step.pending.items():
            add = partial(self._add_low_precision, p)
            cand.move_(local(p), pend, step.perturb_total, step.perturb_total + alpha, add)
        step.perturb_total += alpha

    def set_step_scale(self, eta: float) -> None:
        """The next ``step()`` applies ``eta * Δ`` (then the scale resets to 1)."""
        eta = float(eta)
        if not (math.isfinite(eta) and eta >= 0):
            raise ValueError(f"Invalid step scale: {eta} (must be finite and >= 0)")
        self.step_state.step_scale = eta

    # GradScaler then hands this optimizer its scale instead of unscaling .grad itself (choice 11)
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Run ``closure`` (backward inside), prepare if needed, apply ``eta * Δ``, reset ``eta`` to 1."""
        if getattr(self, "found_inf", None) is not None:  # set by torch.amp.GradScaler.step
            raise ValueError(
                "LoGRA cannot step under fp16 loss scaling (torch.amp.GradScaler; Lightning precision='16-mixed'): "
                "the scaler unscales and checks .grad only, while LoGRA holds its matrices' gradients as sketches. "
                "Use precision='bf16-mixed' or 'bf16-true' (no loss scaling needed)"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with rounding.autocast_off():
            self.prepare_update()
            self._apply(self.step_state.step_scale)
        if self.release_host_memory and any(local(p).device.type == "cpu" for p in self._params()[:1]):
            self.trimmer.flush()  # choice 10: this step's sketches and candidates are freed now
        return loss

    def _apply(self, eta: float) -> None:
        records: list[LowRankUpdate] = []
        names = {id(p): n for n, p in self.named_params()}
        for p, pend in self.step_state.pending.items():
            cand.move_(local(p), pend, self.step_state.perturb_total, eta, partial(self._add_low_precision, p))
            if not pend.lowrank:
                continue
            if self.record_updates:
                records.append(self._record(p, pend, names[id(p)], eta))
            if pend.next_basis is not None:
                cand.take_next_basis_(self.state[p], self._matrices[id(p)], pend.next_basis)
        if self.record_updates:
            self._applied.append(records)
        self.step_state.reset("candidate")
