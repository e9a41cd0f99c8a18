"""Resuming a run with a config that no longer fits its checkpoint: caught at start-up, before any model is built.

Two everyday mistakes when resuming with ``--ckpt_path``:

1. **Another optimizer.** A checkpoint written by ``torch.optim.AdamW`` resumed with
   ``LoGRA`` (or the other way round, or LoGRA with another ``rank``) fails deep inside
   ``Optimizer.load_state_dict`` once the model is loaded ("loaded state dict has a different
   number of parameter groups"), or, for a changed rank, with a shape error later.
   :func:`check_resume_optimizer` compares the checkpoint's optimizer param groups with the
   config's optimizer first and names both.
2. **Model settings that the checkpoint replaces.** Lightning's CLI fills ``model.*`` from the
   checkpoint's saved hyperparameters, over what the config or command line said (a resumed run
   is the run that wrote the checkpoint). :func:`replaced_hparams` lists the values that were
   replaced so the CLI can say so instead of training something else silently.

Example::

    >>> groups = [{"rank": 16, "params": [0, 1]}, {"rank": None, "params": [2]}]
    >>> optimizer_summary(groups)
    {'lowrank': True, 'ranks': [16]}
    >>> check_resume_optimizer("last.ckpt", {"lowrank": False, "ranks": []},
    ...                        {"class_path": "torch.optim.AdamW"})
    >>> replaced_hparams({"model": "a", "group_size": 8}, {"model": "b", "group_size": 8})
    [('model', 'a', 'b')]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from logra_lightning.errors import ConfigError


def optimizer_summary(param_groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Whether an optimizer's param groups are LoGRA's low-rank ones, and their ranks."""
    ranks = sorted({g["rank"] for g in param_groups if g.get("rank") is not None})
    return {"lowrank": bool(ranks), "ranks": ranks}


def checkpoint_optimizer(path: str) -> dict[str, Any] | None:
    """:func:`optimizer_summary` of a ``.ckpt`` file's first optimizer (memory-mapped; no tensor is read).

    ``None`` when the file holds no optimizer state (weights-only checkpoints).
    """
    import torch

    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    states = ckpt.get("optimizer_states") or []
    if not states or "param_groups" not in states[0]:
        return None
    return optimizer_summary(states[0]["param_groups"])


def check_resume_optimizer(path: str, saved: Mapping[str, Any] | None, optimizer_cfg: Any) -> None:
    """The config's optimizer must be the kind that wrote the checkpoint's optimizer state.

    Args:
        path: the checkpoint, for the message.
        saved: :func:`checkpoint_optimizer` of it.
        optimizer_cfg: ``model.optimizer`` of the parsed config (``{class_path, init_args}``).

    Raises:
        ConfigError: LoGRA state resumed with a dense optimizer or the reverse, or LoGRA with another rank.
    """
    if saved is None:
        return
    cfg = optimizer_cfg if isinstance(optimizer_cfg, Mapping) else {"class_path": str(optimizer_cfg)}
    name = str(cfg.get("class_path", "")).rsplit(".", 1)[-1] or "torch.optim.AdamW"
    rank = (cfg.get("init_args") or {}).get("rank")
    wants_lowrank = name == "LoGRA" and rank is not None
    fix = (
        "resume with the optimizer settings that wrote it (they are in the run's config.yaml), or start a new run "
        f"from its weights: `logra export --ckpt_path {path} --out DIR`, then --model.model DIR"
    )
    if saved["lowrank"] != wants_lowrank:
        wrote = (
            f"LoGRA (rank {', '.join(map(str, saved['ranks']))})"
            if saved["lowrank"]
            else "a dense optimizer (no low-rank groups)"
        )
        now = f"LoGRA with rank {rank}" if wants_lowrank else f"{name} (dense)"
        raise ConfigError(
            f"--ckpt_path {path}: its optimizer state was written by {wrote}, but model.optimizer is {now}; {fix}"
        )
    if wants_lowrank and saved["ranks"] != [rank]:
        raise ConfigError(
            f"--ckpt_path {path}: its LoGRA state has rank {', '.join(map(str, saved['ranks']))}, but "
            f"model.optimizer.init_args.rank={rank}; {fix}"
        )


def replaced_hparams(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, config value, checkpoint value)`` for every ``model.*`` value the checkpoint replaced."""
    return [(k, before[k], after[k]) for k in sorted(after) if k in before and before[k] != after[k]]
