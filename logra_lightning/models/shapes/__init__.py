"""Architecture shapes for ``logra plan``: the fields of a decoder-only transformer that decide its memory.

The JSON files beside this module are architecture fields only (a few KB, no weights), so
``logra plan --model gemma-3-27b`` answers offline:

* ``qwen2.5-0.5b``: Qwen/Qwen2.5-0.5B (494M params, tied embeddings);
* ``qwen2.5-7b``: Qwen/Qwen2.5-7B (7.62B, untied lm_head);
* ``gemma-3-27b``: the text decoder of google/gemma-3-27b-it (27.0B; its ~0.4B vision tower
  is not part of the shape), the likely "27B" of the LoGRA paper;
* ``llama-3-8b``: meta-llama/Meta-Llama-3-8B (8.03B, untied);
* ``qwen3-8b``: Qwen/Qwen3-8B (8.19B, untied, q/k norms);
* ``mistral-7b``: mistralai/Mistral-7B-v0.3 (7.25B, untied, no sliding window);
* ``phi-3-mini``: microsoft/Phi-3-mini-4k-instruct (3.82B, fused ``qkv_proj`` / ``gate_up_proj``);
* ``qwen3-30b-a3b``: Qwen/Qwen3-30B-A3B (30.5B in all, ~3.3B active: 128 experts, 8 per token).

Supported ``model_type``: ``qwen2``, ``qwen3``, ``llama``, ``mistral``, ``gemma3_text`` (or a
``gemma3`` wrapper's ``text_config``), ``phi3`` and ``qwen3_moe``. Mixture-of-experts layers
(``qwen3_moe``) hold transformers 5's fused experts: ``mlp.experts.gate_up_proj``
``[E, 2 I_moe, h]`` and ``mlp.experts.down_proj`` ``[E, h, I_moe]``, each one low-rank
``[E * m, n]`` :class:`Matrix` with ``expert=True`` (LoGRA sketches it on the right, as
``optim/logra.py`` does), and a router ``mlp.gate.weight`` ``[E, h]`` that is not an
``nn.Linear`` and stays dense (one of :meth:`Architecture.vectors`). Refused rather than
mis-counted: dense layers mixed into a MoE stack (``decoder_sparse_step != 1``,
``mlp_only_layers``) and shared experts (``qwen2_moe``).

:func:`load_architecture` also reads a local HF directory or ``config.json``, or a hub
``org/name`` through ``transformers.AutoConfig`` when the hub is reachable. Parameter counts
are tested against the real HF models in ``tests/test_plan.py``.

Example::

    >>> arch = load_architecture("qwen2.5-7b")
    >>> round(arch.num_params() / 1e9, 2), arch.num_kv_heads
    (7.62, 4)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from logra_lightning.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "gemma3_text", "phi3", "qwen3_moe")
_QWEN_WINDOWS = ("qwen2", "qwen3", "qwen3_moe")  # sliding window only with use_sliding_window
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Fields that look like they change the shape but that this model does not know: refuse rather
# than under-count (mixture-of-experts, latent attention, linear attention, ...).
_SHAPE_LIKE = re.compile(r"^num_|^n_|_size$|_dim$|_rank$|expert|_layers$")
_KNOWN_FIELDS = frozenset(
    {
        *_REQUIRED,
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "sliding_window_pattern",
        "_sliding_window_pattern",
        "max_position_embeddings",
        "chunk_size_feed_forward",
        "query_pre_attn_scalar",
    }
)
# Shape fields one family adds (elsewhere they still mean "not modelled": a qwen2 with num_experts is refused).
_FAMILY_FIELDS = {
    "phi3": frozenset({"original_max_position_embeddings"}),
    "qwen3_moe": frozenset(
        {
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "decoder_sparse_step",
            "mlp_only_layers",
        }
    ),
}


class ShapeError(ConfigError):
    """A model config is missing a field, has a bad value, or a shape this planner does not model."""


@dataclass(frozen=True)
class Matrix:
    """``count`` weight matrices ``[rows, cols]`` (out x in), in the FSDP2 ``unit`` "root" or "layer".

    ``expert``: a 3-D fused-expert weight ``[E, m, n]``, seen as one ``[E * m, n]`` matrix
    (``rows = E * m``); like an embedding it always gets LoGRA's right sketch.
    """

    name: str
    rows: int
    cols: int
    count: int
    unit: str
    embedding: bool = False
    expert: bool = False


@dataclass(frozen=True)
class Architecture:
    """The shape fields of a decoder-only transformer that decide its memory."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    post_norms: bool  # Gemma: RMSNorm also after attention and after the MLP (4 per layer)
    gemma_norm: bool  # Gemma's RMSNorm keeps its normalized input in fp32 for ``(1 + w)``
    layer_windows: tuple[int | None, ...]  # None: full attention; else the sliding window
    fused_projections: bool = False  # Phi-3: one qkv_proj and one gate_up_proj per layer
    num_experts: int = 0  # > 0: every decoder layer's MLP is a mixture of experts (qwen3_moe)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def active_intermediate_size(self) -> int:
        """MLP width one token passes through: ``intermediate_size``, or ``k * moe_intermediate_size`` under MoE.

        The activation formulas in :mod:`logra_lightning.plan.memory` use it in place of the dense
        ``intermediate_size``. For MoE layers this is an approximation (every token's ``k``
        experts as one MLP of ``k`` times the width): what the experts implementation saves for
        the routing (gathered inputs, expert outputs, router probabilities) is added separately
        there (departure 6 of :mod:`logra_lightning.plan.memory`).
        """
        return self.num_experts_per_tok * self.moe_intermediate_size if self.num_experts else self.intermediate_size

    def matrices(self) -> list[Matrix]:
        h, i, q, kv, layers = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim, self.num_layers
        out = [Matrix("model.embed_tokens.weight", self.vocab_size, h, 1, "root", embedding=True)]
        if not self.tie_word_embeddings:
            out.append(Matrix("lm_head.weight", self.vocab_size, h, 1, "root"))
        if self.fused_projections:
            attn = [("self_attn.qkv_proj", q + 2 * kv, h), ("self_attn.o_proj", h, q)]
        else:
            attn = [
                ("self_attn.q_proj", q, h),
                ("self_attn.k_proj", kv, h),
                ("self_attn.v_proj", kv, h),
                ("self_attn.o_proj", h, q),
            ]
        for name, rows, cols in attn:
            out.append(Matrix(f"model.layers.*.{name}.weight", rows, cols, layers, "layer"))
        if self.num_experts:  # [E, 2 I_moe, h] and [E, h, I_moe] as [E * m, n]; no ".weight" suffix in HF
            e, mi = self.num_experts, self.moe_intermediate_size
            out.append(Matrix("model.layers.*.mlp.experts.gate_up_proj", e * 2 * mi, h, layers, "layer", expert=True))
            out.append(Matrix("model.layers.*.mlp.experts.down_proj", e * h, mi, layers, "layer", expert=True))
            return out
        if self.fused_projections:
            mlp = [("mlp.gate_up_proj", 2 * i, h)]
        else:
            mlp = [("mlp.gate_proj", i, h), ("mlp.up_proj", i, h)]
        for name, rows, cols in (*mlp, ("mlp.down_proj", h, i)):
            out.append(Matrix(f"model.layers.*.{name}.weight", rows, cols, layers, "layer"))
        return out

    def vectors(self) -> list[tuple[str, int, int, str]]:
        """Dense params as ``(name, size, count, unit)``: biases, norm weights, MoE routers (dense AdamW in LoGRA).

        A router ``[E, h]`` is listed with ``size = E * h``: under FSDP2 the planner shards it as
        ``ceil(E * h / N)`` elements, exact when ``N`` divides ``E``.
        """
        h, i, q, kv, layers = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim, self.num_layers
        sizes = [("norm", h)] * (4 if self.post_norms else 2)
        if self.num_experts:
            sizes.append(("mlp.gate.weight", self.num_experts * h))
        if self.qkv_bias:
            sizes += [("q_proj.bias", q), ("k_proj.bias", kv), ("v_proj.bias", kv)]
        if self.o_bias:
            sizes.append(("o_proj.bias", h))
        if self.mlp_bias:
            sizes += [("gate_proj.bias", i), ("up_proj.bias", i), ("down_proj.bias", h)]
        if self.qk_norm:
            sizes += [("q_norm", self.head_dim), ("k_norm", self.head_dim)]
        out = [(f"model.layers.*.{n}", s, layers, "layer") for n, s in sizes]
        return out + [("model.norm.weight", h, 1, "root")]

    def num_params(self) -> int:
        return sum(m.rows * m.cols * m.count for m in self.matrices()) + sum(s * c for _, s, c, _ in self.vectors())

    def unit_params(self, unit: str) -> int:
        """Elements of one FSDP2 unit: the root (embeddings, lm_head, final norm) or one decoder layer."""
        per = sum(m.rows * m.cols for m in self.matrices() if m.unit == unit)
        return per + sum(s for _, s, _, u in self.vectors() if u == unit)

    def min_matrix_dim(self) -> tuple[int, Matrix]:
        m = min(self.matrices(), key=lambda x: min(x.rows, x.cols))
        return min(m.rows, m.cols), m


def _int_field(cfg: dict, key: str, default: Any = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ShapeError(f"config field {key!r} is missing (needed to size the model)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ShapeError(f"config field {key}={value!r} must be a positive integer")
    return value


def _layer_windows(cfg: dict, model_type: str, layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if model_type in _QWEN_WINDOWS and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return (None,) * layers
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != layers:
            raise ShapeError(f"config field layer_types has {len(types)} entries, num_hidden_layers={layers}")
        return tuple(window if t == "sliding_attention" else None for t in types)
    if model_type == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(layers))
    if model_type in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", layers)
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers


def architecture_from_config(cfg: dict, name: str = "config") -> Architecture:
    """Parse an HF ``config.json`` dict (architecture fields only are read).

    Raises:
        ShapeError: missing ``model_type`` or a required field, a non-positive size, an
            unsupported ``model_type``, a shape field this planner does not model (e.g. ``num_experts``
            outside ``qwen3_moe``), or a MoE layout with dense layers (``decoder_sparse_step``,
            ``mlp_only_layers``).
    """
    if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrapper: plan the text decoder
        cfg = {"model_type": cfg.get("model_type", "") + "_text", **cfg["text_config"]}
    model_type = cfg.get("model_type")
    if model_type is None:
        raise ShapeError(f"config field 'model_type' is missing (allowed: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = " (its shared experts are not modelled)" if model_type == "qwen2_moe" else ""
        raise ShapeError(
            f"config field model_type={model_type!r} is not supported{why} "
            f"(allowed: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    known = _KNOWN_FIELDS | _FAMILY_FIELDS.get(model_type, frozenset())
    for key, value in cfg.items():
        if _SHAPE_LIKE.search(key) and key not in known and value not in (None, 0, False, [], {}):
            raise ShapeError(
                f"unknown architecture field {key}={value!r} in the config: this planner models dense "
                f"decoder layers only and would under-count it"
            )
    heads = _int_field(cfg, "num_attention_heads")
    hidden = _int_field(cfg, "hidden_size")
    kv_heads = _int_field(cfg, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise ShapeError(f"config field num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
    if cfg.get("head_dim") is None and hidden % heads:
        raise ShapeError(
            f"config field hidden_size={hidden} is not divisible by num_attention_heads={heads}; "
            "give head_dim explicitly"
        )
    layers = _int_field(cfg, "num_hidden_layers")
    attention_bias = bool(cfg.get("attention_bias", False)) and model_type != "phi3"  # Phi-3: never biases
    return Architecture(
        name=name,
        model_type=model_type,
        vocab_size=_int_field(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int_field(cfg, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_int_field(cfg, "head_dim", hidden // heads),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "gemma3_text")),
        qkv_bias=model_type == "qwen2" or attention_bias,  # Qwen2 always has q/k/v biases
        o_bias=model_type != "qwen2" and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)) and model_type not in ("phi3", "qwen3_moe"),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        post_norms=model_type == "gemma3_text",
        gemma_norm=model_type == "gemma3_text",
        layer_windows=_layer_windows(cfg, model_type, layers),
        fused_projections=model_type == "phi3",
        **(_moe_fields(cfg) if model_type == "qwen3_moe" else {}),
    )


def _moe_fields(cfg: dict) -> dict[str, int]:
    """The expert fields of a ``qwen3_moe`` config, refusing layouts where some layers stay dense."""
    step = cfg.get("decoder_sparse_step", 1)
    if step != 1:
        raise ShapeError(
            f"config field decoder_sparse_step={step!r} is not supported: only every layer a "
            "mixture of experts (decoder_sparse_step=1) is modelled"
        )
    if cfg.get("mlp_only_layers"):
        raise ShapeError(
            f"config field mlp_only_layers={cfg['mlp_only_layers']!r} is not supported: only every "
            "layer a mixture of experts (mlp_only_layers=[]) is modelled"
        )
    # transformers 5 saves num_experts as num_local_experts (an attribute_map alias); hub configs say num_experts
    key = "num_local_experts" if "num_experts" not in cfg and "num_local_experts" in cfg else "num_experts"
    experts, per_token = _int_field(cfg, key), _int_field(cfg, "num_experts_per_tok")
    if per_token > experts:
        raise ShapeError(f"config field num_experts_per_tok={per_token} must be <= num_experts={experts}")
    return dict(
        num_experts=experts,
        num_experts_per_tok=per_token,
        moe_intermediate_size=_int_field(cfg, "moe_intermediate_size"),
    )


def shipped_shapes() -> list[str]:
    """Short names of the shapes shipped in ``logra_lightning/models/shapes`` (``--model qwen2.5-7b``)."""
    folder = resources.files(__package__)
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_architecture(model: str) -> Architecture:
    """A shipped shape name, a local HF directory / config JSON, or a hub ``org/name`` (needs the hub)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ShapeError(f"--model {model!r} is a directory without config.json")
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ShapeError(f"--model {model!r}: {path} is not valid JSON ({e})") from None
        return architecture_from_config(cfg, name=str(model))
    if model in shipped_shapes():
        text = resources.files(__package__).joinpath(f"{model}.json").read_text()
        return architecture_from_config(json.loads(text), name=model)
    if "/" not in model or model.startswith((".", "/")):
        raise ShapeError(
            f"--model {model!r} is not a shipped shape ({', '.join(shipped_shapes())}), "
            "a local directory or a config JSON file"
        )
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model).to_dict()
    except Exception as e:  # offline, gated, or not a model
        raise ShapeError(
            f"--model {model!r}: could not read its config from the hub ({type(e).__name__}: {e}); "
            "pass a local config.json or a shipped shape instead"
        ) from None
    return architecture_from_config(cfg, name=model)
