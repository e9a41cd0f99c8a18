"""``BF16Weights``: hold the policy's weights at bf16 values, rounding each step's update by a rule.

Used by ``benchmarks/quality.py --bf16`` to measure, on the RL task, which rule keeps small
updates alive when the weights have bf16 precision. The weights stay fp32 tensors holding
bf16-representable values, and forward/backward run in fp32: this isolates the rounding of the
update (the question of issue 18) from bf16 activations, and runs at fp32 speed. Real bf16
weights (``trainer.precision: bf16-true``) take the same path inside LoGRA
(:mod:`logra_lightning.optim.rounding`, ``bf16_update=``), many times slower on a CPU without bf16
matrix units.

Per batch: the weights before the optimizer step (bf16 values) are ``w``; after it, ``w + Δ``
in fp32; the callback replaces that by ``add_<rule>(w, Δ)`` of the rounding module, keeping a
Kahan compensation per weight for ``"kahan"``. The first batch starts by rounding the initial
weights to bf16 (nearest).

Logged metrics:
    ``bf16/lost_share``: share of weight entries whose nonzero update rounded back to the old value.
"""

from __future__ import annotations

import lightning as L
import torch

from logra_lightning.optim import rounding
from logra_lightning.optim.sketch import mix_seed


class BF16Weights(L.Callback):
    """Round every trainable weight of ``pl_module.policy`` to bf16 after each step, by ``rule``.

    Args:
        rule: ``"nearest"``, ``"stochastic"`` or ``"kahan"``.
        seed: base seed of the stochastic rounding bits (one generator per step).
    """

    def __init__(self, rule: str = "nearest", seed: int = 0) -> None:
        if rule not in rounding.MODES:
            raise ValueError(f"Invalid rule: {rule!r} (allowed: {', '.join(rounding.MODES)})")
        self.rule, self.seed = rule, seed
        self._before: dict[str, torch.Tensor] = {}
        self._comp: dict[str, torch.Tensor] = {}

    def _params(self, pl_module: L.LightningModule) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in pl_module.policy.named_parameters() if p.requires_grad]

    @torch.no_grad()
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for _, p in self._params(pl_module):
            p.copy_(p.to(torch.bfloat16).float())

    @torch.no_grad()
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._before = {n: p.detach().to(torch.bfloat16) for n, p in self._params(pl_module)}  # exact: bf16 values

    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        gen = torch.Generator().manual_seed(mix_seed(self.seed, trainer.global_step))
        lost = total = 0
        for n, p in self._params(pl_module):
            w = self._before[n]
            delta = p.detach().float() - w.float()  # the optimizer's update, fp32
            if self.rule == "kahan":
                comp = self._comp.setdefault(n, torch.zeros_like(w))
                new, self._comp[n] = rounding.add_kahan(w, delta, comp)
            elif self.rule == "stochastic":
                new = rounding.add_stochastic(w, delta, gen)
            else:
                new = rounding.add_nearest(w, delta)
            lost += rounding.lost_updates(w, new, delta)
            total += int((delta != 0).sum())
            p.copy_(new.float())
        self._before = {}
        if total:
            pl_module.log("bf16/lost_share", lost / total, on_step=True, on_epoch=False, batch_size=1)
