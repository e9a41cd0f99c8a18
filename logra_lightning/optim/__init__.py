"""LoGRA optimizer: Adam on low-rank gradient sketches (docs/design.md §2).

Example::

    >>> import torch
    >>> from logra_lightning.optim import LoGRA, logra_param_groups
    >>> model = torch.nn.Linear(16, 16)
    >>> opt = LoGRA(logra_param_groups(model, rank=4), lr=1e-3)
"""

from logra_lightning.optim.groups import is_eligible, logra_param_groups, split_named_params
from logra_lightning.optim.logra import LoGRA
from logra_lightning.optim.reference import LoGRAReference

__all__ = ["LoGRA", "LoGRAReference", "is_eligible", "logra_param_groups", "split_named_params"]

from logra_lightning.optim.accounting import grad_bytes, optimizer_state_bytes, param_bytes
from logra_lightning.optim.data_parallel import keep_out_of_ddp
from logra_lightning.optim.ddp_strategy import LoGRADDPStrategy
from logra_lightning.optim.strategy_check import check_strategy_supported
from logra_lightning.optim.two_phase import is_two_phase, two_phase

__all__ += [
    "LoGRADDPStrategy",
    "check_strategy_supported",
    "grad_bytes",
    "is_two_phase",
    "keep_out_of_ddp",
    "optimizer_state_bytes",
    "param_bytes",
    "two_phase",
]
