"""Is ``model.model`` something we can load? Checked at start-up, before anything is loaded or downloaded.

A model spec is one of three things, and each fails with one line that names it and says what to do:

* ``builtin:<name>`` — a built-in tiny policy (:data:`~logra_lightning.builtin.registry.BUILTIN_MODELS`);
* a local directory — it must hold a Hugging Face model: ``config.json`` with a ``model_type``
  transformers knows, weights (``model.safetensors`` / ``*.safetensors.index.json`` /
  ``pytorch_model.bin``, whose headers and shards are checked, not read) and tokenizer files;
* a hub id (``Qwen/Qwen2.5-0.5B-Instruct``) — a complete copy in the local Hugging Face cache is
  used as it is. Without one, under ``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``) the
  check fails at once, naming ``hf download`` to pre-fetch it; otherwise it asks the hub
  whether the repository exists (metadata only, no files downloaded) and fails, naming the
  same fixes, when the hub cannot be reached.

What the check does not do: load weights, or download anything. A spec that passes can still
fail to load (e.g. a corrupt tensor inside a well-formed file); that fails in ``setup``.

Example::

    >>> check_model_spec("/no/such/dir")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    logra_lightning.errors.ConfigError: model.model='/no/such/dir': no such directory...
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from logra_lightning.errors import ConfigError

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_POINT_AT = (
    "point it to a local Hugging Face model directory (config.json, weights, tokenizer), a hub id such as "
    "Qwen/Qwen2.5-0.5B-Instruct, or builtin:arithmetic-tiny"
)


def _fail(key: str, model: str, what: str) -> ConfigError:
    return ConfigError(f"{key}={model!r}: {what}")


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` is set (read now, not at import)."""
    on = {"1", "true", "yes", "on"}
    return any(os.environ.get(v, "").strip().lower() in on for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def looks_local(model: str) -> bool:
    """A spec is a local path when it exists, starts with ``.``/``/``/``~``, or is not a valid hub id."""
    return Path(model).expanduser().exists() or model.startswith((".", "/", "~")) or not _HUB_ID.match(model)


def check_model_spec(model: object, key: str = "model.model") -> None:
    """Fail with one line unless ``model`` is a known built-in, a model directory or a reachable hub id.

    Raises:
        ConfigError: naming ``key``, the spec, what is wrong and how to fix it.
    """
    from logra_lightning.builtin.registry import BUILTIN_MODELS, BUILTIN_PREFIX

    if not isinstance(model, str) or not model.strip():
        raise _fail(key, model, f"expected a model name or path; {_POINT_AT}")  # type: ignore[arg-type]
    if model.startswith(BUILTIN_PREFIX):
        if model[len(BUILTIN_PREFIX) :] not in BUILTIN_MODELS:
            raise _fail(key, model, f"unknown built-in model; choose one of {sorted(BUILTIN_MODELS)}")
        return
    if looks_local(model):
        check_model_dir(Path(model).expanduser(), model, key)
    else:
        check_hub_model(model, key)


def check_model_dir(path: Path, model: str, key: str = "model.model") -> None:
    """``path`` must be a directory holding a loadable Hugging Face causal LM (see the module doc)."""
    if not path.exists():
        near = f" ({path.parent} exists and holds: {_listing(path.parent)})" if path.parent.is_dir() else ""
        raise _fail(key, model, f"no such directory{near}; {_POINT_AT}")
    if not path.is_dir():
        raise _fail(key, model, "is a file, not a directory; point it to the directory that holds config.json")
    if not os.access(path, os.R_OK | os.X_OK):
        raise _fail(key, model, "the directory is not readable (permissions); fix them with chmod or copy the model")
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        raise _fail(
            key,
            model,
            "the directory is empty (an interrupted download?); fetch the model into it, e.g. "
            f"`hf download <hub id> --local-dir {model}`, or {_POINT_AT}",
        )
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        hint = _hint_for_non_model(path)
        raise _fail(
            key, model, f"no config.json, so not a Hugging Face model directory (it holds: {_listing(path)}); {hint}"
        )
    cfg = _read_config(cfg_file, model, key)
    _check_model_type(cfg, model, key)
    _check_weights(path, model, key)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise _fail(
            key,
            model,
            f"no tokenizer files (one of {list(TOKENIZER_FILES)}); copy the tokenizer of the base model "
            "into the directory (tokenizer.save_pretrained(dir))",
        )


def _listing(path: Path, limit: int = 6) -> str:
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    except OSError:
        return "?"
    return ", ".join(names[:limit]) + (f", ... ({len(names)} entries)" if len(names) > limit else "") or "nothing"


def _hint_for_non_model(path: Path) -> str:
    inner = sorted(p.parent for p in path.glob("*/config.json"))
    if inner:
        return f"did you mean {str(inner[0])!r}?"
    if list(path.glob("**/checkpoints/*.ckpt"))[:1] or list(path.glob("*.ckpt"))[:1]:
        return (
            "this looks like a training run; export its checkpoint first: "
            "logra export --ckpt_path <run>/checkpoints/last.ckpt --out <dir>, then use <dir>"
        )
    return _POINT_AT


def _read_config(cfg_file: Path, model: str, key: str) -> dict:
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f":{err.lineno}" if isinstance(err, json.JSONDecodeError) else ""
        raise _fail(
            key, model, f"{cfg_file}{where} is not valid JSON ({err}); re-download or re-export the model"
        ) from None
    except OSError as err:
        raise _fail(key, model, f"{cfg_file} cannot be read ({err.strerror})") from None
    if not isinstance(cfg, dict):
        raise _fail(key, model, f"{cfg_file} holds a JSON {type(cfg).__name__}, not a model config object")
    return cfg


def _check_model_type(cfg: dict, model: str, key: str) -> None:
    model_type = cfg.get("model_type")
    if not model_type:
        raise _fail(key, model, "config.json has no 'model_type', so transformers cannot tell which model it is")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        import transformers

        raise _fail(
            key,
            model,
            f"model_type {model_type!r} in config.json is not known to transformers "
            f"{transformers.__version__} (and custom model code is not run); upgrade transformers "
            "or use a supported model",
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise _fail(
            key,
            model,
            f"model_type {model_type!r} is not a causal language model (AutoModelForCausalLM "
            "cannot load it); RL post-training needs a decoder such as Qwen2 or Llama",
        )


def _check_weights(path: Path, model: str, key: str) -> None:
    present = [f for f in WEIGHT_FILES if (path / f).is_file()]
    if not present:
        raise _fail(
            key,
            model,
            f"no weights (one of {list(WEIGHT_FILES)}); an interrupted download or save? "
            "Fetch or export the model into the directory again",
        )
    name = present[0]
    if name.endswith(".index.json"):
        try:
            shards = set(json.loads((path / name).read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise _fail(key, model, f"{name} is not a valid weight index ({type(err).__name__}: {err})") from None
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise _fail(
                key,
                model,
                f"{name} lists {len(shards)} weight shards, {len(missing)} missing "
                f"({', '.join(missing[:3])}); the download is incomplete",
            )
        files = sorted(shards)
    else:
        files = [name]
    for f in files:
        if f.endswith(".safetensors"):
            check_safetensors(path / f, model, key)


def check_safetensors(file: Path, model: str, key: str = "model.model") -> None:
    """Read the header of a safetensors file (not its tensors): a truncated or foreign file fails here."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as fh:
            fh.keys()
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        size = file.stat().st_size if file.exists() else 0
        raise _fail(
            key,
            model,
            f"{file.name} ({size} bytes) is not a readable safetensors file ({err}); truncated "
            "download or copy? Fetch or export the model again",
        ) from None


def _prefetch_hint(repo: str) -> str:
    return (
        f"Pre-fetch it where the hub is reachable with `hf download {repo}` (older huggingface_hub: "
        f"`huggingface-cli download {repo}`) into the cache, then run with HF_HUB_OFFLINE=1; or download it "
        f"with `--local-dir DIR` and set model.model=DIR"
    )


def hub_snapshot(repo: str) -> Path | None:
    """The local cache's snapshot directory of ``repo`` if its ``config.json`` is cached, else ``None``."""
    from huggingface_hub import try_to_load_from_cache

    try:
        hit = try_to_load_from_cache(repo, "config.json")
    except Exception:  # noqa: BLE001 - an invalid repo id: no cache entry
        return None
    return Path(hit).parent if isinstance(hit, str) else None


def check_hub_model(repo: str, key: str = "model.model") -> None:
    """A hub id must be complete in the local cache, or (online) exist on the hub; nothing is downloaded."""
    from huggingface_hub import constants

    snapshot = hub_snapshot(repo)
    if snapshot is not None:
        try:
            check_model_dir(snapshot, repo, key)
            return
        except ConfigError:
            if hub_offline():
                raise _fail(
                    key,
                    repo,
                    f"the local Hugging Face cache ({constants.HF_HUB_CACHE}) holds only part of "
                    f"this model and HF_HUB_OFFLINE is set, so the rest cannot be downloaded; "
                    f"{_prefetch_hint(repo)}",
                ) from None
            return  # online: transformers fetches the missing files
    if hub_offline():
        raise _fail(
            key,
            repo,
            f"not a local directory, and not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"HF_HUB_OFFLINE is set, so it cannot be downloaded. {_prefetch_hint(repo)}",
        )
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(repo, timeout=10)
    except GatedRepoError:
        raise _fail(
            key,
            repo,
            "a gated hub model: accept its licence on huggingface.co and log in "
            "(`hf auth login`), or point it to a local directory",
        ) from None
    except RepositoryNotFoundError:
        raise _fail(
            key,
            repo,
            "no such model on the Hugging Face Hub and no local directory of that name (check the "
            "spelling; for a private model log in with `hf auth login`)",
        ) from None
    except Exception as err:  # noqa: BLE001 - connection refused, DNS, timeout, proxy: the hub is unreachable
        why = " ".join(f"{type(err).__name__}: {err}".split())[:160]
        raise _fail(
            key,
            repo,
            f"not a local directory, not in the local Hugging Face cache ({constants.HF_HUB_CACHE}), "
            f"and the hub cannot be reached ({why}). {_prefetch_hint(repo)}",
        ) from None


def model_config(model: str) -> dict | None:
    """Architecture fields (``config.json``'s) of ``model`` without loading weights; ``None`` when unreadable offline.

    ``builtin:<name>`` comes from the built-in's own spec (``hf_config()``); a local directory from
    its ``config.json``; a hub name from the local Hugging Face cache only. A multimodal config's
    ``text_config`` is returned for the text decoder.
    """
    from logra_lightning.builtin.registry import BUILTIN_MODELS, BUILTIN_PREFIX

    if model.startswith(BUILTIN_PREFIX):
        spec = BUILTIN_MODELS.get(model[len(BUILTIN_PREFIX) :])
        if spec is None:
            raise ConfigError(f"model.model={model!r}: unknown built-in model; choose one of {sorted(BUILTIN_MODELS)}")
        return spec.hf_config().to_dict()
    path = Path(model).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"model.model={model!r}: the directory has no config.json (not a Hugging Face model)")
        try:
            cfg = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"model.model={model!r}: {cfg_file} is not valid JSON ({err})") from None
    elif "/" in model and not model.startswith((".", "/", "~")):
        try:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(model, local_files_only=True).to_dict()
        except Exception:  # noqa: BLE001 - not cached (offline) or not a model: LoGRA checks at build time
            return None
    else:
        return None
    if not isinstance(cfg, dict):
        return None
    return cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
