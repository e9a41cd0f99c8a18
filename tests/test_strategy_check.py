"""LoGRA refuses strategies that flatten parameters (FSDP1, DeepSpeed) with an error that says what to use.

Run: ``.venv/bin/python -m pytest tests/test_strategy_check.py -q``
"""

from __future__ import annotations

import functools
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from logra_lightning.errors import ConfigError
from logra_lightning.optim import LoGRA, logra_param_groups
from logra_lightning.optim.strategy_check import check_strategy_supported


def logra() -> LoGRA:
    return LoGRA(logra_param_groups(torch.nn.Linear(8, 8), rank=2), lr=1e-3)


def as_given(kind: str):
    """LoGRA the way a module may hold it at setup or after configure_optimizers."""
    return {
        "instance": logra,
        "class": lambda: LoGRA,
        "partial": lambda: functools.partial(LoGRA, lr=1e-3, rank=2),
        # what LightningCLI's OptimizerCallable is: partial(instantiator, class, **init_args)
        "cli_callable": lambda: functools.partial(lambda cls, *a, **k: cls(*a, **k), LoGRA, lr=1e-3),
        "lightning_optimizer": lambda: LightningOptimizer(logra()),
        "list": lambda: [torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), logra()],
    }[kind]()


@pytest.mark.parametrize("kind", ["instance", "class", "partial", "cli_callable", "lightning_optimizer", "list"])
def test_fsdp1_refused_with_the_fix(kind):
    trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ConfigError) as err:
        check_strategy_supported(trainer, as_given(kind))
    msg = str(err.value)
    assert "`FSDPStrategy` (FSDP1)" in msg and "flattened" in msg  # what and why
    assert "ModelParallelStrategy" in msg and "fully_shard" in msg  # how to fix


def test_deepspeed_refused():
    trainer = SimpleNamespace(strategy=object.__new__(DeepSpeedStrategy))  # no deepspeed install needed
    with pytest.raises(ConfigError, match="DeepSpeedStrategy.*ModelParallelStrategy"):
        check_strategy_supported(trainer, LoGRA)


@pytest.mark.parametrize(
    "strategy", [ModelParallelStrategy(), SingleDeviceStrategy(device=torch.device("cpu"))], ids=["fsdp2", "single"]
)
def test_supported_strategies_pass(strategy):
    check_strategy_supported(SimpleNamespace(strategy=strategy), logra())


def test_other_optimizers_pass_under_fsdp1():
    trainer = SimpleNamespace(strategy=FSDPStrategy())
    check_strategy_supported(trainer, torch.optim.AdamW)
    check_strategy_supported(trainer, functools.partial(torch.optim.AdamW, lr=1e-3))
    check_strategy_supported(trainer, None)


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_the_optimizer_does_not_import_lightning():
    """A plain PyTorch user pays nothing for Lightning; its pieces load on first access."""
    plain = "from logra_lightning.optim import LoGRA, logra_param_groups, two_phase, keep_out_of_ddp; import sys"
    assert _run(plain + "; print('lightning' in sys.modules)") == "False"
    lazy = "from logra_lightning.optim import LoGRADDPStrategy, check_strategy_supported"
    registry = "from lightning.pytorch.strategies import StrategyRegistry as R"
    registry += "; print('logra_ddp' in R, 'logra_ddp_spawn' in R)"
    assert _run(f"{lazy}; {registry}") == "True True"


def test_logra_ddp_is_a_strategy_name_when_lightning_came_first():
    """The documented order (import lightning, then the optimizer) makes "logra_ddp" usable as a name."""
    code = (
        "import lightning as L; from logra_lightning.optim import LoGRA; "
        "print(type(L.Trainer(strategy='logra_ddp', accelerator='cpu', devices=1, logger=False).strategy).__name__)"
    )
    assert _run(code).splitlines()[-1] == "LoGRADDPStrategy"
