"""Loading a policy and its tokenizer: a hub name, a local Hugging Face directory, or a built-in's cache.

:func:`load_policy` is the code path a user takes with ``Qwen/Qwen2.5-0.5B-Instruct`` or a
local checkpoint, and the one every test takes with the tiny models of
:mod:`~logra_lightning.models.tiny`. Hub names are resolved by ``transformers`` (and so need
the hub or its cache); local directories never touch the network.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

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
