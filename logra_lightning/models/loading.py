"""Loading a policy and its tokenizer (a hub name or a local Hugging Face directory), and its shapes from its config.

:func:`load_policy` is the code path a user takes with ``Qwen/Qwen2.5-0.5B-Instruct`` or a
local checkpoint, and the one every test takes with the tiny models of
:mod:`~logra_lightning.models.tiny`. Hub names are resolved by ``transformers`` (and so need
the hub or its cache); local directories never touch the network.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerFast

GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(name_or_path: str):
    """Load a tokenizer, honouring a generic class declared by a local directory.

    transformers 5 replaces a declared ``TokenizersBackend`` with the model type's
    own class for some model types (qwen2 among them), which would swap our
    character pre-tokenizer for Qwen2's byte-level one. A local directory that
    declares a generic class is therefore loaded as exactly that.
    """
    cfg_file = Path(name_or_path).expanduser() / "tokenizer_config.json"
    if cfg_file.exists() and json.loads(cfg_file.read_text()).get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(name_or_path)
    return AutoTokenizer.from_pretrained(name_or_path)


def load_policy(name_or_path: str, dtype: torch.dtype = torch.float32):
    """Load a causal LM and its tokenizer from a local directory or a hub name.

    Hub names are resolved by ``transformers`` (and therefore need the hub or its
    cache); local directories never touch the network.

    Raises:
        FileNotFoundError: ``name_or_path`` looks like a local path but does not exist.
    """
    p = Path(name_or_path)
    looks_local = name_or_path.startswith((".", "/", "~")) or p.exists()
    if looks_local and not (p.expanduser() / "config.json").exists():
        raise FileNotFoundError(f"model directory {name_or_path!r} has no config.json")
    tokenizer = load_tokenizer(name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    return model, tokenizer


def hf_config(fields: Mapping[str, Any] | PretrainedConfig) -> PretrainedConfig:
    """A transformers config from ``config.json``-style fields (``model_type`` picks the class)."""
    if isinstance(fields, PretrainedConfig):
        return fields
    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def parameter_shapes(config: Mapping[str, Any] | PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the model's parameters, built on the meta device from its config (no weights, no memory).

    The names are exactly ``named_parameters()``'s for every family transformers knows (fused
    ``qkv_proj`` of Phi-3, 3-D experts of MoE models; a tied ``lm_head`` is not listed).

    Example::

        >>> from logra_lightning.models.tiny import TinyModelConfig
        >>> shapes = parameter_shapes(TinyModelConfig(num_layers=1).hf_config())
        >>> shapes["model.layers.0.self_attn.q_proj.weight"], "lm_head.weight" in shapes
        ((128, 128), True)
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(config))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}
