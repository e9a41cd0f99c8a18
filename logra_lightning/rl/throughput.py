"""Model FLOPs utilization (MFU) of the RL step's training phase, against a peak measured on this device.

The training phase (forward and backward over the step's sequences) costs, in model FLOPs:

* ``6 * N * T`` through the decoder's weight matrices: ``N`` weights of the ``nn.Linear`` layers below
  the LM head, ``T`` tokens (2 FLOPs per weight per token forward, 4 backward);
* ``6 * V * d * M`` through the LM head, which the chunked head runs at the ``M`` completion tokens
  only (:mod:`~logra_lightning.rl.lm_head`);
* ``6 * layers * d_attn * sum(len_i ** 2)`` for causal attention's score and value products
  (``2 * len**2 * d_attn`` forward per layer, half of a full square, times 3 with backward).

With frozen weights (a LoRA adapter) backward skips their gradients: 4 instead of 6 per weight and
token. Recomputation under activation checkpointing is not counted (model FLOPs, not hardware FLOPs, as in
PaLM's MFU). The peak is what this device reaches on one large matmul in the training dtype
(:func:`measure_peak_flops`, a fraction of a second at start-up); a GPU's datasheet peak can be given
instead (``PolicyGradientModule(peak_flops=...)``).

Example::

    >>> dims = ModelDims(matmul_params=1_000, head_params=100, layers=2, attention_width=8)
    >>> dims.training_flops(lengths=[3, 5], completion_tokens=4)  # 6*1000*8 + 6*100*4 + 6*2*8*(9+25)
    53664
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelDims:
    """The sizes that set a causal LM's training FLOPs per token (see the module docstring)."""

    matmul_params: int  # weights of the nn.Linear layers below the LM head
    head_params: int  # the LM head's weights, V * d
    layers: int
    attention_width: int  # query heads * head dim

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelDims:
        """Read the sizes from an HF causal LM (its ``config`` and its ``nn.Linear`` layers)."""
        head = model.get_output_embeddings()
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(linear, head.weight.numel(), cfg.num_hidden_layers, cfg.num_attention_heads * head_dim)

    def training_flops(self, lengths: list[int], completion_tokens: int, weight_grads: bool = True) -> int:
        """Model FLOPs of one forward and backward over sequences of ``lengths`` tokens.

        ``weight_grads=False``: the weights are frozen (an adapter trains), so backward computes
        activation gradients only.
        """
        per_weight = 6 if weight_grads else 4
        attention = 6 * self.layers * self.attention_width * sum(n * n for n in lengths)
        return per_weight * (self.matmul_params * sum(lengths) + self.head_params * completion_tokens) + attention


def training_dtype(precision: str | None, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype the step's matmuls run in under Lightning's ``precision`` (``"bf16-mixed"``, ``"32-true"``, ...)."""
    precision = str(precision or "")
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("32"):
        return torch.float32
    if precision.startswith("64"):
        return torch.float64
    return param_dtype


def measure_peak_flops(
    dtype: torch.dtype, device: torch.device | str = "cpu", size: int = 2048, seconds: float = 0.3
) -> float:
    """FLOP/s of the fastest of repeated ``[size, size] @ [size, size]`` matmuls in ``dtype`` on ``device``.

    Runs with the current ``torch.get_num_threads()``, the threads the step will use, and with autocast off
    (the first step calls it inside Lightning's autocast, which would turn a float32 probe into bf16).
    """
    device = torch.device(device)
    with torch.autocast(device.type, enabled=False):
        return _best_matmul_flops(dtype, device, size, seconds)


def _best_matmul_flops(dtype: torch.dtype, device: torch.device, size: int, seconds: float) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best, deadline = float("inf"), time.perf_counter() + seconds
    for i in range(100):
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        if i:  # the first call warms up the kernel choice and the caches
            best = min(best, time.perf_counter() - start)
        if i >= 3 and time.perf_counter() > deadline:
            break
    return 2 * size**3 / best


def low_precision_advice(dtype: torch.dtype, peak: float, fp32_peak: float) -> str | None:
    """A warning when the half-precision ``dtype``'s matmuls are more than 10% slower than fp32's, else ``None``.

    bf16 pays on CPUs with bf16 matrix units (Intel AMX): 7-9x fp32 on a Sapphire Rapids Xeon. Without them
    PyTorch's CPU bf16 matmul can run below fp32 (0.5x on a Xeon exposing ``avx512_bf16`` but not AMX,
    docs/speed.md), and a ``bf16-mixed`` run is then slower than ``32-true`` with nothing gained.

    Example::

        >>> low_precision_advice(torch.bfloat16, peak=2.8e12, fp32_peak=0.35e12) is None
        True
        >>> print(low_precision_advice(torch.bfloat16, peak=0.15e12, fp32_peak=0.3e12))  # doctest: +ELLIPSIS
        bfloat16 matmuls run at 0.15 TFLOP/s on this device against float32's 0.30 (0.50x): ...
    """
    if peak >= 0.9 * fp32_peak:  # within the probe's noise of fp32: no advice
        return None
    name = str(dtype).removeprefix("torch.")
    return (
        f"{name} matmuls run at {peak / 1e12:.2f} TFLOP/s on this device against float32's "
        f"{fp32_peak / 1e12:.2f} ({peak / fp32_peak:.2f}x): this CPU has no {name} matrix units, so "
        "--trainer.precision 32-true (and the engine's dtype: float32) is faster here (docs/speed.md)"
    )
