"""The ``logra`` command: ``logra fit|validate --config ...`` (LightningCLI) and ``logra plan ...``.

Config files may use omegaconf interpolation (``${model.init_args.group_size}``,
``${oc.env:HOME}``); the resolved config is saved next to the logs as ``config.yaml``.
TensorBoard under ``runs/<name>/version_N`` is the default logger; checkpoints are written
atomically (:class:`~logra_lightning.checkpoint_io.AtomicCheckpointIO`).

Before any class is created, :func:`~logra_lightning.validation.validate_fit_config` checks the
parsed config (values out of range fail with the key, the value and the allowed range), and
``--ckpt_path last`` is resolved to the newest ``last*.ckpt`` under the logger's
``<save_dir>/<name>/version_*/checkpoints/`` (Lightning itself looks only in the new run's own
version directory, which is empty). The resumed run logs to a new ``version_N``.

Example::

    >>> from logra_lightning.cli import main
    >>> main(["fit", "--config", "configs/arithmetic_tiny.yaml", "--trainer.max_steps", "2"])  # doctest: +SKIP
    >>> main(["fit", "--config", "configs/arithmetic_tiny.yaml", "--ckpt_path", "last"])  # doctest: +SKIP
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from logra_lightning.data import PromptDataModule
from logra_lightning.errors import ConfigError, LograError
from logra_lightning.module import PolicyGradientModule
from logra_lightning.validation import validate_fit_config

TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "logra"},
    },
    "plugins": {"class_path": "logra_lightning.checkpoint_io.AtomicCheckpointIO"},
    "accelerator": "auto",
    "devices": 1,
    "log_every_n_steps": 1,
}


def find_last_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest ``last*.ckpt`` (file or distributed-checkpoint directory) in ``run_dir/*/checkpoints/``."""
    found = [p for p in Path(run_dir).glob("*/checkpoints/last*.ckpt") if re.fullmatch(r"last(-v\d+)?\.ckpt", p.name)]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def _logger_run_dir(trainer_cfg: dict[str, Any]) -> Path | None:
    """``<save_dir>/<name>`` of a single configured logger, or ``None`` (no logger, several, or unusual)."""
    logger = trainer_cfg.get("logger")
    if isinstance(logger, list):
        logger = logger[0] if len(logger) == 1 else None
    if not isinstance(logger, dict):
        return None
    args = logger.get("init_args") or {}
    save_dir = args.get("save_dir") or trainer_cfg.get("default_root_dir") or "."
    return Path(save_dir) / str(args.get("name") or "lightning_logs")


def _explicit_checkpoint_dir(trainer_cfg: dict[str, Any]) -> bool:
    callbacks = trainer_cfg.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    return any(isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("ModelCheckpoint")
               and (cb.get("init_args") or {}).get("dirpath") for cb in callbacks)  # fmt: skip


def _own_error(err: BaseException) -> LograError | None:
    """The first :class:`LograError` in ``err``'s chain of causes (jsonargparse wraps constructor errors)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, LograError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _root_cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None:
        err = err.__cause__
    return err


class LograCLI(LightningCLI):
    """LightningCLI with omegaconf interpolation, the project's trainer defaults and start-up checks."""

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

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        validate_fit_config(config.as_dict())
        if self.subcommand == "fit" and config.get("ckpt_path") == "last":
            trainer_cfg = config.as_dict().get("trainer") or {}
            run_dir = _logger_run_dir(trainer_cfg)
            if run_dir is not None and not _explicit_checkpoint_dir(trainer_cfg):
                last = find_last_checkpoint(run_dir)
                if last is not None:
                    rank_zero_info(f"[logra] resuming from {last}")
                    config.ckpt_path = str(last)

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except LograError:
            raise
        except (ValueError, TypeError, MisconfigurationException) as err:  # a constructor rejected a config value
            own = _own_error(err)
            if own is not None:
                raise own from None
            cause = _root_cause(err)
            raise ConfigError(f"invalid config value: {type(cause).__name__}: {cause}") from err


def main(args: list[str] | None = None) -> LograCLI | int | None:
    """Entry point of ``logra`` and ``python -m logra_lightning``; ``args`` defaults to ``sys.argv[1:]``.

    Called with ``args`` (from Python) it returns the :class:`LograCLI` (or ``logra plan``'s exit
    code) and lets a :class:`~logra_lightning.errors.LograError` propagate; from the console it
    returns ``None`` (exit status 0; the console script passes the return value to ``sys.exit``)
    and turns a ``LograError`` into ``logra: error: ...`` and exit status 2.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] == "plan":
        from logra_lightning import plan

        return plan.main(argv[1:])
    try:
        cli = LograCLI(args=None if args is None else argv)  # None: the CLI reads sys.argv itself, without a warning
    except LograError as err:
        if args is not None:  # called from Python (tests): let the caller see the exception
            raise
        print(f"logra: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return cli if args is not None else None


if __name__ == "__main__":
    torch.multiprocessing.set_start_method("spawn", force=True)
    main()
