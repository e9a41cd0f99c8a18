"""Memory per phase of a training step, plus exact byte accounting of params, grads and optimizer state.

The claim of this library is memory, so every run can show it: for each phase of a
step (rollout, forward/backward, optimizer, weight sync) :class:`MemoryMonitor` logs
the peak and the current memory, and once per batch the exact bytes of parameters,
live gradients and optimizer state (:mod:`logra_lightning.optim.accounting`).
Tests: ``.venv/bin/python -m pytest tests/test_memory_monitor.py -q``.

Where the phases come from:

1. **Announced** (:func:`logra_lightning.rl.phases.announce_phase`): a module that wraps
   parts of its step in ``with announce_phase(self, "rollout"):`` gets exactly those
   phases. Phases may nest (a peak inside an inner phase also counts for the outer one).
   Once ``forward_backward`` or ``optimizer`` has been announced, the fallback below
   is switched off for the rest of the run.
2. **Fallback** (any Lightning project, from standard hooks): ``forward_backward`` runs
   from ``on_train_batch_start`` (or ``on_before_backward`` after an earlier optimizer
   step in the same batch) to ``on_after_backward``; ``optimizer`` runs from
   ``on_before_optimizer_step`` to the next ``on_before_backward`` or
   ``on_train_batch_end`` (there is no hook after ``optimizer.step()``, so it also
   covers ``zero_grad``). Phases announced on top of the fallback (e.g. ``weight_sync``
   from :class:`~logra_lightning.callbacks.LowRankWeightSync`) nest inside it.

How memory is measured:

- **CUDA**: ``memory_allocated`` (current), ``max_memory_allocated`` with
  ``reset_peak_memory_stats`` at each phase start (peak), ``memory_reserved``.
- **CPU**: the process's resident set size. The peak is the kernel's high-water mark
  ``VmHWM`` from ``/proc/self/status``, reset at each phase start by writing ``5`` to
  ``/proc/self/clear_refs`` (Linux >= 4.0), so a buffer that lives and dies inside a
  phase is seen. Where that is not permitted (or there is no ``/proc``), a thread
  samples RSS every ``sample_interval`` seconds while a phase is open; short spikes
  can then be missed.

Values are in GB = 1e9 bytes. Phases are measured during training only (not in
validation or the sanity check).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import lightning as L
import psutil
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from logra_lightning.optim import host_memory
from logra_lightning.optim.accounting import grad_bytes, optimizer_state_bytes, param_bytes

GB = 1e9
_FALLBACK_OFF_BY = ("forward_backward", "optimizer")  # announcing either replaces the hook-based phases


# ------------------------------------------------------------------ probes
class _CudaProbe:
    """Allocated / peak allocated / reserved bytes of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def extra(self) -> dict[str, int]:
        return {"reserved_gb": torch.cuda.memory_reserved(self.device)}

    def close(self) -> None:
        pass


class _HighWaterProbe:
    """Process RSS with the kernel's resettable high-water mark (Linux)."""

    def current(self) -> int:
        return host_memory.rss()

    def peak(self) -> int:
        return host_memory.peak_rss()

    def reset_peak(self) -> None:
        host_memory.reset_peak_rss()

    def extra(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass

    @classmethod
    def available(cls) -> bool:
        try:
            probe = cls()
            probe.reset_peak()
            return probe.peak() > 0
        except OSError:
            return False


class _SampledRssProbe:
    """Process RSS; the peak is the max of samples taken by a thread every ``interval`` seconds."""

    def __init__(self, interval: float) -> None:
        self._process = psutil.Process()
        self._interval = interval
        self._max = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="MemoryMonitor-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._max = max(self._max, self.current())

    def current(self) -> int:
        return self._process.memory_info().rss

    def peak(self) -> int:
        self._max = max(self._max, self.current())
        return self._max

    def reset_peak(self) -> None:
        self._max = self.current()

    def extra(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self._stop.set()


@dataclass
class _OpenPhase:
    name: str
    peak: int
    fallback: bool


# ---------------------------------------------------------------- callback
class MemoryMonitor(L.Callback):
    """Log peak and current memory per phase of each training step, and the bytes of params, grads and optimizer state.

    Args:
        per_rank: ``False`` (default): log rank 0's numbers only (every rank measures;
            only rank 0's logger writes). ``True``: gather every rank's numbers to rank 0
            and log them under ``memory/rank{r}/...`` (e.g. ``memory/rank1/optimizer/peak_gb``).
            This adds one ``all_gather`` per phase end and per batch, so every rank must
            run the same phases (true for SPMD training).
        sample_interval: seconds between RSS samples on CPU when the kernel's high-water
            mark cannot be reset (see the module docstring). Must be > 0.

    Raises:
        ValueError: ``sample_interval`` is not positive.
        MisconfigurationException: in ``setup``, the trainer has no logger.

    Example::

        >>> import lightning as L
        >>> from logra_lightning.callbacks.memory import MemoryMonitor
        >>> trainer = L.Trainer(callbacks=[MemoryMonitor()], max_steps=10)  # then trainer.fit(module)

    Logged metrics:
        - ``memory/<phase>/peak_gb``: peak during the phase (max over the phase's repeats within a
          step). CUDA: max allocated; CPU: peak resident set size of the process.
        - ``memory/<phase>/current_gb``: at the end of the phase (allocated on CUDA, RSS on CPU).
        - ``memory/<phase>/reserved_gb``: CUDA only, reserved by the caching allocator at phase end.
        - ``memory/params_gb``: bytes of the module's parameters held by this rank (local shards under FSDP2).
        - ``memory/grads_gb``: bytes of live ``.grad`` tensors, the larger of the counts taken after backward
          and before the optimizer step (LoGRA frees low-rank gradients in backward, so this is small).
        - ``memory/optimizer_state_gb``: bytes in the state of all of the trainer's optimizers, after the step.
        - ``memory/engine_rss_gb``: resident memory of the rollout engine's own processes at the end of the batch,
          when ``pl_module.engine`` reports it (``rss_bytes()``: :class:`~logra_lightning.rollout.vllm.VLLMEngine`).

        ``<phase>`` is ``rollout``, ``forward_backward``, ``optimizer``, ``weight_sync`` or any name a
        module announces. With ``per_rank=True`` every key becomes ``memory/rank{r}/<rest>``.
    """

    def __init__(self, per_rank: bool = False, sample_interval: float = 0.005) -> None:
        if not sample_interval > 0:
            raise ValueError(f"Invalid sample_interval: {sample_interval} (must be > 0 seconds)")
        self.per_rank = bool(per_rank)
        self.sample_interval = float(sample_interval)
        self._probe: Any = None
        self._stack: list[_OpenPhase] = []
        self._fallback = True
        self._step_peaks: dict[str, float] = {}
        self._grad_bytes = 0

    # ------------------------------------------------------------- set-up
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise MisconfigurationException("Cannot use `MemoryMonitor` callback with `Trainer(logger=False)`.")
        device = trainer.strategy.root_device
        if device.type == "cuda":
            self._probe = _CudaProbe(device)
        elif _HighWaterProbe.available():
            self._probe = _HighWaterProbe()
        else:
            rank_zero_warn(
                "MemoryMonitor: cannot reset the kernel's peak-RSS counter (/proc/self/clear_refs); "
                f"sampling RSS every {self.sample_interval}s instead, so short peaks may be missed."
            )
            self._probe = _SampledRssProbe(self.sample_interval)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        self._stack.clear()

    # ------------------------------------------------------ phase tracking
    def _active(self, trainer: L.Trainer) -> bool:
        return self._probe is not None and trainer.training and not trainer.sanity_checking

    def _fold_peak(self) -> None:
        peak = self._probe.peak()
        for phase in self._stack:
            phase.peak = max(phase.peak, peak)

    def _start(self, name: str, fallback: bool) -> None:
        self._fold_peak()  # outer phases keep what they saw before the reset
        self._probe.reset_peak()
        self._stack.append(_OpenPhase(name, self._probe.current(), fallback))

    def _end(self, trainer: L.Trainer, pl_module: L.LightningModule, name: str) -> None:
        idx = next((i for i in range(len(self._stack) - 1, -1, -1) if self._stack[i].name == name), None)
        if idx is None:
            return  # started before the monitor could see it (or outside training)
        self._fold_peak()
        phase = self._stack.pop(idx)
        key = f"memory/{phase.name}"
        peak = max(self._step_peaks.get(key, 0.0), phase.peak / GB)
        self._step_peaks[key] = peak
        metrics = {f"{key}/peak_gb": peak, f"{key}/current_gb": self._probe.current() / GB}
        metrics.update({f"{key}/{k}": v / GB for k, v in self._probe.extra().items()})
        self._log(trainer, pl_module, metrics)

    def _fallback_switch(self, trainer: L.Trainer, pl_module: L.LightningModule, name: str | None) -> None:
        """Close the open fallback phase, then open ``name`` (if given) as the new one."""
        if not (self._fallback and self._active(trainer)):
            return
        open_fallback = [p.name for p in self._stack if p.fallback]
        for old in reversed(open_fallback):
            self._end(trainer, pl_module, old)
        if name is not None:
            self._start(name, fallback=True)

    def on_phase_start(self, trainer: L.Trainer, pl_module: L.LightningModule, name: str) -> None:
        """Called by :func:`~logra_lightning.rl.phases.announce_phase` when phase ``name`` starts."""
        if not self._active(trainer):
            return
        if self._fallback and name in _FALLBACK_OFF_BY:
            self._fallback = False  # the module announces its own phases: drop the hook-based ones unlogged
            self._stack = [p for p in self._stack if not p.fallback]
        self._start(name, fallback=False)

    def on_phase_end(self, trainer: L.Trainer, pl_module: L.LightningModule, name: str) -> None:
        """Called by :func:`~logra_lightning.rl.phases.announce_phase` when phase ``name`` ends."""
        if self._active(trainer):
            self._end(trainer, pl_module, name)

    # ------------------------------------------------------ standard hooks
    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_peaks.clear()
        self._grad_bytes = 0
        self._fallback_switch(trainer, pl_module, "forward_backward")

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if not any(p.fallback and p.name == "forward_backward" for p in self._stack):
            self._fallback_switch(trainer, pl_module, "forward_backward")

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._grad_bytes = max(self._grad_bytes, grad_bytes(pl_module))
        self._fallback_switch(trainer, pl_module, None)

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._grad_bytes = max(self._grad_bytes, grad_bytes(pl_module))
        self._fallback_switch(trainer, pl_module, "optimizer")

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._fallback_switch(trainer, pl_module, None)
        if not self._active(trainer):
            return
        state = sum(optimizer_state_bytes(opt) for opt in trainer.optimizers)
        metrics = {
            "memory/params_gb": param_bytes(pl_module) / GB,
            "memory/grads_gb": self._grad_bytes / GB,
            "memory/optimizer_state_gb": state / GB,
        }
        engine_rss = getattr(getattr(pl_module, "engine", None), "rss_bytes", None)
        rss = engine_rss() if callable(engine_rss) else None
        if rss is not None:
            metrics["memory/engine_rss_gb"] = rss / GB
        self._log(trainer, pl_module, metrics)

    # ------------------------------------------------------------- logging
    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule, metrics: dict[str, float]) -> None:
        if self.per_rank:
            metrics = self._gather_per_rank(trainer, pl_module, metrics)
        try:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        except MisconfigurationException:
            # a phase that ends in a hook where step logging is not allowed (e.g. a weight sync
            # announced in `on_train_start`): hand the numbers to the loggers directly
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @staticmethod
    def _gather_per_rank(trainer: L.Trainer, pl_module: L.LightningModule, metrics: dict[str, float]) -> dict:
        keys = sorted(metrics)
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=pl_module.device)
        gathered = pl_module.all_gather(values) if trainer.world_size > 1 else values[None]  # [world, len(keys)]
        gathered = gathered.reshape(-1, len(keys)).cpu().tolist()
        return {
            k.replace("memory/", f"memory/rank{rank}/", 1): row[i]
            for rank, row in enumerate(gathered)
            for i, k in enumerate(keys)
        }
