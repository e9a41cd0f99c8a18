"""GaLore in the ``logra fit`` loop: ``GaLoreAdamW`` built from the ``(name, param)`` pairs the module passes.

``PolicyGradientModule.configure_optimizers`` calls the configured optimizer with the policy's
named parameters. ``galore_torch.GaLoreAdamW`` given those pairs runs, but as plain AdamW:
it projects only param groups that carry a ``rank`` key. This subclass splits the pairs
into a low-rank group (2-D attention/MLP weights, GaLore's usual choice; ``include`` is a
regex on the name) and a dense group, and passes GaLore's keys to the first. Config::

    model:
      optimizer:
        class_path: benchmarks.galore_named.GaLoreAdamWNamed   # PYTHONPATH=. (benchmarks/quality.py sets it)
        init_args: {lr: 1.0e-5, rank: 16, update_proj_gap: 50, scale: 1.0}

Departure from GaLore's defaults: ``scale`` defaults to 1.0 (LoGRA's default), not 0.25, so
that the same ``lr`` means the same step size in the quality comparison.
"""

from __future__ import annotations

import re

from galore_torch import GaLoreAdamW


class GaLoreAdamWNamed(GaLoreAdamW):
    """``GaLoreAdamW`` over named params: low rank for 2-D params whose name matches ``include``.

    Args:
        params: ``(name, tensor)`` pairs (or bare tensors, named by position).
        lr, betas, eps, weight_decay: as ``GaLoreAdamW``.
        rank, update_proj_gap, scale, proj_type: GaLore's keys of the low-rank group.
        include: regex on the parameter name selecting the low-rank params.

    Raises:
        ValueError: no parameter matched ``include`` (names the pattern).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        rank: int = 16,
        update_proj_gap: int = 200,
        scale: float = 1.0,
        proj_type: str = "std",
        include: str = r"\.(self_attn|mlp)\.",
    ) -> None:
        named = [p if isinstance(p, tuple) else (f"param_{i}", p) for i, p in enumerate(params)]
        low = [(n, p) for n, p in named if p.ndim == 2 and re.search(include, n)]
        rest = [(n, p) for n, p in named if not (p.ndim == 2 and re.search(include, n))]
        if not low:
            raise ValueError(f"GaLoreAdamWNamed: no 2-D parameter matched include={include!r}")
        groups = [
            {"params": [p for _, p in rest]},
            {
                "params": [p for _, p in low],
                "rank": rank,
                "update_proj_gap": update_proj_gap,
                "scale": scale,
                "proj_type": proj_type,
            },
        ]
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, no_deprecation_warning=True)
