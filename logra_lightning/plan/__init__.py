"""`logra plan`: will RL on this model fit? Per-GPU memory of dense AdamW vs LoGRA under FSDP2.

* :mod:`~logra_lightning.plan.setup`: what is asked (:class:`PlanSetup`, :class:`PlanError`);
* :mod:`~logra_lightning.plan.memory`: the memory model, phase by phase (its docstring gives
  every formula and the departures);
* :mod:`~logra_lightning.plan.optimizers`: the bytes that depend on the optimizer;
* :mod:`~logra_lightning.plan.cli`: the ``logra plan`` command.

Example::

    >>> from logra_lightning.models.shapes import load_architecture
    >>> result = plan(load_architecture("qwen2.5-0.5b"), PlanSetup(gpus=1, rank=64))
    >>> result["optimizers"]["logra"]["peak_bytes"] < result["optimizers"]["adamw"]["peak_bytes"]
    True
"""

from logra_lightning.plan.cli import build_parser, format_table, main
from logra_lightning.plan.memory import (
    ENGINE_BYTES,
    PHASES,
    activation_phases,
    engine_bytes,
    fsdp_phases,
    layer_activation_bytes,
    plan,
    plan_optimizer,
    saved_activation_bytes,
)
from logra_lightning.plan.optimizers import OPTIMIZERS, OptimizerTerms, adamw_terms, logra_terms
from logra_lightning.plan.setup import (
    ADAMW_IMPLS,
    PRECISIONS,
    SECOND_MOMENTS,
    STATE_BYTES,
    GiB,
    PlanError,
    PlanSetup,
    check_rank,
)

__all__ = [
    "ADAMW_IMPLS",
    "ENGINE_BYTES",
    "OPTIMIZERS",
    "PHASES",
    "PRECISIONS",
    "SECOND_MOMENTS",
    "STATE_BYTES",
    "GiB",
    "OptimizerTerms",
    "PlanError",
    "PlanSetup",
    "activation_phases",
    "adamw_terms",
    "build_parser",
    "check_rank",
    "engine_bytes",
    "format_table",
    "fsdp_phases",
    "layer_activation_bytes",
    "logra_terms",
    "main",
    "plan",
    "plan_optimizer",
    "saved_activation_bytes",
]
