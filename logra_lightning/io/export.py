"""The trained policy as a plain Hugging Face directory that transformers and vLLM load as it is.

``logra export --ckpt_path CKPT --out DIR`` (:mod:`logra_lightning.cli.export`) turns a checkpoint
of ``logra fit`` (a Lightning ``.ckpt`` file, or the distributed-checkpoint directory
``ModelParallelStrategy`` writes under FSDP2) into ``DIR`` with ``model.safetensors``, ``config.json``,
``generation_config.json``, the tokenizer files and ``logra_export.json`` (where it came from). The callback
:class:`~logra_lightning.callbacks.ExportPolicy` (``logra fit --export DIR``) writes the same
directory at the end of fit. Then::

    vllm serve DIR                      # or: vllm.LLM(model="DIR"), AutoModelForCausalLM.from_pretrained("DIR")

How the checkpoint becomes a model:

1. The base model is the checkpoint's ``hyper_parameters["model"]`` (what ``PolicyGradientModule``
   was built with: a hub id, a local directory or ``builtin:<name>``; ``--base_model`` overrides
   it). Only its config, generation config and tokenizer are used; the weights are the
   checkpoint's ``policy.*`` tensors. A built-in model's config and tokenizer are rebuilt
   locally (no warm-up, no download).
2. A distributed checkpoint is read in this one process with
   ``torch.distributed.checkpoint`` (only the ``state_dict`` entries, no optimizer state, no
   process group); a ``.ckpt`` file with ``torch.load(mmap=True, weights_only=True)``.
3. A LoRA run (``hyper_parameters["adapter"]``, :mod:`logra_lightning.models.lora`) is merged:
   ``W = W0 + (alpha / r) * B @ A`` under the base model's names.
4. The directory is written next to ``DIR`` and renamed into place, so a failed export leaves a
   previous one intact. ``DIR`` must be new, empty, or an earlier export (it is replaced);
   any other non-empty directory is refused rather than overwritten.

Known limit: the built-in models' character tokenizer is declared as a generic
``TokenizersBackend``; transformers 5's ``AutoTokenizer`` (and so ``vllm serve``) loads a qwen2
model's tokenizer as ``Qwen2Tokenizer``, which gives the same ids for every printable character
except space and newline. Arithmetic prompts have neither; real models (Qwen2.5) are unaffected.

Example::

    >>> export_checkpoint("runs/logra/version_0/checkpoints/last.ckpt", "runs/policy")  # doctest: +SKIP
    PosixPath('runs/policy')
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from logra_lightning.errors import CheckpointError, ConfigError
from logra_lightning.io.checkpoint import check_checkpoint_path, is_distributed_checkpoint
from logra_lightning.models.lora import LoRA

MARKER = "logra_export.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PREFIX = "policy."  # PolicyGradientModule keeps the HF model as self.policy


# ------------------------------------------------------------------ reading
def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The policy's weights (HF names) and the module's hyperparameters from a ``logra fit`` checkpoint.

    Raises:
        ConfigError: the path is missing or damaged (:func:`~logra_lightning.io.checkpoint.check_checkpoint_path`),
            or it holds no ``policy.*`` weights.
    """
    check_checkpoint_path(path)
    p = Path(path).expanduser()
    try:
        if is_distributed_checkpoint(p):
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

            with warnings.catch_warnings():  # "no process group: loading into this process" is what we want
                warnings.simplefilter("ignore")
                state = _load_state_dict_from_keys({"state_dict"}, checkpoint_id=str(p)).get("state_dict", {})
            meta = torch.load(p / "meta.pt", map_location="cpu", weights_only=True) if (p / "meta.pt").is_file() else {}
        else:
            meta = torch.load(p, map_location="cpu", mmap=True, weights_only=True)
            state = meta.get("state_dict", {}) if isinstance(meta, dict) else {}
    except Exception as err:  # noqa: BLE001 - torch.load / DCP raise many types on damaged input
        raise ConfigError(
            f"--ckpt_path {path}: cannot be read ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
        ) from None
    weights = {k[len(_PREFIX) :]: v for k, v in state.items() if k.startswith(_PREFIX) and isinstance(v, torch.Tensor)}
    if not weights:
        raise ConfigError(
            f"--ckpt_path {path}: holds no policy weights (no 'policy.*' entries in its state_dict); "
            "is it a checkpoint of `logra fit`?"
        )
    hparams = dict(meta.get("hyper_parameters") or {}) if isinstance(meta, dict) else {}
    hparams["global_step"] = meta.get("global_step") if isinstance(meta, dict) else None
    return weights, hparams


# ------------------------------------------------------------- base model
def base_model_dir(spec: str, workdir: str | os.PathLike) -> str:
    """A directory or hub id with the base model's ``config.json`` and tokenizer (weights unused).

    ``builtin:<name>`` is rebuilt in ``workdir`` (random weights, same config and tokenizer as the
    warmed-up model); anything else is checked with :func:`~logra_lightning.config.model_spec.check_model_spec`.
    """
    from logra_lightning.builtin.registry import BUILTIN_MODELS, BUILTIN_PREFIX
    from logra_lightning.config.model_spec import check_model_spec

    check_model_spec(spec, key="base model")
    if spec.startswith(BUILTIN_PREFIX):
        from logra_lightning.models import build_tiny_model

        builtin = BUILTIN_MODELS[spec[len(BUILTIN_PREFIX) :]]
        if hasattr(builtin, "build"):  # the reasoning policy: its own BPE tokenizer (logra_lightning.builtin.reasoning)
            return builtin.build(Path(workdir) / "base")
        return build_tiny_model(Path(workdir) / "base", builtin.model)
    return spec


def build_model(config, weights: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None):
    """A causal LM of ``config`` holding ``weights`` (no random init: built on the meta device).

    Raises:
        ConfigError: the weights do not fit the architecture (missing, unexpected or misshapen tensors).
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    weights = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in weights.items()}
    expected = dict(model.state_dict())
    tied = set()
    if getattr(
        config.get_text_config() if hasattr(config, "get_text_config") else config, "tie_word_embeddings", False
    ):
        tied = {k for k in expected if k.startswith("lm_head.")}
    missing = sorted(k for k in expected if k not in weights and k not in tied)
    unexpected = sorted(k for k in weights if k not in expected)
    wrong = sorted(k for k in weights if k in expected and tuple(weights[k].shape) != tuple(expected[k].shape))
    if missing or unexpected or wrong:
        parts = [
            f"{len(missing)} missing (e.g. {missing[0]})" if missing else "",
            f"{len(unexpected)} unexpected (e.g. {unexpected[0]})" if unexpected else "",
            f"{len(wrong)} of another shape (e.g. {wrong[0]} {list(weights[wrong[0]].shape)} vs "
            f"{list(expected[wrong[0]].shape)})"
            if wrong
            else "",
        ]
        raise ConfigError(
            f"the checkpoint's weights do not fit the base model ({'; '.join(p for p in parts if p)}); "
            "pass --base_model with the model it was trained from"
        )
    model.load_state_dict({k: v for k, v in weights.items() if k in expected}, strict=False, assign=True)
    if tied:
        model.tie_weights()
    return model.eval()


# ------------------------------------------------------------------ writing
def check_export_dir(out: str | os.PathLike, key: str = "--out") -> None:
    """``out`` must be creatable, empty, or an earlier export (see the module doc).

    Raises:
        ConfigError: a file in the way, no permission, or a non-empty directory that is not an export.
    """
    from logra_lightning.config.checks import check_writable_dir

    check_writable_dir(out, key, "export directory")
    p = Path(out).expanduser()
    if p.is_dir() and any(p.iterdir()) and not (p / MARKER).is_file():
        raise ConfigError(
            f"{key}={str(out)!r}: the directory holds other files ({', '.join(sorted(x.name for x in p.iterdir())[:4])}"
            "), which an export would replace; choose a new or empty directory (an earlier logra export "
            "there is replaced)"
        )


def save_export(model, tokenizer, out: str | os.PathLike, provenance: Mapping[str, Any]) -> Path:
    """Write ``model`` (safetensors), its config and generation config, ``tokenizer``, ``logra_export.json`` to ``out``.

    Written into a temporary directory next to ``out`` and renamed into place.

    Raises:
        ConfigError: ``out`` is not a usable export directory (:func:`check_export_dir`).
        CheckpointError: writing failed; an earlier export at ``out`` is intact.
    """
    check_export_dir(out)
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp"))
    try:
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(dict(provenance), indent=2, default=str) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = "the earlier export there is intact" if out.exists() else "nothing was written there"
        raise CheckpointError(f"exporting the policy to {out} failed ({type(err).__name__}: {err}); {kept}") from err
    return out


def export_checkpoint(
    ckpt_path: str | os.PathLike, out: str | os.PathLike, base_model: str | None = None, dtype: str | None = None
) -> Path:
    """``logra export``: read ``ckpt_path``, rebuild the base model with its weights, write ``out``.

    Args:
        ckpt_path: a ``.ckpt`` file or a distributed-checkpoint directory of ``logra fit``.
        out: the directory to write (new, empty, or an earlier export).
        base_model: the model the run started from; default: the checkpoint's ``hyper_parameters["model"]``.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``; default: as trained.

    Raises:
        ConfigError: a bad path or option, or weights that do not fit the base model.
        CheckpointError: writing ``out`` failed.
    """
    from transformers import AutoConfig, GenerationConfig

    from logra_lightning.models import load_tokenizer

    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype={dtype!r}: allowed {', '.join(DTYPES)} (or leave it out: as trained)")
    check_export_dir(out)
    weights, hparams = read_checkpoint(ckpt_path)
    adapter = LoRA.from_hparams(hparams.get("adapter"))
    if adapter is not None:  # a LoRA run: merge the factors into the base weights (a plain model)
        weights = adapter.merged_state_dict(weights)
    spec = base_model or hparams.get("model")
    if not spec:
        raise ConfigError(f"--ckpt_path {ckpt_path}: its hyper_parameters name no base model; pass --base_model")
    with tempfile.TemporaryDirectory() as work:
        base = base_model_dir(str(spec), work)
        config = AutoConfig.from_pretrained(base)
        model = build_model(config, weights, DTYPES.get(dtype or ""))
        try:
            model.generation_config = GenerationConfig.from_pretrained(base)
        except OSError:  # the base has none: the one derived from config.json stays
            pass
        tokenizer = load_tokenizer(base)
        provenance = {
            "base_model": str(spec),
            "checkpoint": str(ckpt_path),
            "global_step": hparams.get("global_step"),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        }
        return save_export(model, tokenizer, out, provenance)
