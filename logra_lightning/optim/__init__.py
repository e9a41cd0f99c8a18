"""LoGRA optimizer: Adam on low-rank gradient sketches (docs/design.md §2).

Importing this package does not import Lightning (which takes seconds): the optimizer runs in a
plain PyTorch loop. Its Lightning pieces, :class:`~logra_lightning.optim.ddp_strategy.LoGRADDPStrategy`
and :func:`~logra_lightning.optim.strategy_check.check_strategy_supported`, load on first access.
Importing :mod:`~logra_lightning.optim.ddp_strategy` makes ``"logra_ddp"`` / ``"logra_ddp_spawn"``
strategy names of Lightning; this package does that itself when Lightning is imported already
(``import lightning`` before ``from logra_lightning.optim import LoGRA``, the usual order), and
so do ``logra fit`` and the first access of ``LoGRADDPStrategy``.

Example::

    >>> import torch
    >>> from logra_lightning.optim import LoGRA, logra_param_groups
    >>> model = torch.nn.Linear(16, 16)
    >>> opt = LoGRA(logra_param_groups(model, rank=4), lr=1e-3)
"""

import sys

from logra_lightning.optim.accounting import grad_bytes, optimizer_state_bytes, param_bytes
from logra_lightning.optim.data_parallel import keep_out_of_ddp
from logra_lightning.optim.groups import is_eligible, logra_param_groups, split_named_params
from logra_lightning.optim.logra import LoGRA
from logra_lightning.optim.reference import LoGRAReference
from logra_lightning.optim.two_phase import is_two_phase, two_phase

_LIGHTNING = {"LoGRADDPStrategy": "ddp_strategy", "check_strategy_supported": "strategy_check"}

__all__ = [
    "LoGRA",
    "LoGRADDPStrategy",
    "LoGRAReference",
    "check_strategy_supported",
    "grad_bytes",
    "is_eligible",
    "is_two_phase",
    "keep_out_of_ddp",
    "logra_param_groups",
    "optimizer_state_bytes",
    "param_bytes",
    "split_named_params",
    "two_phase",
]


def __getattr__(name: str):
    if name in _LIGHTNING:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LIGHTNING[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if "lightning.pytorch.strategies" in sys.modules:  # free now: make "logra_ddp" a strategy name
    from logra_lightning.optim import ddp_strategy  # noqa: F401
