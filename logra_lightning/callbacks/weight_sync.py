"""Keep the rollout engine's copy of the policy in step with the trainer by sending low-rank factors.

After each training batch in which the optimizer stepped, :class:`LowRankWeightSync` pops
the factored updates that :class:`~logra_lightning.optim.LoGRA` actually applied (after any
step scaling, e.g. by :class:`~logra_lightning.callbacks.kl_control.KLStepControl`) and sends
them to ``pl_module.engine`` as ``W <- c*W + L@R``, together with the current values of the
params LoGRA updates densely (norms, biases). That is ``r*(m+n)`` numbers per matrix
instead of ``m*n`` (docs/design.md §5). A full weight sync runs at the start of every fit (so
also on resume) and every ``full_sync_every`` optimizer steps, which bounds rounding drift.
Tests: ``tests/test_weight_sync.py`` (HF engine) and ``tests/test_vllm_engine.py`` (vLLM).

Choices:

1. Names sent to the engine are the policy's own parameter names (HF names): the
   callback maps each optimizer param to its name in ``pl_module.policy`` (or in the
   module itself when it has no ``policy``), whatever names the optimizer was given.
2. ``sync/bytes`` counts tensor payload (factors + dense values, or all params on a
   full sync); the engine's framing (a few hundred header bytes) is not included.
3. With more than one training process (FSDP2), each process holds only its rows of the
   left factors: :func:`~logra_lightning.sync.gather.gather_update_factors` all-gathers those
   rows (``r * m`` numbers per matrix, never the weight), so every rank holds the full
   factors and sends them to its engine.
4. **The engine keeps the basis.** Between basis refreshes one factor of each update is the
   matrix's basis (``Q.T`` for a right sketch, ``P`` for a left one), the same every step. An
   engine that caches bases (``caches_bases = True``: both engines here) gets it once per
   refresh; the other steps carry only the coefficient (``r * min(m, n)`` numbers). Each
   basis has a version id (from LoGRA); the callback remembers which version the engine
   holds per matrix, forgets it all on a full sync, a new engine or a failed sync, and the
   engine refuses a coefficient whose basis version it does not hold, naming the param.
5. **bf16 wire** (``wire_dtype="bfloat16"``): factors travel as bf16 (half the bytes; dense
   values stay in their dtype) and the engine applies them in fp32 into its weights. With
   ``match_rounding=True`` (the default) the trainer then applies exactly the update the
   engine receives: it adds ``bf16(L) @ bf16(R) - L @ R`` to its own weights (one extra
   rank-``2r`` matmul per matrix), so rounding does not make the two drift apart. Measured
   at ~100M (``benchmarks/sync_cost.py``): with the correction the drift stays at the fp32
   level (<= 3.8e-6 after 6 syncs) but the matmuls cost trainer time (14.7 s per step on the
   loaded 2-core CPU); without it the drift grew to 4.6e-4 after 6 syncs at lr 1e-3, bounded
   by a full sync every ``full_sync_every`` steps.
6. **An engine that loses its weights** (a ``vllm serve`` process restarted mid-run,
   :class:`~logra_lightning.rollout.vllm.server.VLLMServerEngine`) recovers inside the call by sending
   the trainer's current weights, which already hold the step being synced, so no step is lost
   or applied twice. It then has a new ``sync_epoch``: the callback forgets which bases it held.
7. **Drift check** (``check_drift_every``): after every N-th sync the engine sends back ``drift_entries``
   entries, drawn at random, of each weight's fp32 copy (for vLLM the shadow its weights are loaded
   from), and the callback logs the largest ``|engine - trainer|`` among them. It reads the weights
   themselves, so a bf16 engine's rounding (which ``sync/logprob_abs_diff_*`` mixes with drift) does
   not hide a sync that went wrong. Under FSDP2 each check gathers the full weights on every rank.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from logra_lightning._util import WarnOnce, full, local
from logra_lightning.errors import TrainingError
from logra_lightning.rl.phases import announce_phase
from logra_lightning.rollout.base import ReportsWeightDrift
from logra_lightning.sync.gather import gather_update_factors
from logra_lightning.sync.wire import LowRankUpdate, match_wire_rounding_, tensor_nbytes, wire_updates

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_WIRE_DTYPES = tuple(_DTYPES)


def _identity(engine) -> tuple[int, int]:
    """Which engine, and which of its lives: ``sync_epoch`` changes when an engine lost what it was sent."""
    return id(engine), int(getattr(engine, "sync_epoch", 0))


@torch.no_grad()
def _apply_wire_rounding(optimizer, updates: list[LowRankUpdate], dtype: torch.dtype) -> None:
    """Make each weight hold what the engine gets: ``W += round(L) @ round(R) - L @ R`` (choice 5).

    ``updates`` are as LoGRA recorded them (under FSDP2 ``left`` holds this rank's rows, which are
    also the rows of the weight here).
    """
    optimizer = getattr(optimizer, "optimizer", optimizer)
    params = {n: p for g in optimizer.param_groups for n, p in zip(g.get("param_names", ()), g["params"])}
    for u in updates:
        p = params[u.name]
        w = local(p)
        w = w.view(-1, w.shape[-1])  # [m_i, n]; a 3-D expert weight as its [E*m, n] matrix
        if w.numel() == 0:
            continue
        if w.shape[0] != u.left.shape[0]:
            raise ValueError(f"{u.name}: left factor has {u.left.shape[0]} rows, the weight here {w.shape[0]}")
        match_wire_rounding_(w, u.left, u.right, dtype)


class LowRankWeightSync(L.Callback):
    """Send each optimizer step to the rollout engine as low-rank factors; full sync at start and every N steps.

    The engine is ``pl_module.engine`` (a :class:`~logra_lightning.rollout.RolloutEngine`
    such as :class:`~logra_lightning.rollout.vllm.VLLMEngine` or
    ``HFEngine(copy_weights=True)``). An engine with ``shares_weights=True`` samples from
    the trainer's own weights: there is nothing to sync and the callback does nothing
    (warned once). An optimizer without factored updates (e.g. ``torch.optim.AdamW``) gets
    a full sync after every step (warned once).

    Args:
        full_sync_every: also do a full sync every this many optimizer steps; ``0`` or
            ``None``: only at the start of each fit (and so on resume).
        engine_attr: attribute of the LightningModule holding the engine.
        policy_attr: attribute holding the HF model whose parameter names the engine
            knows; if the module has no such attribute, the module itself is used.
        wire_dtype: ``"float32"`` or ``"bfloat16"``: dtype of the factors on the wire
            (choice 5).
        match_rounding: with a bf16 wire, apply the rounded update to the trainer's weights
            too, so the engine and the trainer hold the same weights (choice 5).
        cache_bases: let the engine keep each basis between refreshes and send only the
            coefficient (choice 4); ``False`` sends both factors every step.
        check_drift_every: after every this many syncs (full ones included), compare the engine's copy of
            the weights with the trainer's (choice 7); ``0``: never. Needs an engine with ``weight_drift``
            (``VLLMEngine``, ``VLLMServerEngine``).
        drift_entries: entries sampled per weight by each drift check.

    Raises:
        ValueError: ``full_sync_every``, ``check_drift_every`` or ``drift_entries`` out of range; an unknown
            ``wire_dtype``.
        RuntimeError: the module has no engine at fit start, or ``check_drift_every`` is set and the engine
            cannot report its weights.
        TrainingError: (a ``RuntimeError``) sending to the engine
            failed (the message names the global step; training stops before any
            checkpoint of that step is written).

    Example::

        >>> import lightning as L
        >>> from logra_lightning.callbacks.weight_sync import LowRankWeightSync
        >>> sync = LowRankWeightSync(full_sync_every=50)
        >>> trainer = L.Trainer(max_steps=100, callbacks=[sync], logger=False, enable_checkpointing=False)
        >>> # trainer.fit(PolicyGradientModule(..., optimizer=LoGRA..., engine=VLLMEngineSpec()))

    Logged metrics:
        ``sync/bytes``: bytes sent to the engine by this batch's sync.
        ``sync/basis_bytes``: the part of ``sync/bytes`` that is bases (refresh steps, first sync after a
        full one); 0 when only coefficients went.
        ``sync/dense_bytes``: bytes a full sync sends (all policy params), for comparison.
        ``sync/seconds``: wall time of the sync, including the engine applying it.
        ``sync/full_syncs``: full syncs so far (cumulative, survives resume).
        ``sync/engine_recoveries``: times the engine recovered from losing its weights (choice 6;
        engines that can, e.g. ``VLLMServerEngine``).
        ``sync/logprob_abs_diff_mean``, ``sync/logprob_abs_diff_max``: ``|engine - trainer|``
        logprob of the latest rollout's sampled tokens, when the module sets
        ``engine_logprob_gap`` (the drift the syncs are meant to keep near zero, plus any precision gap
        between the engine and the trainer).
        ``sync/weight_drift_max``, ``sync/drift_check_seconds``: with ``check_drift_every``, the largest
        ``|engine - trainer|`` weight entry among those sampled, and the time the check took (not in
        ``sync/seconds``), on the syncs checked.

        The full sync at fit start is logged at that step through ``trainer.loggers``.
    """

    def __init__(
        self,
        full_sync_every: int | None = 0,
        engine_attr: str = "engine",
        policy_attr: str = "policy",
        wire_dtype: str = "float32",
        match_rounding: bool = True,
        cache_bases: bool = True,
        check_drift_every: int = 0,
        drift_entries: int = 256,
    ) -> None:
        if full_sync_every is not None and not (isinstance(full_sync_every, int) and full_sync_every >= 0):
            raise ValueError(f"Invalid full_sync_every: {full_sync_every!r} (must be an int >= 0, or None)")
        for key, value, low in (("check_drift_every", check_drift_every, 0), ("drift_entries", drift_entries, 1)):
            if isinstance(value, bool) or not (isinstance(value, int) and value >= low):
                raise ValueError(f"Invalid {key}: {value!r} (must be an int >= {low})")
        if wire_dtype not in _WIRE_DTYPES:
            raise ValueError(f"Invalid wire_dtype: {wire_dtype!r} (allowed: {', '.join(map(repr, _WIRE_DTYPES))})")
        self.full_sync_every = full_sync_every or 0
        self.engine_attr = engine_attr
        self.policy_attr = policy_attr
        self.wire_dtype = wire_dtype
        self.match_rounding = bool(match_rounding)
        self.cache_bases = bool(cache_bases)
        self.check_drift_every = check_drift_every
        self.drift_entries = drift_entries
        # counters (checkpointed)
        self.full_syncs = 0
        self.lowrank_syncs = 0
        self.steps_since_full = 0
        self.total_bytes = 0
        # per-fit state
        self._active = False
        self._lowrank = False
        self._factored: list = []
        self._names: dict[int, str] = {}
        self._dense_bytes = 0
        self._last_step = 0
        self._warn_once = WarnOnce(rank_zero_warn)
        self._held: dict[str, str] = {}  # HF name -> basis version the engine holds (choice 4)
        self._held_by: tuple[int, int] | None = None  # the engine that holds them (_identity)

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(full_sync_every=self.full_sync_every, engine_attr=self.engine_attr)

    def _policy(self, pl_module: L.LightningModule) -> torch.nn.Module:
        policy = getattr(pl_module, self.policy_attr, None)
        return pl_module if policy is None else policy

    # ------------------------------------------------------------------ start
    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = getattr(pl_module, self.engine_attr, None)
        if engine is None:
            raise RuntimeError(
                f"LowRankWeightSync found no rollout engine at `pl_module.{self.engine_attr}`: build one in the "
                f"module's setup(), or pass engine_attr= naming the attribute that holds it"
            )
        self._active = not getattr(engine, "shares_weights", False)
        if not self._active:
            self._warn_once(
                "shared",
                f"LowRankWeightSync: {type(engine).__name__} samples from the trainer's own weights "
                "(shares_weights=True); there is nothing to sync, so the callback does nothing.",
            )
            return
        if self.check_drift_every and not isinstance(engine, ReportsWeightDrift):
            raise RuntimeError(
                f"LowRankWeightSync(check_drift_every={self.check_drift_every}): {type(engine).__name__} cannot "
                "report its copy of the weights (no weight_drift method); set check_drift_every: 0, or use "
                "VLLMEngine or VLLMServerEngine"
            )
        policy = self._policy(pl_module)
        self._names = {id(p): n for n, p in policy.named_parameters()}
        self._dense_bytes = sum(tensor_nbytes(p) for p in policy.parameters())  # DTensor numel is the global one
        optimizers = list(trainer.optimizers)
        self._factored = [o for o in optimizers if hasattr(o, "pop_applied_updates")]
        self._lowrank = bool(optimizers) and len(self._factored) == len(optimizers)
        if not self._lowrank:
            names = sorted({type(o).__name__ for o in optimizers if o not in self._factored})
            self._warn_once(
                "fallback",
                f"LowRankWeightSync: optimizer(s) {names} produce no factored updates; falling back to a "
                "full weight sync after every step. Use logra_lightning.optim.LoGRA for low-rank syncs.",
            )
        for opt in self._factored:
            opt.record_updates = True
            opt.pop_applied_updates()  # anything recorded before this fit is already in the full sync below
        self._last_step = trainer.global_step
        metrics = self._sync(trainer, pl_module, engine, full=True, updates=[])
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------ every batch
    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        metrics: dict[str, float] = {}
        popped = [opt.pop_applied_updates() for opt in self._factored]
        steps = max((len(p) for p in popped), default=0) if self._lowrank else trainer.global_step - self._last_step
        self._last_step = trainer.global_step
        if steps > 0:
            self.steps_since_full += steps
            full = not self._lowrank or (self.full_sync_every and self.steps_since_full >= self.full_sync_every)
            if not full and self.wire_dtype != "float32" and self.match_rounding:
                for opt, per_opt in zip(self._factored, popped):
                    _apply_wire_rounding(opt, [u for per_step in per_opt for u in per_step], _DTYPES[self.wire_dtype])
            # a collective under FSDP2: every rank gathers the row shards of its left factors
            popped = [
                [gather_update_factors(opt, step) for step in per_opt] for opt, per_opt in zip(self._factored, popped)
            ]
            updates = [u for per_opt in popped for per_step in per_opt for u in per_step]
            engine = getattr(pl_module, self.engine_attr)
            metrics.update(self._sync(trainer, pl_module, engine, full=bool(full), updates=updates))
        gap = getattr(pl_module, "engine_logprob_gap", None)
        if gap is not None:
            metrics["sync/logprob_abs_diff_mean"] = float(gap[0])
            metrics["sync/logprob_abs_diff_max"] = float(gap[1])
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    # -------------------------------------------------------------- the sync
    def _sync(self, trainer: L.Trainer, pl_module: L.LightningModule, engine, *, full: bool, updates: list) -> dict:
        start = time.perf_counter()
        kind = "full" if full else "low-rank"
        basis_bytes = 0
        with announce_phase(pl_module, "weight_sync"):
            try:
                if full:
                    self._held = {}  # the engine's bases are resent after a full sync
                    sent = self._send_full(engine, pl_module)
                    self._held_by = _identity(engine)
                else:
                    sent, basis_bytes = self._send_lowrank(engine, updates)
            except Exception as e:
                self._held = {}  # whatever the engine kept of this sync, resend it all
                raise TrainingError(
                    f"LowRankWeightSync: {kind} weight sync to the rollout engine failed at global step "
                    f"{trainer.global_step}: {type(e).__name__}: {e}. Training stopped before checkpointing this "
                    f"step; the last checkpoint is intact, and resuming from it starts with a full sync."
                ) from e
        if full:
            self.full_syncs += 1
            self.steps_since_full = 0
        else:
            self.lowrank_syncs += 1
        self.total_bytes += sent
        metrics = {
            "sync/bytes": float(sent),
            "sync/basis_bytes": float(basis_bytes),
            "sync/dense_bytes": float(self._dense_bytes),
            "sync/seconds": time.perf_counter() - start,
            "sync/full_syncs": float(self.full_syncs),
        }
        if hasattr(engine, "recoveries"):
            metrics["sync/engine_recoveries"] = float(engine.recoveries)
        if self.check_drift_every and (self.full_syncs + self.lowrank_syncs) % self.check_drift_every == 0:
            metrics.update(self._check_drift(engine, pl_module))
        return metrics

    def _check_drift(self, engine, pl_module: L.LightningModule) -> dict[str, float]:
        """Choice 7; each check draws other entries (the seed is the sync's number)."""
        start = time.perf_counter()
        named = [(n, full(p)) for n, p in self._policy(pl_module).named_parameters()]
        drift = engine.weight_drift(named, self.drift_entries, seed=self.full_syncs + self.lowrank_syncs)
        return {"sync/weight_drift_max": drift["max_abs"], "sync/drift_check_seconds": time.perf_counter() - start}

    def _send_full(self, engine, pl_module: L.LightningModule) -> int:
        policy = self._policy(pl_module)
        named = [(n, full(p)) for n, p in policy.named_parameters()]
        engine.load_weights(named)
        return sum(tensor_nbytes(t) for _, t in named)

    def _send_lowrank(self, engine, updates: list[LowRankUpdate]) -> tuple[int, int]:
        """Send the updates (a basis only where the engine lacks its version); ``(bytes, basis bytes)``."""
        by_name: dict[str, str] = {}
        dense: list[tuple[str, torch.Tensor]] = []
        for opt in self._factored:
            params = {n: p for g in opt.param_groups for n, p in zip(g.get("param_names", ()), g["params"])}
            by_name.update({n: self._names.get(id(p), n) for n, p in params.items()})
            dense += [(self._names.get(id(params[n]), n), full(params[n])) for n in opt.dense_param_names()]
        if self._held_by != _identity(engine):  # another engine, or one that lost our weights: it holds no basis
            self._held, self._held_by = {}, _identity(engine)
        keep = self.cache_bases and getattr(engine, "caches_bases", False)
        renamed = [dataclasses.replace(u, name=by_name.get(u.name, u.name)) for u in updates]
        wire, held = wire_updates(renamed, self._held, _DTYPES[self.wire_dtype], keep_bases=keep)
        engine.apply_lowrank_updates(wire, dense)
        # An engine that recovered from a restart inside the call sent the full weights instead (choice 6):
        # it holds no basis now.
        self._held = held if self._held_by == _identity(engine) else {}
        sent = sum(u.nbytes for u in wire) + sum(tensor_nbytes(t) for _, t in dense)
        return sent, sum(u.basis_nbytes for u in wire)

    # ------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "full_syncs": self.full_syncs,
            "lowrank_syncs": self.lowrank_syncs,
            "steps_since_full": self.steps_since_full,
            "total_bytes": self.total_bytes,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.full_syncs = int(state_dict.get("full_syncs", 0))
        self.lowrank_syncs = int(state_dict.get("lowrank_syncs", 0))
        self.steps_since_full = int(state_dict.get("steps_since_full", 0))
        self.total_bytes = int(state_dict.get("total_bytes", 0))
