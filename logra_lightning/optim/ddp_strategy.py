"""``LoGRADDPStrategy``: Lightning DDP that leaves LoGRA's low-rank matrices to LoGRA's sketch all-reduce.

Lightning's ``DDPStrategy.setup`` wraps the model in ``DistributedDataParallel`` and only then
calls ``configure_optimizers``, so when DDP builds its gradient buckets nobody knows yet which
params LoGRA will sketch: DDP takes them all, allocates a full fp32 bucket copy of every gradient
and all-reduces it. This strategy builds the optimizers first, keeps every LoGRA low-rank matrix
out of DDP (:func:`~logra_lightning.optim.data_parallel.keep_out_of_ddp`), and then wraps: DDP
reduces the dense-group params (norms, biases, anything not low-rank), and LoGRA averages the
matrices' sketches with one all-reduce per step (mode ``"sketch"``,
:mod:`~logra_lightning.optim.data_parallel`). Without LoGRA it behaves as ``DDPStrategy``.

Names registered with Lightning when this module is imported (``logra_lightning.optim`` imports it
when Lightning is imported already): ``"logra_ddp"`` (like ``"ddp"``: one process per device,
launched by re-running the script or by ``torchrun``/SLURM) and ``"logra_ddp_spawn"`` (like ``"ddp_spawn"``).
``logra fit --trainer.strategy ddp`` (or ``ddp_spawn``) with LoGRA uses it
(:func:`logra_strategy`). A plain ``Trainer(strategy="ddp")`` also trains correctly (replicas
bit-identical): LoGRA then keeps the full gradients for DDP to average and warns once.

Departure from ``DDPStrategy``: ``configure_optimizers`` runs before the model is wrapped (after it
is moved to its device), so it sees the LightningModule's own parameters, not DDP's wrapper.

Example::

    >>> import lightning as L
    >>> trainer = L.Trainer(strategy="logra_ddp", accelerator="cpu", devices=2)  # doctest: +SKIP
    >>> trainer = L.Trainer(strategy=LoGRADDPStrategy(), accelerator="cpu", devices=2)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from typing_extensions import override

from logra_lightning.optim.data_parallel import keep_out_of_ddp


class LoGRADDPStrategy(DDPStrategy):
    """DDP for LoGRA: its low-rank matrices stay out of DDP's buckets; LoGRA all-reduces their sketches.

    Args: as :class:`lightning.pytorch.strategies.DDPStrategy` (``start_method``, ``timeout``,
    ``process_group_backend``, DDP keyword arguments, ...).

    Example::

        >>> import lightning as L
        >>> L.Trainer(strategy=LoGRADDPStrategy(), accelerator="cpu", devices=2)  # doctest: +SKIP
    """

    strategy_name = "logra_ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._optimizers_ready = False

    @override
    def configure_ddp(self) -> None:
        from logra_lightning.optim.logra import LoGRA

        module = self.lightning_module
        super().setup_optimizers(module.trainer)  # before wrapping: which params are LoGRA's
        self._optimizers_ready = True
        logra = [opt for opt in self.optimizers if isinstance(getattr(opt, "optimizer", opt), LoGRA)]
        lowrank = [p for opt in logra for p in getattr(opt, "optimizer", opt).lowrank_params()]
        if lowrank:
            keep_out_of_ddp(module, lowrank)
            for opt in logra:
                getattr(opt, "optimizer", opt).setup_data_parallel()  # mode "sketch"; broadcast from rank 0
        if not any(p.requires_grad and not getattr(p, "_ddp_ignored", False) for p in module.parameters()):
            return  # every trainable param is LoGRA's: nothing is left for DDP to reduce
        super().configure_ddp()

    @override
    def setup_optimizers(self, trainer: L.Trainer) -> None:
        if self._optimizers_ready:  # already built by configure_ddp
            self._optimizers_ready = False
            return
        super().setup_optimizers(trainer)


def register() -> None:
    """Register ``"logra_ddp"`` and ``"logra_ddp_spawn"`` in Lightning's strategy registry (idempotent)."""
    for name, start_method, what in (
        ("logra_ddp", "popen", "one process per device, like 'ddp'"),
        ("logra_ddp_spawn", "spawn", "processes started with spawn, like 'ddp_spawn'"),
    ):
        if name not in StrategyRegistry:
            StrategyRegistry.register(
                name,
                LoGRADDPStrategy,
                description=f"DDP with LoGRA's low-rank sketch all-reduce ({what})",
                start_method=start_method,
            )


_PLAIN = {"ddp": "logra_ddp", "ddp_spawn": "logra_ddp_spawn"}


def logra_strategy(strategy: Any, optimizer: Any) -> Any:
    """``strategy`` with ``"ddp"`` / ``"ddp_spawn"`` replaced by LoGRA's versions when ``optimizer`` is LoGRA.

    ``optimizer``: an optimizer, class, ``functools.partial`` / ``OptimizerCallable`` (see
    :func:`~logra_lightning.optim.strategy_check.check_strategy_supported`). Anything else is returned as is.

    Example::

        >>> from logra_lightning.optim import LoGRA
        >>> logra_strategy("ddp", LoGRA), logra_strategy("ddp", object), logra_strategy("auto", LoGRA)
        ('logra_ddp', 'ddp', 'auto')
    """
    from logra_lightning.optim.logra import LoGRA
    from logra_lightning.optim.strategy_check import _optimizer_classes

    if isinstance(strategy, str) and strategy in _PLAIN:
        if any(issubclass(c, LoGRA) for c in _optimizer_classes(optimizer)):
            return _PLAIN[strategy]
    return strategy


register()
