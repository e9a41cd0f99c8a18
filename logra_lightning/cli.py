"""The ``logra`` command: ``logra fit|validate --config ...`` (LightningCLI) and ``logra plan ...``.

Config files may use omegaconf interpolation (``${model.init_args.group_size}``,
``${oc.env:HOME}``); the resolved config is saved next to the logs as ``config.yaml``.
TensorBoard under ``runs/<name>/version_N`` is the default logger.

Example::

    >>> from logra_lightning.cli import main
    >>> main(["fit", "--config", "configs/arithmetic_tiny.yaml", "--trainer.max_steps", "2"])  # doctest: +SKIP
"""

from __future__ import annotations

import sys

import torch
from lightning.pytorch.cli import LightningCLI

from logra_lightning.data import PromptDataModule
from logra_lightning.errors import LograError
from logra_lightning.module import PolicyGradientModule

TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "logra"},
    },
    "accelerator": "auto",
    "devices": 1,
    "log_every_n_steps": 1,
}


class LograCLI(LightningCLI):
    """LightningCLI with omegaconf interpolation and the project's trainer defaults."""

    def __init__(self, args=None, run: bool = True) -> None:
        super().__init__(
            PolicyGradientModule,
            PromptDataModule,
            parser_kwargs={"parser_mode": "omegaconf"},
            save_config_kwargs={"overwrite": True},
            trainer_defaults=TRAINER_DEFAULTS,
            args=args,
            run=run,
        )


def main(args: list[str] | None = None) -> LograCLI | None:
    """Entry point of ``logra`` and ``python -m logra_lightning``; ``args`` defaults to ``sys.argv[1:]``."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] == "plan":
        from logra_lightning import plan

        return plan.main(argv[1:])
    try:
        return LograCLI(args=argv)
    except LograError as err:
        if args is not None:  # called from Python (tests): let the caller see the exception
            raise
        print(f"logra: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    torch.multiprocessing.set_start_method("spawn", force=True)
    main()
