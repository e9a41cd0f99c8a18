"""A callback for benchmarks: the trainer process's whole-run peak RSS and its training-memory part.

``logra fit`` runs with this callback (``benchmarks/reasoning_tasks.py`` adds it to the config's
callbacks, and leaves out ``MemoryMonitor``, which resets the kernel's peak counter at every phase).
It writes ``memory.json`` into the run's log directory at the end of the fit:

* ``rss_before_model_bytes``: ``VmRSS`` in the callback's ``setup``, which Lightning calls after the
  data module's ``setup`` and before the module's (so before the policy and the engine are built). With a
  vLLM engine, ``vllm`` is imported first: its modules (~185 MB of RSS here) are a fixed cost of the process,
  like torch's, not training memory;
* ``peak_rss_bytes``: ``VmHWM`` at the end of the fit, the highest resident set the trainer
  process ever had (model, optimizer, activations, vLLM client, evaluation; the vLLM engine runs in
  processes of its own and is not counted);
* ``train_memory_bytes``: ``peak_rss_bytes - rss_before_model_bytes`` (the definition of
  ``benchmarks/optimizer_memory.py``);
* ``cpu_seconds``: user + system CPU time of the trainer process (not of the engine's processes), a
  load-independent cost figure on a shared machine;
* ``param_bytes``, ``grad_bytes``, ``optimizer_state_bytes``: exact bytes of the tensors, the largest
  seen after any training batch (gradients counted after backward, before ``zero_grad`` would run
  the next step; :mod:`logra_lightning.optim.accounting`).

Example::

    >>> cb = TrainerPeakMemory()
    >>> sorted(cb.record)
    []
"""

from __future__ import annotations

import importlib
import json
import resource
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from logra_lightning.optim import host_memory
from logra_lightning.optim.accounting import grad_bytes, optimizer_state_bytes, param_bytes
from logra_lightning.rollout.vllm.engine import VLLMEngineSpec  # imports vllm itself only when an engine is built

FILE = "memory.json"


class TrainerPeakMemory(L.Callback):
    """Record the trainer process's peak RSS over the whole fit and the exact training-state bytes.

    Logged metrics:
        none (the numbers go to ``<log_dir>/memory.json``).
    """

    def __init__(self) -> None:
        self.record: dict[str, Any] = {}

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            if isinstance(getattr(pl_module, "engine_spec", None), VLLMEngineSpec):
                importlib.import_module("vllm")  # the library's pages before the baseline (module doc)
            self.record = {
                "rss_before_model_bytes": host_memory.rss(),
                "param_bytes": 0,
                "grad_bytes": 0,
                "optimizer_state_bytes": 0,
            }

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        self._count(pl_module, optimizer)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        for opt in trainer.optimizers:
            self._count(pl_module, opt)

    def _count(self, pl_module: L.LightningModule, optimizer) -> None:
        opt = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper
        rec = self.record
        rec["param_bytes"] = max(rec["param_bytes"], param_bytes(pl_module))
        rec["grad_bytes"] = max(rec["grad_bytes"], grad_bytes(pl_module))
        rec["optimizer_state_bytes"] = max(rec["optimizer_state_bytes"], optimizer_state_bytes(opt))

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not self.record or not trainer.is_global_zero or not trainer.log_dir:
            return
        self.record["peak_rss_bytes"] = host_memory.peak_rss()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.record["cpu_seconds"] = round(usage.ru_utime + usage.ru_stime, 1)
        self.record["train_memory_bytes"] = self.record["peak_rss_bytes"] - self.record["rss_before_model_bytes"]
        Path(trainer.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(trainer.log_dir) / FILE).write_text(json.dumps(self.record, indent=2))
