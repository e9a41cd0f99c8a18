"""``--ckpt_path last`` and ``--ckpt_path best``, found in the run's checkpoint directories for any logger.

Lightning writes checkpoints to ``<save_dir>/<name>/<version>/checkpoints/`` of the first logger
(or a ``ModelCheckpoint``'s own ``dirpath``), and resolves ``last``/``best`` only within the new
run, which is empty. This module reads where the earlier runs of the same config put theirs:

=====================================  ==========================================================
logger (``trainer.logger``, the first)  checkpoint directories searched
=====================================  ==========================================================
``TensorBoardLogger``, ``CSVLogger``    ``<save_dir>/<name>/*/checkpoints`` (``name`` default
and others with ``save_dir``/``name``   ``lightning_logs``)
``WandbLogger`` (online or offline)     ``<save_dir or dir or .>/<project>/<run id>/checkpoints``
``MLFlowLogger`` (local file store)     ``<tracking_uri's path or ./mlruns>/<experiment id>/<run id>/checkpoints``
(another ``tracking_uri``: a server)    ``<default_root_dir>/<experiment id>/<run id>/checkpoints``
none                                    ``<default_root_dir>/checkpoints``
``ModelCheckpoint(dirpath=...)``        that directory
=====================================  ==========================================================

``last`` is the newest ``last*.ckpt`` there; ``best`` is the ``best_model_path`` that the newest
checkpoint's ``ModelCheckpoint`` state records (the one with a ``monitor``, e.g. ``val/accuracy``
with ``mode: max``: ``callbacks/model_checkpoint_best.yaml``). ``logra fit|validate|test`` resolve
them from their parsed config; ``logra export`` and ``logra generate`` from the fit's ``--config``
files (:func:`resolve_ckpt_path`).

Example::

    >>> checkpoint_dirs({"logger": {"class_path": "lightning.pytorch.loggers.WandbLogger",
    ...                             "init_args": {"project": "rl", "save_dir": "wb", "offline": True}}})
    [PosixPath('wb/rl/*/checkpoints')]
    >>> checkpoint_dirs({"logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
    ...                             "init_args": {"save_dir": "runs"}}})
    [PosixPath('runs/lightning_logs/*/checkpoints')]
"""

from __future__ import annotations

import glob
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from logra_lightning.errors import ConfigError


def _first_logger(trainer_cfg: dict[str, Any]) -> Any:
    logger = trainer_cfg.get("logger")
    if isinstance(logger, list):
        logger = logger[0] if logger else None
    return logger


def _explicit_dirpath(trainer_cfg: dict[str, Any]) -> str | None:
    callbacks = trainer_cfg.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    for cb in callbacks:
        if isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("ModelCheckpoint"):
            dirpath = (cb.get("init_args") or {}).get("dirpath")
            if dirpath:
                return str(dirpath)
    return None


def checkpoint_dirs(trainer_cfg: dict[str, Any]) -> list[Path]:
    """Glob patterns of the checkpoint directories of a config's runs (see the table above)."""
    explicit = _explicit_dirpath(trainer_cfg)
    if explicit:
        return [Path(explicit)]
    root = trainer_cfg.get("default_root_dir") or "."
    logger = _first_logger(trainer_cfg)
    if logger in (None, False):
        return [Path(root) / "checkpoints"]
    if logger is True:  # Lightning's default logger: TensorBoard under default_root_dir
        return [Path(root) / "lightning_logs" / "*" / "checkpoints"]
    if not isinstance(logger, dict):
        return []
    kind = str(logger.get("class_path", "")).rsplit(".", 1)[-1]
    args = logger.get("init_args") or {}
    if kind == "WandbLogger":
        return [
            Path(args.get("save_dir") or args.get("dir") or ".")
            / (args.get("project") or "lightning_logs")
            / "*"
            / "checkpoints"
        ]
    if kind == "MLFlowLogger":  # a tracking server or database: Lightning writes under default_root_dir instead
        uri = str(args.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or "")
        uri = uri or f"file:{args.get('save_dir') or './mlruns'}"
        return [Path(uri.removeprefix("file:") if uri.startswith("file:") else root) / "*" / "*" / "checkpoints"]
    name = args.get("name", "lightning_logs")
    return [Path(args.get("save_dir") or root) / (name or "") / "*" / "checkpoints"]


def _checkpoints(dirs: list[Path]) -> list[Path]:
    """Every ``*.ckpt`` in the directories the patterns match, newest first."""
    found = [p for pattern in dirs for folder in glob.glob(str(pattern)) for p in Path(folder).glob("*.ckpt")]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def find_last_checkpoint(dirs: list[Path]) -> Path | None:
    """The newest ``last*.ckpt`` (file or distributed-checkpoint directory) in ``dirs``."""
    return next((p for p in _checkpoints(dirs) if re.fullmatch(r"last(-v\d+)?\.ckpt", p.name)), None)


def best_from_state(checkpoint: dict[str, Any]) -> tuple[str, str, float] | None:
    """``(best_model_path, monitor, score)`` that a checkpoint's ``ModelCheckpoint`` state records, or ``None``."""
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if key.startswith("ModelCheckpoint") and state.get("monitor") and state.get("best_model_path"):
            score = state.get("best_model_score")
            return state["best_model_path"], state["monitor"], float(score) if score is not None else float("nan")
    return None


def find_best_checkpoint(dirs: list[Path]) -> tuple[Path, str, float] | None:
    """The best checkpoint the newest one that knows it records (``best_from_state``), if it still exists."""
    import torch

    for path in _checkpoints(dirs):
        if not path.is_file():
            continue
        best = best_from_state(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
        if best is not None and Path(best[0]).is_file():
            return Path(best[0]), best[1], best[2]
    return None


def resolve_ckpt_keyword(keyword: str, subcommand: str, trainer_cfg: dict[str, Any]) -> tuple[str | None, str]:
    """``(path, message)`` for ``--ckpt_path last|best``; ``path`` is ``None`` where Lightning should see the keyword.

    Raises:
        ConfigError: nothing to evaluate (``validate``/``test``) or no best checkpoint recorded.
    """
    dirs = checkpoint_dirs(trainer_cfg)
    where = ", ".join(str(d) for d in dirs) or "the logger's directory"
    if keyword == "last":
        last = find_last_checkpoint(dirs)
        if last is not None:
            return str(last), f"[logra] --ckpt_path last: {last}"
        if subcommand == "fit":
            return None, ""  # Lightning warns and trains from the start
        raise ConfigError(
            f"--ckpt_path last: no last*.ckpt under {where}; run `logra fit` with this config (and "
            "trainer.enable_checkpointing) first, or give the checkpoint's path"
        )
    best = find_best_checkpoint(dirs)
    if best is None:
        raise ConfigError(
            f"--ckpt_path best: no checkpoint under {where} records a best one (a ModelCheckpoint with a monitor); "
            "add --trainer.callbacks+=model_checkpoint_best to the fit (it keeps the best val/accuracy), or give "
            "the checkpoint's path"
        )
    path, monitor, score = best
    return str(path), f"[logra] --ckpt_path best: {path} ({monitor}={score:.4g})"


def _accepts(class_path: str, names: set[str]) -> set[str]:
    """The ``names`` that ``class_path``'s constructor takes (none if it cannot be imported)."""
    import importlib
    import inspect

    module, _, name = class_path.rpartition(".")
    try:
        params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    except (ImportError, AttributeError, ValueError, TypeError):
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return names
    return names & set(params)


def _merge(old: Any, new: Any) -> Any:
    """``new`` over ``old`` as jsonargparse merges config files: dicts key by key; a ``class_path`` block keeps
    the earlier ``init_args`` that its (possibly new) class still takes."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    if "class_path" in new and "class_path" in old and new["class_path"] != old["class_path"]:
        kept = _accepts(str(new["class_path"]), set(old.get("init_args") or {}))
        old = {**old, "init_args": {k: v for k, v in (old.get("init_args") or {}).items() if k in kept}}
    return {**old, **{k: _merge(old.get(k), v) for k, v in new.items()}}


def trainer_section(configs: Sequence[str]) -> dict[str, Any]:
    """The ``trainer`` section of config files or shipped config names, merged as ``logra fit`` merges them."""
    import yaml

    from logra_lightning.cli.shipped import resolve_config

    section: dict[str, Any] = {}
    for name in configs:
        path = resolve_config(name)
        if not Path(path).expanduser().is_file():
            raise ConfigError(f"--config {name}: no such file (the fit's config: where its runs are)")
        try:
            with open(path, encoding="utf-8") as fh:
                loaded = yaml.safe_load(fh) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"--config {name}: cannot be read ({type(err).__name__}: {err})") from None
        section = _merge(section, loaded.get("trainer") or {} if isinstance(loaded, dict) else {})
    return section


def resolve_ckpt_path(ckpt_path: str, configs: Sequence[str], command: str) -> str:
    """``ckpt_path`` itself, or for ``last``/``best`` the checkpoint the runs of ``configs`` (the fit's) left.

    Raises:
        ConfigError: ``last``/``best`` without ``configs``, or nothing found (:func:`resolve_ckpt_keyword`).
    """
    if ckpt_path not in ("last", "best"):
        return ckpt_path
    if not configs:
        raise ConfigError(
            f"logra {command} --ckpt_path {ckpt_path}: also give the fit's --config (where its runs are), "
            "or the checkpoint's path"
        )
    path, message = resolve_ckpt_keyword(ckpt_path, command, trainer_section(configs))
    print(message, file=sys.stderr, flush=True)
    return str(path)
