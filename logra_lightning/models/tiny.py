"""Tiny policies built locally (Qwen2 by default, any family in :mod:`~logra_lightning.models.architectures`).

Nothing here downloads: :func:`build_tiny_model` writes a normal Hugging Face
directory (``config.json``, ``model.safetensors``, ``tokenizer.json``) that both
``transformers`` and vLLM load, so every test and the demo run offline on a model
the project makes itself. :func:`load_policy` is the same code path a user takes
with ``Qwen/Qwen2.5-0.5B-Instruct`` or a local checkpoint.

Example::

    >>> import tempfile
    >>> from logra_lightning.models import TinyModelConfig, build_tiny_model, load_policy
    >>> path = build_tiny_model(tempfile.mkdtemp(), TinyModelConfig(num_layers=1))
    >>> model, tok = load_policy(path)
    >>> tok.decode(tok.encode("12+34="))
    '12+34='
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from logra_lightning.models.architectures import tiny_hf_config

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Printable ASCII covers the arithmetic task and simple user JSONL data.
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


@dataclass
class TinyModelConfig:
    """Sizes of a tiny model of family ``architecture``. Head dim is 64 because vLLM rejects 16."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2
    num_kv_heads: int = 2
    intermediate_size: int = 352
    max_position_embeddings: int = 128
    vocab_size: int = 128  # >= len(char vocab); rounded up for tidy shapes
    tie_word_embeddings: bool = False
    seed: int = 0
    architecture: str = "qwen2"  # a key of logra_lightning.models.architectures.ARCHITECTURES

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
        if self.vocab_size < len(CHARS) + 3:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= {len(CHARS) + 3} (the character vocabulary)")

    def hf_config(self, tokenizer: PreTrainedTokenizerFast | None = None):
        """The transformers config of this model (its family's class); ``tokenizer`` sets the EOS and pad ids."""
        return tiny_hf_config(
            self.architecture,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            eos_token_id=None if tokenizer is None else tokenizer.eos_token_id,
            pad_token_id=None if tokenizer is None else tokenizer.pad_token_id,
        )


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (``tokenizers`` WordLevel over single characters)."""
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")  # (?m): Oniguruma dot-all
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def build_tiny_model(path: str | Path, cfg: TinyModelConfig | None = None) -> str:
    """Create a randomly initialised tiny model (``cfg.architecture``) + char tokenizer at ``path``; return the path."""
    cfg = cfg or TinyModelConfig()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(cfg.hf_config(tokenizer), dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)
