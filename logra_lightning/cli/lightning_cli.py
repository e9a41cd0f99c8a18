"""``logra fit|validate|test|predict --config ...``: the LightningCLI of :class:`~logra_lightning.PolicyGradientModule`.

Config files may use omegaconf interpolation (``${model.init_args.group_size}``,
``${oc.env:HOME}``); the resolved config is saved next to the logs as ``config.yaml``.
TensorBoard under ``runs/<name>/version_N`` is the default logger; checkpoints are written
atomically (:class:`~logra_lightning.io.checkpoint.AtomicCheckpointIO`).

Before any class is created, :func:`~logra_lightning.config.checks.validate_fit_config` checks the
parsed config (values out of range fail with the key, the value and the allowed range), and
``--ckpt_path last`` / ``best`` are resolved to the newest ``last*.ckpt`` / the recorded best checkpoint
of the earlier runs, for any logger (:mod:`logra_lightning.cli.checkpoints`; Lightning itself looks only in
the new run's own version directory, which is empty). The resumed run logs to a new version.

Every mistake a user makes at start-up ends in one line, ``logra: error: ...``, and exit status 2
(:func:`~logra_lightning.cli.main.main`): ``--config`` files are checked before parsing (missing,
unreadable, invalid YAML with ``file:line:column``), jsonargparse's errors (unknown keys, wrong types,
unknown classes) are turned into one line, ``--ckpt_path`` is checked before Lightning reads it
(:func:`~logra_lightning.io.checkpoint.check_checkpoint_path`), and model paths, log and export
directories in :func:`~logra_lightning.config.checks.validate_fit_config`. ``logra fit --export DIR``
adds :class:`~logra_lightning.callbacks.ExportPolicy`; the progress bar is
:class:`~logra_lightning.callbacks.StepProgressBar` unless the config names another, and ``fit`` logs
sample completions with :class:`~logra_lightning.callbacks.LogCompletions` unless the config names one. With LoGRA,
``--trainer.strategy ddp`` (``ddp_spawn``) runs :class:`~logra_lightning.optim.LoGRADDPStrategy`
(``logra_ddp``): LoGRA's matrices stay out of DDP and their sketches are all-reduced (docs/strategies.md).

Example::

    >>> from logra_lightning.cli import run
    >>> run(["fit", "--config", "configs/arithmetic_tiny.yaml", "--trainer.max_steps", "2"])  # doctest: +SKIP
    >>> run(["fit", "--config", "configs/arithmetic_tiny.yaml", "--ckpt_path", "last"])  # doctest: +SKIP
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from logra_lightning.cli.checkpoints import resolve_ckpt_keyword
from logra_lightning.config.checks import validate_fit_config
from logra_lightning.config.resume import check_resume_optimizer, checkpoint_optimizer, replaced_hparams
from logra_lightning.data import PromptDataModule
from logra_lightning.errors import ConfigError, LograError
from logra_lightning.io.checkpoint import check_checkpoint_path, is_distributed_checkpoint
from logra_lightning.optim.ddp_strategy import logra_strategy
from logra_lightning.rl.module import PolicyGradientModule

TRAINER_DEFAULTS = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "logra"},
    },
    "plugins": {"class_path": "logra_lightning.io.checkpoint.AtomicCheckpointIO"},
    "accelerator": "auto",
    "devices": 1,
    "log_every_n_steps": 1,
}


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


_CKPT_KEYWORDS = ("last", "best", "hpc", "registry")


def _check_ckpt_path(ckpt_path: Any) -> None:
    if ckpt_path is None or (
        isinstance(ckpt_path, str) and (ckpt_path in _CKPT_KEYWORDS or ckpt_path.startswith("registry:"))
    ):
        return
    if "://" in str(ckpt_path):  # remote (fsspec) paths are Lightning's to read
        return
    check_checkpoint_path(str(ckpt_path))


def _strategy_name(trainer_cfg: dict[str, Any]) -> str:
    strategy = trainer_cfg.get("strategy")
    return str(strategy.get("class_path", "") if isinstance(strategy, dict) else strategy or "")


def parse_error_line(message: str, subcommand: str | None = None) -> str:
    """jsonargparse's (often multi-line) parse error as one line, with where to look for the keys."""
    text = " ".join(message.split())
    text = re.sub(r'^Parser key "([^"]+)": ?', r"\1: ", text)
    text = text.replace(": - ", ": ").replace(" - ", "; ")
    prog = f"logra {subcommand}" if subcommand else "logra"
    if "unrecognized arguments" in text or "required" in text or "Expected" in text or "expected" in text:
        text += f" (`{prog} --help` lists the keys and their types)"
    return text


def interpolation_error_line(err: BaseException, config_files: list[str]) -> str:
    """omegaconf's multi-line interpolation error as one line naming the key and the config files.

    Example::

        >>> from omegaconf.errors import InterpolationResolutionError
        >>> err = InterpolationResolutionError("Environment variable 'X' not found")
        >>> err.full_key = "model.group_size"
        >>> interpolation_error_line(err, ["a.yaml"])  # doctest: +ELLIPSIS
        "model.group_size: interpolation cannot be resolved: Environment variable 'X' not found (--config a.yaml); ..."
    """
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    reason = re.sub(r"^\w+ raised while resolving interpolation: ", "", reason).strip('"')
    key = getattr(err, "full_key", None) or "config"
    files = f" (--config {', '.join(config_files)})" if config_files else ""
    return (
        f"{key}: interpolation cannot be resolved: {reason}{files}; set the variable, give a default "
        "(${oc.env:NAME,default}) or write the value itself"
    )


def _model_scalars(config) -> dict[str, Any]:
    """The plain ``model.*`` values of a parsed config (what a checkpoint's hyperparameters can replace)."""
    if not config.get("subcommand"):
        return {}
    model = config[config.subcommand].get("model")
    items = model.as_dict().items() if hasattr(model, "as_dict") else dict(model or {}).items()
    return {k: v for k, v in items if v is None or isinstance(v, (str, int, float, bool))}


def subcommand_of(argv: list[str]) -> str | None:
    return next((a for a in argv if a in ("fit", "validate", "test")), None)


class LograCLI(LightningCLI):
    """LightningCLI with omegaconf interpolation, the project's trainer defaults and start-up checks.

    Subcommands: ``fit`` (RL), ``validate`` and ``test`` (held-out greedy accuracy of the policy, or of a
    checkpoint with ``--ckpt_path``). Lightning's ``predict`` is not offered: the module has no
    prediction step (sample from an exported policy with ``vllm serve`` instead).
    """

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        return {k: v for k, v in LightningCLI.subcommands().items() if k in ("fit", "validate", "test")}

    def __init__(self, args=None, run: bool = True) -> None:
        super().__init__(
            PolicyGradientModule,
            PromptDataModule,
            parser_kwargs={"parser_mode": "omegaconf", "exit_on_error": False},
            save_config_kwargs={"overwrite": True},
            trainer_defaults=TRAINER_DEFAULTS,
            args=args,
            run=run,
        )

    @override
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--export",
            type=str | None,
            default=None,
            help="write the trained policy as a Hugging Face directory here when fit ends "
            "(logra_lightning.callbacks.ExportPolicy); serve it with `vllm serve DIR`",
        )

    @override
    def _parse_ckpt_path(self) -> None:  # Lightning reads the checkpoint's hyperparameters here: check it first
        if self.config.get("subcommand"):
            _check_ckpt_path(self.config[self.config.subcommand].get("ckpt_path"))
        before = _model_scalars(self.config)
        try:
            super()._parse_ckpt_path()
            changed = replaced_hparams(before, _model_scalars(self.config))
            if changed:
                path = self.config[self.config.subcommand].get("ckpt_path")
                rank_zero_warn(
                    f"--ckpt_path {path}: the checkpoint's saved settings replace "
                    + ", ".join(f"model.{k}={a!r} (now {b!r})" for k, a, b in changed)
                    + "; a resumed run continues the run that wrote the checkpoint. To train with other "
                    "settings, start a new run from its weights (logra export, then --model.model DIR)"
                )
        except LograError:
            raise
        except Exception as err:  # noqa: BLE001 - torch.load of a damaged file, hyperparameters that do not parse
            path = self.config[self.config.subcommand].get("ckpt_path")
            raise ConfigError(
                f"--ckpt_path {path}: cannot be read, or its hyperparameters do not fit this config "
                f"({type(err).__name__}: "
                f"{' '.join(str(err).split())[:200]})"
            ) from None

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        validate_fit_config(config.as_dict())
        if config.get("ckpt_path") in ("last", "best"):  # the earlier runs' checkpoints, for any logger
            path, message = resolve_ckpt_keyword(
                config.ckpt_path, self.subcommand, config.as_dict().get("trainer") or {}
            )
            if path is not None:
                rank_zero_info(message)
                config.ckpt_path = path
        ckpt_path = config.get("ckpt_path")
        if ckpt_path not in (None, *_CKPT_KEYWORDS) and is_distributed_checkpoint(ckpt_path):
            if not _strategy_name(config.as_dict().get("trainer") or {}).endswith("ModelParallelStrategy"):
                raise ConfigError(
                    f"--ckpt_path {ckpt_path}: a distributed (FSDP2) checkpoint, which only ModelParallelStrategy "
                    "can resume; run the config that wrote it (e.g. configs/arithmetic_fsdp.yaml), or turn it into a "
                    f"model with `logra export --ckpt_path {ckpt_path} --out DIR` and train from --model.model DIR"
                )
        ckpt_path = config.get("ckpt_path")
        if ckpt_path not in (None, *_CKPT_KEYWORDS) and Path(ckpt_path).is_file():
            model_cfg = config.as_dict().get("model") or {}
            check_resume_optimizer(ckpt_path, checkpoint_optimizer(ckpt_path), model_cfg.get("optimizer"))

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

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        from logra_lightning.callbacks import ExportPolicy, LogCompletions, StepProgressBar

        callbacks = list(callbacks)
        configured = config.get("callbacks") or []
        configured = configured if isinstance(configured, list) else [configured]
        if config.get("enable_progress_bar", True) is not False and not any(
            isinstance(cb, ProgressBar) for cb in [*configured, *callbacks]
        ):
            callbacks.append(StepProgressBar())
        if self.subcommand == "fit" and not any(isinstance(cb, LogCompletions) for cb in [*configured, *callbacks]):
            callbacks.append(LogCompletions())  # what the policy says, in completions.jsonl and the logger
        section = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand == "fit" and section.get("export"):
            callbacks.append(ExportPolicy(section.get("export")))
        strategy = logra_strategy(config.get("strategy"), getattr(self.model, "optimizer_factory", None))
        if strategy != config.get("strategy"):  # LoGRA's matrices out of DDP: their sketches are all-reduced instead
            rank_zero_info(f"[logra] trainer.strategy={config.get('strategy')!r} with LoGRA: using {strategy!r}")
            config = {**config, "strategy": strategy}
        return super()._instantiate_trainer(config, callbacks)
