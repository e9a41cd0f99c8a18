"""The architectures logra_lightning trains and syncs into vLLM, and tiny local builds of each.

Every family below has been run end to end here (``tests/test_architectures.py``,
``benchmarks/architectures.py``): a tiny random-init model built by
:func:`tiny_hf_config`, LoGRA steps, low-rank syncs into a vLLM engine, and the
engine's log-probabilities compared with the trainer's. The name mapping between
the trainer and vLLM comes from the libraries themselves (transformers' checkpoint
conversion, vLLM's ``load_weights``), not from a table here; this table only says
how to *build* a tiny model of each family and what is known about it.

Example::

    >>> sorted(ARCHITECTURES)
    ['gemma3', 'llama', 'mistral', 'phi3', 'qwen2', 'qwen3', 'qwen3_moe']
    >>> ARCHITECTURES["phi3"].hf_class
    'Phi3ForCausalLM'
    >>> untested_warning("Qwen3MoeForCausalLM") is None
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from logra_lightning.errors import ConfigError


@dataclass(frozen=True)
class Architecture:
    """One model family: its HF class, how to make a tiny config, and what is special about it."""

    hf_class: str  # config.architectures[0], also vLLM's model class name
    make_config: Callable[[dict[str, Any]], Any]  # common kwargs -> transformers config
    notes: str = ""


def _llama(kw):
    from transformers import LlamaConfig

    return LlamaConfig(**kw)


def _qwen2(kw):
    from transformers import Qwen2Config

    return Qwen2Config(**kw)


def _qwen3(kw):
    from transformers import Qwen3Config

    return Qwen3Config(**kw)


def _mistral(kw):
    from transformers import MistralConfig

    return MistralConfig(sliding_window=None, **kw)


def _gemma3(kw):
    from transformers import Gemma3TextConfig

    kw = dict(kw, query_pre_attn_scalar=kw["head_dim"], sliding_window=32)
    cfg = Gemma3TextConfig(**kw)
    cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


def _phi3(kw):
    from transformers import Phi3Config

    kw = {k: v for k, v in kw.items() if k != "head_dim"}  # Phi-3 derives it from hidden / heads
    return Phi3Config(**kw, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)


def _qwen3_moe(kw):
    from transformers import Qwen3MoeConfig

    # vLLM's CPU MoE kernel pads the expert intermediate size to its alignment, and its
    # reload_weights then fails copying into the padded kernel: keep it a multiple of 64.
    inter = kw.pop("intermediate_size")
    return Qwen3MoeConfig(
        **kw,
        moe_intermediate_size=max(64, inter // 2 // 64 * 64),
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("LlamaForCausalLM", _llama),
    "qwen2": Architecture("Qwen2ForCausalLM", _qwen2, "q/k/v biases"),
    "qwen3": Architecture("Qwen3ForCausalLM", _qwen3, "per-head q/k RMSNorm"),
    "mistral": Architecture("MistralForCausalLM", _mistral),
    "gemma3": Architecture(
        "Gemma3ForCausalLM",
        _gemma3,
        "text-only; embeddings scaled by sqrt(hidden), (1 + w) norms, sliding-window layers, tied head",
    ),
    "phi3": Architecture("Phi3ForCausalLM", _phi3, "HF already fuses qkv_proj and gate_up_proj"),
    "qwen3_moe": Architecture(
        "Qwen3MoeForCausalLM",
        _qwen3_moe,
        "experts are 3-D params in transformers (gate_up_proj [E, 2I, H], down_proj [E, H, I]); "
        "vLLM fuses them again into w13/w2",
    ),
}

SUPPORTED_CLASSES = {a.hf_class: name for name, a in ARCHITECTURES.items()}


def untested_warning(hf_class: str | None) -> str | None:
    """A warning for an HF class not in :data:`ARCHITECTURES`, or ``None`` for a tested one.

    Untested is not refused: the engine still checks at start-up that vLLM loads every
    trainer parameter (and refuses if not), which is what keeps a sync from being silently wrong.
    """
    if hf_class in SUPPORTED_CLASSES:
        return None
    return (
        f"architecture {hf_class!r} has not been tested with low-rank sync into vLLM (tested: "
        f"{', '.join(sorted(SUPPORTED_CLASSES))}); check engine-vs-trainer drift "
        "(sync/logprob_abs_diff_max) on a first run"
    )


def tiny_hf_config(
    architecture: str,
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    eos_token_id: int,
    pad_token_id: int,
):
    """A transformers config of family ``architecture`` with these sizes (fp32, head dim ``hidden / heads``)."""
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"architecture={architecture!r}: choose one of {sorted(ARCHITECTURES)}")
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_token_id,
        bos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        rope_theta=10000.0,
    )
    cfg = ARCHITECTURES[architecture].make_config(kw)
    cfg.architectures = [ARCHITECTURES[architecture].hf_class]
    cfg.dtype = "float32"
    return cfg
