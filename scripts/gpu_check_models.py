"""Random-init Qwen2.5-shaped policies for ``scripts/gpu_check.py``, built locally (no hub).

The GPU check needs models of real shapes on machines that reach nothing but the package
index, so it makes them: the architecture fields of Qwen2.5-0.5B / 1.5B / 7B (the shipped
``logra_lightning/models/shapes`` JSON where there is one), random weights, and the project's
character tokenizer with its vocabulary padded with filler tokens to the model's real vocabulary
size, saved as a normal Hugging Face directory that ``transformers`` and vLLM both load.
``dry_shape`` scales a shape down (same architecture: GQA, tied or untied head, biases) for the
CPU dry run. Pure functions except :func:`build_model_dir`; tested in ``tests/test_gpu_check.py``.

Departures from "just random weights" (both needed for RL to do anything on a random policy):

1. **EOS is made likely.** A random policy over 152k tokens samples EOS once in ~150k tokens,
   so every completion would be cut at ``max_new_tokens`` and the module skips such batches
   (``health.degenerate_rollout``: "all truncated"). Every token embedding gets a constant
   in feature 0, doubled until that feature is still positive at the last layer on 99% of
   positions (a direction the random layers do not drown), and the EOS row of the output head gets
   ``b`` in that feature, with ``b`` solved by bisection on random token sequences so that the
   mean per-token EOS probability is ``1 - (1 - finish_fraction) ** (1 / max_new_tokens)``:
   about ``finish_fraction`` of the completions end before ``max_new_tokens``, the rest are cut
   (so the packed batch is ``prompt + max_new_tokens`` long, as the planner assumes).
2. **The reward** (:class:`DigitShareReward`) is the share of digit characters in the decoded
   completion: exact match would give every sample 0, hence zero advantages and no update.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

#: Architecture fields of Qwen/Qwen2.5-1.5B(-Instruct) config.json (1.54B params, tied embeddings);
#: not among logra_lightning's shipped shapes.
QWEN25_1P5B = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 21,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
}

#: The models the check runs: a shipped shape name or a dict of fields, and the decoder layers
#: kept (``None``: all). The 7B shape keeps 4 of its 28 layers (every matrix at its real size).
MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"shape": "qwen2.5-0.5b", "layers": None},
    "qwen2.5-1.5b": {"shape": QWEN25_1P5B, "layers": None},
    "qwen2.5-7b-4l": {"shape": "qwen2.5-7b", "layers": 4},
}

_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "hidden_act",
)
HEAD_DIM = 64  # vLLM's CPU backend rejects small head dims (docs/design.md §7); real Qwen2.5 heads are 128 or 64


def real_shape(model: str) -> dict[str, Any]:
    """HF config fields of one of :data:`MODELS` at its real size (``layers`` applied).

    Raises:
        ValueError: an unknown model name (the message lists the allowed ones).
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r} (allowed: {', '.join(MODELS)})")
    spec = MODELS[model]
    shape = spec["shape"]
    if isinstance(shape, str):
        text = resources.files("logra_lightning.models.shapes").joinpath(f"{shape}.json").read_text()
        shape = json.loads(text)
    out = {k: shape[k] for k in _FIELDS if k in shape}
    if spec["layers"] is not None:
        out["num_hidden_layers"] = spec["layers"]
    return out


def dry_shape(
    shape: dict[str, Any],
    hidden_size: int,
    num_layers: int = 2,
    vocab_size: int = 1024,
    max_position_embeddings: int = 256,
) -> dict[str, Any]:
    """The same architecture scaled down: ``hidden_size`` (a multiple of 64), heads of 64, the GQA
    ratio and the MLP ratio kept as far as whole heads allow, tied/untied head unchanged.

    Example::

        >>> s = dry_shape(real_shape("qwen2.5-0.5b"), hidden_size=128)
        >>> s["num_attention_heads"], s["num_key_value_heads"], s["intermediate_size"], s["tie_word_embeddings"]
        (2, 1, 704, True)
    """
    if hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size={hidden_size} must be a multiple of {HEAD_DIM} (the head dim)")
    heads = hidden_size // HEAD_DIM
    ratio = shape["num_attention_heads"] // shape.get("num_key_value_heads", shape["num_attention_heads"])
    kv = max(1, heads // ratio)
    while heads % kv:
        kv -= 1
    mlp = round(shape["intermediate_size"] / shape["hidden_size"] * hidden_size / 32) * 32
    return {
        **shape,
        "hidden_size": hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": mlp,
        "num_hidden_layers": num_layers,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
    }


def eos_probability(finish_fraction: float, max_new_tokens: int) -> float:
    """Per-token EOS probability at which ``finish_fraction`` of completions end within ``max_new_tokens``.

    >>> round(eos_probability(0.5, 1), 3), round(1 - (1 - eos_probability(0.3, 128)) ** 128, 3)
    (0.5, 0.3)
    """
    if not 0 < finish_fraction < 1:
        raise ValueError(f"finish_fraction={finish_fraction} must be in (0, 1)")
    return 1.0 - (1.0 - finish_fraction) ** (1.0 / max_new_tokens)


def solve_eos_bias(eos_logit, other_lse, feature, target: float, iters: int = 100) -> float:
    """``b`` such that ``mean(sigmoid(eos_logit + b * feature - other_lse)) == target`` (bisection).

    All arguments but ``target`` are tensors of the same shape (one entry per position):
    ``eos_logit`` the EOS logit, ``other_lse`` the log-sum-exp of every other logit, ``feature``
    the final hidden state's feature 0 (the EOS logit moves by ``b * feature``).

    Raises:
        ValueError: the target cannot be reached (feature 0 carries no signal).
    """
    import torch

    def mean_p(b: float) -> float:
        return float(torch.sigmoid(eos_logit + b * feature - other_lse).mean())

    lo, hi = -1e4, 1e4
    if not mean_p(lo) <= target <= mean_p(hi):
        raise ValueError(f"EOS probability {target:.3g} not reachable (range {mean_p(lo):.3g}..{mean_p(hi):.3g})")
    for _ in range(iters):  # mean_p rises with b while feature > 0 at most positions
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mean_p(mid) < target else (lo, mid)
    return 0.5 * (lo + hi)


def padded_char_tokenizer(vocab_size: int):
    """The project's character tokenizer with filler tokens ``<|f{i}|>`` up to ``vocab_size`` entries."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from logra_lightning.models import build_char_tokenizer

    base = build_char_tokenizer()
    vocab = dict(base.get_vocab())
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the character vocabulary ({len(vocab)})")
    for i in range(len(vocab), vocab_size):
        vocab[f"<|f{i}|>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=base.unk_token))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")  # as build_char_tokenizer
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=base.pad_token, eos_token=base.eos_token, unk_token=base.unk_token
    )


def build_model_dir(
    path: str | Path,
    shape: dict[str, Any],
    *,
    max_new_tokens: int,
    finish_fraction: float = 0.3,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, Any]:
    """Write a random-init HF model of ``shape`` to ``path`` (EOS made likely, see the module notes).

    Weights are initialised on ``device`` (fast on a GPU) and saved in ``dtype``. Returns what
    was built: params, the EOS bias and the EOS probability it gives, seconds.
    """
    import time

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    start = time.perf_counter()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = padded_char_tokenizer(shape["vocab_size"])
    cfg = Qwen2Config(
        **shape,
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    target = eos_probability(finish_fraction, max_new_tokens)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight  # [V, h]
        g = torch.Generator(device="cpu").manual_seed(seed)
        ids = torch.randint(3, shape["vocab_size"], (8, min(64, max_new_tokens)), generator=g).to(device)  # [8, T]
        const = 4.0 * float(emb.std())
        for _ in range(12):  # a shared direction; strong enough that the random layers do not drown it
            emb[:, 0] = const
            hidden = model.model(input_ids=ids).last_hidden_state.float()  # [8, T, h]
            if (hidden[..., 0] > 0).float().mean() >= 0.99:
                break
            const *= 2.0
        logits = model.lm_head(hidden).float()  # [8, T, V]
        eos = tok.eos_token_id
        eos_logit = logits[..., eos].clone()
        logits[..., eos] = -math.inf
        bias = solve_eos_bias(eos_logit, logits.logsumexp(-1), hidden[..., 0], target)
        model.get_output_embeddings().weight[eos, 0] += bias  # tied: also the EOS input embedding, never a prompt token
        del logits, hidden
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    info = {
        "params": sum(p.numel() for p in model.parameters()),
        "eos_feature": const,
        "eos_bias": bias,
        "eos_probability": target,
        "max_new_tokens": max_new_tokens,
        "finish_fraction": finish_fraction,
        "dtype": dtype,
        "seconds": time.perf_counter() - start,
    }
    (path / "gpu_check_model.json").write_text(json.dumps({"shape": shape, **info}, indent=2))
    del model
    return info


class DigitShareReward:
    """Share of digit characters in each completion (0 for an empty one): a reward with spread on a random policy.

    >>> DigitShareReward()(["p", "p"], ["a1", ""], ["", ""])
    [0.5, 0.0]
    """

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]
