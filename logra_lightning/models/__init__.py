"""Building and loading policies: hub and local models, tiny local builds of each family, LoRA, FSDP2 sharding, shapes.

* :mod:`~logra_lightning.models.loading` — :func:`load_policy` / :func:`load_tokenizer` (hub name or local directory);
* :mod:`~logra_lightning.models.tiny` — :func:`build_tiny_model`: tiny random-init models with a character tokenizer;
* :mod:`~logra_lightning.models.architectures` — the families trained and synced into vLLM;
* :mod:`~logra_lightning.models.lora` — :class:`LoRA` (PEFT) adapters in the same RL loop;
* :mod:`~logra_lightning.models.fsdp` — :func:`shard_policy` under FSDP2;
* :mod:`~logra_lightning.models.shapes` — architecture fields of real models, for ``logra plan``.
"""

from logra_lightning.models.loading import hf_config, load_policy, load_tokenizer, parameter_shapes
from logra_lightning.models.lora import LoRA
from logra_lightning.models.tiny import (
    CHARS,
    EOS,
    PAD,
    UNK,
    TinyModelConfig,
    build_char_tokenizer,
    build_tiny_model,
)

__all__ = [
    "CHARS",
    "EOS",
    "PAD",
    "UNK",
    "LoRA",
    "TinyModelConfig",
    "build_char_tokenizer",
    "build_tiny_model",
    "hf_config",
    "load_policy",
    "load_tokenizer",
    "parameter_shapes",
]
