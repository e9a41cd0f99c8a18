"""Kept at this path because checkpoints of LoRA runs record ``logra_lightning.adapters.LoRA`` in their
hyperparameters (re-parsed on resume and export); the code is in :mod:`logra_lightning.models.lora`."""

from logra_lightning.models.lora import LoRA

__all__ = ["LoRA"]
