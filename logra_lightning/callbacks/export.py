"""``ExportPolicy``: write the trained policy as a Hugging Face directory at the end of fit.

``logra fit --export DIR`` adds it; in a config::

    trainer:
      callbacks:
        - class_path: logra_lightning.callbacks.ExportPolicy
          init_args: {dirpath: runs/policy}

The directory (``model.safetensors``, ``config.json``, ``generation_config.json``, tokenizer
files, ``logra_export.json``) is what :mod:`logra_lightning.io.export` writes from a checkpoint;
serve it with ``vllm serve DIR``. The directory is checked in ``setup`` (before the model is
built), so a bad path fails at start-up rather than after training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from logra_lightning.errors import ConfigError
from logra_lightning.io.export import DTYPES, build_model, check_export_dir, save_export


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU weights of ``model`` on rank 0 (a collective under FSDP2; other ranks get ``{}``)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


class ExportPolicy(L.Callback):
    """Write ``pl_module.policy`` and ``pl_module.tokenizer`` as a Hugging Face model directory when fit ends.

    Args:
        dirpath: the directory to write; ``None``: ``<log_dir>/export``. It must be new, empty
            or an earlier export (replaced); other non-empty directories are refused at setup.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``; ``None``: as trained.

    Raises:
        ConfigError: a bad ``dtype`` (at creation) or ``dirpath`` (in ``setup``), or a module
            without ``policy`` and ``tokenizer`` attributes.
        CheckpointError: writing failed at the end of fit (checkpoints already saved are untouched).

    Logged metrics:
        None; prints the directory and the command that serves it.

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(max_steps=10, callbacks=[ExportPolicy("runs/policy")])
        >>> # trainer.fit(PolicyGradientModule(...), datamodule)  ->  runs/policy/model.safetensors, ...
    """

    def __init__(self, dirpath: str | None = None, dtype: str | None = None) -> None:
        if dtype is not None and dtype not in DTYPES:
            raise ConfigError(f"ExportPolicy.dtype={dtype!r}: allowed {', '.join(DTYPES)}, or null (as trained)")
        self.dirpath, self.dtype = dirpath, dtype
        self.exported: Path | None = None

    def _target(self, trainer: L.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath).expanduser()
        return Path(trainer.log_dir or trainer.default_root_dir) / "export"

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.is_global_zero:
            check_export_dir(self._target(trainer), "ExportPolicy.dirpath")

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        policy, tokenizer = getattr(pl_module, "policy", None), getattr(pl_module, "tokenizer", None)
        if policy is None or tokenizer is None:
            raise ConfigError(
                f"ExportPolicy needs a module with `policy` and `tokenizer` attributes; "
                f"{type(pl_module).__name__} has none"
            )
        target = self._target(trainer)  # trainer.log_dir is a broadcast: every rank reads it
        weights = full_state_dict(policy)  # a collective under FSDP2
        adapter = getattr(pl_module, "adapter", None)
        if adapter is not None:  # LoRA: W0 + s*B@A under the base model's names, a plain model
            weights = adapter.merged_state_dict(weights)
        self._write(trainer, pl_module, policy, tokenizer, weights, target)

    @rank_zero_only
    def _write(self, trainer, pl_module, policy, tokenizer, weights: dict[str, torch.Tensor], target: Path) -> None:
        model = build_model(policy.config, weights, DTYPES.get(self.dtype or ""))
        model.generation_config = policy.generation_config
        provenance: dict[str, Any] = {
            "base_model": getattr(pl_module, "model_spec", None),
            "checkpoint": None,
            "global_step": trainer.global_step,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        }
        self.exported = save_export(model, tokenizer, target, provenance)
        print(
            f"[logra] exported the policy after {trainer.global_step} steps to {self.exported}\n"
            f"  serve it: vllm serve {self.exported}",
            flush=True,
        )
