"""Callbacks that inject faults into a run (imported by class_path from test configs; not a test module)."""

from __future__ import annotations

import os

import lightning as L


class ExitAtStep(L.Callback):
    """Kill the process without any cleanup (like SIGKILL) in the middle of optimizer step ``step``:
    after that step's rollout and backward, before its update is applied or checkpointed."""

    def __init__(self, step: int, code: int = 17) -> None:
        self.step, self.code = step, code

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if trainer.global_step == self.step:
            os._exit(self.code)
