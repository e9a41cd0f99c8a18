"""Predicted-KL step control: scale each optimizer step so the policy moves by about ``target_kl``.

Before the optimizer applies its candidate update Δ, :class:`KLStepControl` predicts the
per-token ``KL(pi_old || pi_new)`` on a token subsample of the current batch from one
finite-difference forward pass along Δ (plus one at the current weights for the base
logits; no backward; docs/design.md §4, math in :mod:`logra_lightning.kl.estimates`), picks
``eta = clamp(sqrt(target / (K * calibration)), min_scale, max_scale)`` and lets the
optimizer apply ``eta * Δ``. Every ``measure_every`` steps it measures the realized KL on
the same tokens and updates the calibration. Run the example:
``.venv/bin/python examples/kl_control_in_your_project.py``; tests: ``tests/test_kl_control.py``.

What the callback needs from the LightningModule is :class:`SupportsKLProbe`::

    class SupportsKLProbe(Protocol):
        def kl_probe_logits(self, max_tokens: int) -> torch.Tensor: ...

``kl_probe_logits(max_tokens)`` returns ``[N, V]`` logits (``N <= max_tokens``) of the
*current step's* batch at a token subsample, computed with the current weights. The module
must pick the same positions every time it is called within one optimizer step (the
callback calls it two or three times per step and subtracts the results), and the logits
must be deterministic (no dropout: call the model in eval mode or with dropout 0).
The callback calls it under ``torch.no_grad()`` with autocast disabled.

Per optimizer step (hooked on ``on_before_optimizer_step``, which Lightning calls inside
``optimizer.step()`` after the closure, in automatic and manual optimization alike, and
on ``Optimizer.register_step_post_hook``, so a module may take several steps per batch),
the callback talks to one interface, :func:`~logra_lightning.optim.two_phase.two_phase`
(``prepare_update`` / ``update_max_abs`` / ``perturb_`` / ``set_step_scale``), with one
control sequence: base logits → ``prepare_update()`` → ``eps`` from ``update_max_abs()``
→ ``perturb_(eps)`` → probe logits → ``K`` → ``set_step_scale(eta)`` (``probe="jvp"``:
``prepare_update()`` → one pass along ``update_delta`` → ``K`` → ``set_step_scale(eta)``).
W is not moved back after the probe: the step takes it from ``W0 + eps * Δ`` to
``W0 + eta * Δ`` (both adapters track where ``perturb_`` left it), which saves one pass over
the weights.
Where the candidate Δ exists decides when it runs:

- **LoGRA** (natively two-phase) holds Δ before its ``step()``, so the sequence runs in
  ``on_before_optimizer_step`` and the optimizer's step applies ``eta * Δ``. Extra memory:
  none beyond the logits (W is perturbed in place; ``update_max_abs`` materializes one
  matrix's Δ at a time).
- **Any other optimizer** (e.g. ``torch.optim.AdamW``) gets snapshot-and-rescale calls:
  params are copied before its step and Δ is ``new - old`` after it, so the sequence runs
  in the step's post-hook and ends with ``W = old + eta * Δ``. Extra memory: **one copy of
  the params being trained**, held from just before the step to just after it.

Both paths cost two extra fp32 forward passes (base, probe) on ``sample_tokens`` tokens per
step, plus one (realized) on measured steps; logits are held as two ``[N, V]`` tensors
(``N=256``, ``V=152k`` in fp32: 0.3 GB), so lower ``sample_tokens`` for large vocabularies.
``probe="jvp"`` predicts from one forward-mode pass in the trainer's precision instead
(:mod:`~logra_lightning.kl.jvp`; the module's ``kl_probe_jvp``, the optimizer's ``update_delta``);
measured steps add the two fp32 passes of the realized KL.

Choices, in more detail than docs/design.md §4:

1. **Calibration rule** and 2. **data parallelism** (every rank takes the same ``eta`` and keeps
   the same calibration; checked with DDP, not yet run under FSDP2): docs/design.md §4.
3. **Gradient clipping** (``Trainer(gradient_clip_val=...)``) is done here, before a natively
   two-phase optimizer prepares Δ: Lightning clips only after ``on_before_optimizer_step``, when
   LoGRA's ``prepare_update`` has read the gradients; Lightning's own call then finds the step
   clipped and does nothing (:mod:`~logra_lightning.optim.clipping`). The snapshot adapter steps
   after Lightning's clipping and needs nothing.
4. **Metrics are logged once per batch** (``on_train_batch_end``, mean over the optimizer
   steps of the batch); every step is kept in :attr:`KLStepControl.history` (the last 10,000).
   ``kl/realized`` exists on measured batches only, so it goes straight to ``trainer.loggers``
   (as Lightning's ``LearningRateMonitor`` does; through ``self.log`` a key logged on some steps
   only is re-sent with its old value on the steps in between) at the step Lightning gives
   ``self.log`` metrics, the number of training batches before this one: the callback counts
   them (and checkpoints the count), so a skipped optimizer step does not shift the curve.
"""

from __future__ import annotations

import math
import time
from collections import deque
from functools import partial
from typing import Any, Protocol, runtime_checkable

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from logra_lightning._util import WarnOnce
from logra_lightning.kl.estimates import (
    DEFAULT_PROBE_WEIGHT_CHANGE,
    calibration_from_ema,
    choose_step_scale,
    exact_kl,
    informative_measurement,
    update_log_calibration,
)
from logra_lightning.kl.predict import finite_difference_K, forward_mode_K
from logra_lightning.optim.two_phase import is_two_phase, two_phase

__all__ = ["KLStepControl", "SupportsKLProbe", "is_two_phase"]

# Per-step records kept in `history` (each a small dict of floats).
_HISTORY = 10_000
PROBES = ("finite_difference", "jvp")


@runtime_checkable
class SupportsKLProbe(Protocol):
    """What :class:`KLStepControl` needs from a LightningModule (see the module docstring)."""

    def kl_probe_logits(self, max_tokens: int) -> torch.Tensor:
        """``[N, V]`` logits, ``N <= max_tokens``, of the current batch at fixed positions and current weights."""
        ...


class KLStepControl(L.Callback):
    """Scale every optimizer step so its predicted per-token policy KL stays at ``target_kl``.

    Args:
        target_kl: per-token ``KL(pi_old || pi_new)`` a step may cause (mean over the probed tokens).
        min_scale: smallest step scale; ``0.0`` lets the control veto a step (also taken
            when the prediction is NaN/inf).
        max_scale: largest step scale; ``1.0`` never enlarges the optimizer's update.
        sample_tokens: tokens passed as ``max_tokens`` to ``kl_probe_logits``.
        measure_every: measure the realized KL every this many optimizer steps (step 0
            included); ``0`` never measures (calibration stays 1, saves one forward pass).
        probe_weight_change: largest per-weight change of the finite-difference probe
            (see :func:`~logra_lightning.kl.estimates.finite_difference_epsilon`).
        calibration_rate: EMA rate of the calibration, in ``(0, 1]``.
        calibration_bounds: ``(low, high)`` clamp of the calibration, ``0 < low <= 1 <= high``.
        probe: ``"finite_difference"`` (two fp32 passes; any module and optimizer) or ``"jvp"`` (one
            forward-mode pass in the trainer's precision; needs ``kl_probe_jvp``; refused under FSDP2).

    Raises:
        ValueError: an argument out of range (the message names the value and the range).
        MisconfigurationException: in ``setup``, the LightningModule does not implement
            :class:`SupportsKLProbe`.

    Logged metrics:
        - ``kl/predicted``: calibrated prediction for the step actually taken,
          ``eta**2 * K * calibration`` (equals ``target_kl`` unless ``eta`` hit a bound).
        - ``kl/predicted_unscaled``: calibrated prediction had the full update been
          applied, ``K * calibration``. The raw quadratic is ``kl/predicted / kl/calibration``.
        - ``kl/realized``: exact KL on the probed tokens after the step (measured steps only).
        - ``kl/step_scale``: ``eta``.
        - ``kl/calibration``: calibration used for this step's prediction.
        - ``kl/control_seconds``: wall time the callback added to the batch's optimizer steps
          (probe, realized measurement and bookkeeping; summed over the batch's steps), so its
          overhead can be read next to ``perf/step_seconds``.

        Logged in ``on_train_batch_end`` as the mean over the batch's optimizer steps
        (``kl/realized`` written to the loggers directly, on measured batches only);
        :attr:`history` keeps one record per step, also with ``predicted_raw`` (``eta**2 * K``)
        and timings: ``probe_s`` (the prediction's two forward passes), ``measure_s`` (the
        realized one) and ``control_s`` (all the time the callback adds to the step, both
        included; a natively two-phase optimizer's ``prepare_update`` is not counted, its step
        would run it anyway).

    Example::

        >>> from logra_lightning.callbacks.kl_control import KLStepControl
        >>> control = KLStepControl(target_kl=1e-3, min_scale=0.0, sample_tokens=256, measure_every=10)
        >>> trainer = L.Trainer(max_steps=100, callbacks=[control])  # doctest: +SKIP
        >>> trainer.fit(module)  # module implements kl_probe_logits  # doctest: +SKIP
    """

    def __init__(
        self,
        target_kl: float,
        min_scale: float = 0.0,
        max_scale: float = 1.0,
        sample_tokens: int = 256,
        measure_every: int = 10,
        *,
        probe_weight_change: float = DEFAULT_PROBE_WEIGHT_CHANGE,
        calibration_rate: float = 0.3,
        calibration_bounds: tuple[float, float] = (0.25, 4.0),
        probe: str = "finite_difference",
    ) -> None:
        if not (math.isfinite(target_kl) and target_kl > 0):
            raise ValueError(f"Invalid target_kl: {target_kl} (must be a finite number > 0)")
        if not (math.isfinite(max_scale) and max_scale > 0):
            raise ValueError(f"Invalid max_scale: {max_scale} (must be a finite number > 0)")
        if not (0.0 <= min_scale <= max_scale):
            raise ValueError(f"Invalid min_scale: {min_scale} (must be in [0, max_scale={max_scale}])")
        if isinstance(sample_tokens, bool) or not (isinstance(sample_tokens, int) and sample_tokens >= 1):
            raise ValueError(f"Invalid sample_tokens: {sample_tokens} (must be an int >= 1)")
        if isinstance(measure_every, bool) or not (isinstance(measure_every, int) and measure_every >= 0):
            raise ValueError(f"Invalid measure_every: {measure_every} (must be an int >= 0; 0 never measures)")
        if not (math.isfinite(probe_weight_change) and probe_weight_change > 0):
            raise ValueError(f"Invalid probe_weight_change: {probe_weight_change} (must be a finite number > 0)")
        if not (0.0 < calibration_rate <= 1.0):
            raise ValueError(f"Invalid calibration_rate: {calibration_rate} (must be in (0, 1])")
        if probe not in PROBES:
            raise ValueError(f"Invalid probe: {probe!r} (must be one of {', '.join(map(repr, PROBES))})")
        lo, hi = calibration_bounds
        if not (0.0 < lo <= 1.0 <= hi < math.inf):
            raise ValueError(f"Invalid calibration_bounds: {calibration_bounds} (need 0 < low <= 1 <= high < inf)")
        self.target_kl = float(target_kl)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.sample_tokens = sample_tokens
        self.measure_every = measure_every
        self.probe_weight_change = float(probe_weight_change)
        self.calibration_rate = float(calibration_rate)
        self.calibration_bounds = (float(lo), float(hi))
        self.probe = probe
        self.history: deque[dict[str, Any]] = deque(maxlen=_HISTORY)
        self._steps = 0  # optimizer steps controlled so far (resumable)
        self._log_cal_ema = 0.0
        self._num_measurements = 0
        self._batches: int | None = None  # batches that stepped so far: the logger step of the next (resumable)
        self._stepped = False  # an optimizer step was seen in the current batch
        self._pending: dict[int, tuple[Any, dict[str, Any]]] = {}  # id(optimizer) -> (two-phase adapter, record)
        self._batch_records: list[dict[str, Any]] = []
        self._hooked: dict[int, Any] = {}  # id(optimizer) -> post-hook handle
        self._warn_once = WarnOnce(rank_zero_warn)

    # ------------------------------------------------------------------ state
    @property
    def state_key(self) -> str:
        return self._generate_state_key(target_kl=self.target_kl)

    @property
    def calibration(self) -> float:
        """Running realized/predicted ratio applied to the next prediction."""
        return calibration_from_ema(
            self._log_cal_ema, self._num_measurements, self.calibration_rate, self.calibration_bounds
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self._steps,
            "batches": self._batches if self._batches is not None else self._steps,
            "log_calibration_ema": self._log_cal_ema,
            "num_measurements": self._num_measurements,
            "calibration": self.calibration,  # for readers of the checkpoint; derived on load
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._steps = int(state_dict["steps"])
        self._batches = state_dict.get("batches")  # None in older checkpoints: taken from global_step at start
        self._log_cal_ema = float(state_dict["log_calibration_ema"])
        self._num_measurements = int(state_dict["num_measurements"])

    # ---------------------------------------------------------------- helpers
    def _probe(self, pl_module: L.LightningModule, record: dict[str, Any], timer: str = "probe_s") -> torch.Tensor:
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast(device_type=pl_module.device.type, enabled=False):
            logits = pl_module.kl_probe_logits(self.sample_tokens)
        if not (torch.is_tensor(logits) and logits.dim() == 2 and logits.shape[0] <= self.sample_tokens):
            shape = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
            raise ValueError(
                f"{type(pl_module).__name__}.kl_probe_logits({self.sample_tokens}) must return [N, V] logits "
                f"with N <= {self.sample_tokens}, got {shape}"
            )
        base = record.get("base")
        if base is not None and logits.shape != base.shape:
            raise RuntimeError(
                f"kl_probe_logits returned shapes {tuple(base.shape)} and then {tuple(logits.shape)} within one "
                "optimizer step; it must return the same token positions each time it is called within a step"
            )
        record[timer] += time.perf_counter() - start
        return logits.detach()

    def _reduce(self, trainer: L.Trainer, pl_module: L.LightningModule, value: float, op: str) -> float:
        if trainer.world_size <= 1:
            return float(value)
        t = torch.tensor(float(value), dtype=torch.float64, device=pl_module.device)
        return float(trainer.strategy.reduce(t, reduce_op=op))

    @torch.no_grad()
    def _control(self, trainer: L.Trainer, pl_module: L.LightningModule, two: Any, record: dict[str, Any]) -> None:
        """The control sequence on the two-phase calls: Δ, ``K`` from the probe, ``eta``."""
        prepare_start = time.perf_counter()
        two.prepare_update()
        if two.candidate_before_step:  # the optimizer's own work, not the control's
            record["control_s"] -= time.perf_counter() - prepare_start
        if self.probe == "jvp":
            K = forward_mode_K(two, partial(self._jvp_probe, trainer, pl_module, record))
        else:
            max_abs = self._reduce(trainer, pl_module, two.update_max_abs(), "max")
            logits = partial(self._probe, pl_module, record)
            K = finite_difference_K(two, logits, record["base"], max_abs, self.probe_weight_change)
        K = self._reduce(trainer, pl_module, K, "mean")
        c = self.calibration
        eta = choose_step_scale(K, self.target_kl, self.min_scale, self.max_scale, c)
        two.set_step_scale(eta)
        record.update(K=K, calibration=c, eta=eta)

    def _jvp_probe(self, trainer: L.Trainer, pl_module: L.LightningModule, record: dict[str, Any], tangent):
        start = time.perf_counter()
        with trainer.precision_plugin.forward_context():  # bf16 under bf16-mixed
            out = pl_module.kl_probe_jvp(self.sample_tokens, tangent)  # ([N, V], [N, V])
        record["probe_s"] += time.perf_counter() - start
        return out

    def _hook(self, optimizer: torch.optim.Optimizer, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if id(optimizer) in self._hooked:
            return

        def post_step(opt, args, kwargs):
            self._after_step(trainer, pl_module, opt)

        self._hooked[id(optimizer)] = optimizer.register_step_post_hook(post_step)

    def _check_optimizer(self, trainer: L.Trainer, opt: torch.optim.Optimizer) -> None:
        if self.probe == "finite_difference" and any(
            p.dtype not in (torch.float32, torch.float64) for g in opt.param_groups for p in g["params"]
        ):
            self._warn_once(
                "dtype",
                "KLStepControl: some params are not fp32; a probe step of "
                f"{self.probe_weight_change:g} per weight may round away. Use probe='jvp' (no weight moves), "
                "keep fp32 master weights (e.g. precision='bf16-mixed') or raise probe_weight_change.",
            )

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not isinstance(pl_module, SupportsKLProbe):
            raise MisconfigurationException(
                f"`KLStepControl` needs the LightningModule to implement `kl_probe_logits(max_tokens: int) -> Tensor` "
                f"([N, V] logits of the current batch at fixed token positions, see `SupportsKLProbe` in "
                f"logra_lightning.callbacks.kl_control); {type(pl_module).__name__} does not."
            )
        if self.probe == "jvp":
            self._check_jvp(trainer, pl_module)
        controls = [cb for cb in trainer.callbacks if isinstance(cb, KLStepControl)]
        if len(controls) > 1:
            raise MisconfigurationException(
                f"Found {len(controls)} `KLStepControl` callbacks (target_kl="
                f"{', '.join(f'{cb.target_kl:g}' for cb in controls)}); each would rescale the same optimizer "
                "steps. Please keep one."
            )

    @staticmethod
    def _check_jvp(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not callable(getattr(pl_module, "kl_probe_jvp", None)):
            raise MisconfigurationException(
                f"`KLStepControl(probe='jvp')` needs the LightningModule to implement `kl_probe_jvp(max_tokens, "
                f"tangent) -> (logits, dlogits)`; {type(pl_module).__name__} does not. Use probe='finite_difference'"
            )
        if isinstance(trainer.strategy, ModelParallelStrategy):
            raise MisconfigurationException(
                "`KLStepControl(probe='jvp')` swaps whole parameters for dual tensors in each module's forward, "
                "which FSDP2's sharded parameters do not allow. Use probe='finite_difference' under "
                f"{type(trainer.strategy).__name__}"
            )

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._batches is None:  # a fresh run, or a checkpoint without this callback's count
            self._batches = trainer.global_step

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        start = time.perf_counter()
        opt = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer, if handed one
        self._hook(opt, trainer, pl_module)
        self._stepped = True
        self._pending.pop(id(opt), None)  # a step skipped after its hook (e.g. AMP inf) left stale state
        self._check_optimizer(trainer, opt)
        two = two_phase(opt)
        record: dict[str, Any] = {"step": self._steps, "two_phase": two.candidate_before_step}
        record.update(probe_s=0.0, measure_s=0.0, control_s=0.0)
        record["measure"] = self.measure_every > 0 and self._steps % self.measure_every == 0
        if self.probe == "finite_difference" or record["measure"]:  # fp32 logits at W0
            record["base"] = self._probe(pl_module, record)
        two.begin()
        if two.candidate_before_step:  # Δ exists now; the optimizer's step applies eta * Δ
            self._clip_first(trainer, pl_module, optimizer)
            self._control(trainer, pl_module, two, record)
        record["control_s"] += time.perf_counter() - start
        self._pending[id(opt)] = (two, record)

    @staticmethod
    def _clip_first(trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        """Clip before Δ is prepared: Lightning clips only after this hook, when Δ would be fixed (choice 3)."""
        if pl_module.automatic_optimization and trainer.gradient_clip_val:
            pl_module.configure_gradient_clipping(
                optimizer,
                gradient_clip_val=trainer.gradient_clip_val,
                gradient_clip_algorithm=trainer.gradient_clip_algorithm,
            )

    @torch.no_grad()
    def _after_step(self, trainer: L.Trainer, pl_module: L.LightningModule, opt: torch.optim.Optimizer) -> None:
        start = time.perf_counter()
        two, record = self._pending.pop(id(opt), (None, None))
        if record is None:
            return  # a step outside fit, or one the hook did not see
        if not two.candidate_before_step:  # Δ exists only now that the optimizer has stepped
            try:
                self._control(trainer, pl_module, two, record)
            finally:
                two.finish()
        K, c, eta = record["K"], record["calibration"], record["eta"]
        record.update(predicted=eta * eta * K * c, predicted_raw=eta * eta * K, predicted_unscaled=K * c, realized=None)
        if record["measure"]:
            after = self._probe(pl_module, record, "measure_s")
            realized = self._reduce(trainer, pl_module, float(exact_kl(record["base"], after)), "mean")
            record["realized"] = realized
            if informative_measurement(realized, record["predicted_raw"], self.target_kl):
                self._log_cal_ema, self._num_measurements = update_log_calibration(
                    self._log_cal_ema, self._num_measurements, realized, record["predicted_raw"], self.calibration_rate
                )
        record.pop("base", None)
        record["control_s"] += time.perf_counter() - start
        self._steps += 1
        self.history.append(record)
        self._batch_records.append(record)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = self._batches or 0  # the step Lightning logs this batch's `self.log` metrics at
        if trainer.accumulate_grad_batches == 1 or self._stepped:  # Lightning counts batches that step
            self._batches = step + 1
        self._stepped = False
        records, self._batch_records = self._batch_records, []
        if not records:
            return
        n = len(records)
        metrics = {
            "kl/predicted": sum(r["predicted"] for r in records) / n,
            "kl/predicted_unscaled": sum(r["predicted_unscaled"] for r in records) / n,
            "kl/step_scale": sum(r["eta"] for r in records) / n,
            "kl/calibration": sum(r["calibration"] for r in records) / n,
            "kl/control_seconds": sum(r["control_s"] for r in records),
        }
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        measured = [r["realized"] for r in records if r["realized"] is not None]
        if measured:  # straight to the loggers (choice 4)
            for logger in trainer.loggers:
                logger.log_metrics({"kl/realized": sum(measured) / len(measured)}, step=step)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        self._pending.clear()
        self._batch_records.clear()
