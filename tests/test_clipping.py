"""Gradient clipping with LoGRA: the norm covers the sketches, every entry point clips or refuses.

Run: ``.venv/bin/python -m pytest tests/test_clipping.py -q``
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from logra_lightning.config.checks import check_module_args, check_trainer_args
from logra_lightning.errors import ConfigError
from logra_lightning.optim import LoGRA, logra_param_groups
from logra_lightning.optim.clipping import clip_grad_norm_

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's small-dataloader tips


def _pair(rank: int) -> tuple[torch.nn.Module, torch.nn.Module, LoGRA]:
    """A model with LoGRA after one backward, and an identical plain model with full gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 6))
    twin = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 6))
    twin.load_state_dict(model.state_dict())
    opt = LoGRA(logra_param_groups(model, rank=rank), lr=1e-3, basis_dtype="float32")
    x = torch.randn(5, 12)
    for m in (model, twin):
        m(x).pow(2).sum().backward()
    return model, twin, opt


def _sketched_norm(model, twin, opt) -> float:
    """sqrt(sum ||G Q||^2 or ||P.T G||^2 over matrices + sum ||g||^2 over the rest), from the twin's full G."""
    total = 0.0
    for p, q in zip(model.parameters(), twin.parameters()):
        if opt.lowrank_matrix(p) is not None:
            basis, side = opt.state[p]["basis"].float(), opt.lowrank_matrix(p).side
            s = q.grad @ basis if side == "right" else basis.T @ q.grad
            total += float(s.square().sum())
        else:
            total += float(q.grad.square().sum())
    return math.sqrt(total)


@pytest.mark.parametrize("rank", [3, 6])  # 6: full rank for the [6, 16] head
def test_norm_is_the_sketched_norm_and_scales_everything(rank):
    model, twin, opt = _pair(rank)
    expected = _sketched_norm(model, twin, opt)
    full = float(torch.nn.utils.get_total_norm([q.grad for q in twin.parameters()]))
    assert expected <= full * (1 + 1e-6)  # a projection never adds norm
    before = [s.clone() for s in opt.gradient_sketches()]
    dense_before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    norm = opt.clip_grad_norm_(expected / 4)
    assert float(norm) == pytest.approx(expected, rel=1e-5)
    coef = (expected / 4) / (expected + 1e-6)
    for s, b in zip(opt.gradient_sketches(), before):
        torch.testing.assert_close(s, b * coef)
    for g, b in zip([p.grad for p in model.parameters() if p.grad is not None], dense_before):
        torch.testing.assert_close(g, b * coef)
    assert float(opt.clip_grad_norm_(float("inf"))) == pytest.approx(expected / 4, rel=1e-4)  # reads the norm


def test_full_rank_sketches_give_the_full_norm():
    """At full rank on the sketched side the basis is the identity: the norm is torch's on full gradients."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6)  # right sketch, rank 4 = n: Q is the identity
    twin = torch.nn.Linear(4, 6)
    twin.load_state_dict(model.state_dict())
    opt = LoGRA(logra_param_groups(model, rank=4, side="right"), lr=1e-3)
    x = torch.randn(3, 4)
    for m in (model, twin):
        m(x).sum().backward()
    assert float(opt.clip_grad_norm_(1e9)) == pytest.approx(
        float(torch.nn.utils.clip_grad_norm_(twin.parameters(), 1e9))
    )


def test_torch_entry_points_are_routed_or_refused():
    model, twin, opt = _pair(3)
    expected = _sketched_norm(model, twin, opt)
    assert torch.nn.utils.clip_grad_norm_ is clip_grad_norm_  # installed by LoGRA
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)) == pytest.approx(expected, rel=1e-5)
    # a model without LoGRA goes to torch unchanged
    plain = float(torch.nn.utils.clip_grad_norm_(twin.parameters(), 1e9))
    assert plain == pytest.approx(float(torch.nn.utils.get_total_norm([q.grad for q in twin.parameters()])))
    with pytest.raises(ValueError, match="norm_type=2"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type="inf")
    with pytest.raises(ValueError, match="gradient_clip_algorithm='norm'"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    torch.nn.utils.clip_grad_value_(twin.parameters(), 1e-3)  # plain params: torch's value clipping
    assert max(float(q.grad.abs().max()) for q in twin.parameters()) <= 1e-3 * (1 + 1e-6)


def test_torch_is_routed_only_while_a_logra_lives():
    """Routing starts with the first LoGRA built and ends when the last one is collected; the models may live on."""
    script = textwrap.dedent(
        """
        import gc, torch
        modules, functions = (torch.nn.utils, torch.nn.utils.clip_grad), ("clip_grad_norm_", "clip_grad_value_")
        names = [(m, n) for m in modules for n in functions]
        original = [getattr(m, n) for m, n in names]
        from logra_lightning.optim import LoGRA, logra_param_groups, clipping
        def torchs():
            return all(getattr(m, n) is f for (m, n), f in zip(names, original))
        m1, m2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        print("imported", torchs())
        a, b = (LoGRA(logra_param_groups(m, rank=2), lr=1e-3) for m in (m1, m2))
        print("built", clipping.routed(), torch.nn.utils.clip_grad.clip_grad_value_ is clipping.clip_grad_value_)
        del a; gc.collect()
        print("one left", clipping.routed())
        m1(torch.randn(2, 8)).sum().backward()
        print("its model has gradients again", m1.weight.grad is not None)
        del b; gc.collect()
        print("none left", torchs())
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "imported True",
        "built True True",
        "one left True",
        "its model has gradients again True",
        "none left True",
    ]


def test_backward_after_clipping_is_refused():
    model, _, opt = _pair(3)
    opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="after this step's gradients were completed"):
        model(torch.randn(2, 12)).sum().backward()


# ------------------------------------------------------------------------------- Lightning
def _fit(tmp_path, **trainer_kwargs) -> tuple[dict, dict]:
    from lightning_strategies import TinyLM

    module = TinyLM("logra", manual=False, accumulate=1, clip=None)
    module.out_dir = str(tmp_path)
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(module, DataLoader(list(range(4)), batch_size=1))
    return start, {n: p.detach().clone() for n, p in module.named_parameters()}


def _moved(start: dict, end: dict) -> float:
    return sum(float((end[n] - start[n]).norm()) for n in start if n.endswith("weight") and end[n].ndim == 2)


def test_lightning_gradient_clip_val_clips_the_matrices(tmp_path):
    """A clip of 1e-12 makes Adam's steps ~grad/eps tiny: the LoGRA matrices must barely move (they did not stop)."""
    start, free = _fit(tmp_path)
    _, clipped = _fit(tmp_path, gradient_clip_val=1e-12)
    assert _moved(start, clipped) < 0.05 * _moved(start, free)


def test_lightning_clipping_with_kl_step_control(tmp_path):
    """KLStepControl prepares LoGRA's update before Lightning clips: it clips first, so clipping still acts."""
    from logra_lightning.callbacks import KLStepControl

    def control():
        return KLStepControl(target_kl=10.0, min_scale=1.0, max_scale=1.0, sample_tokens=16)  # scale 1: step as is

    start, free = _fit(tmp_path, callbacks=[control()])
    _, clipped = _fit(tmp_path, gradient_clip_val=1e-12, callbacks=[control()])
    assert _moved(start, clipped) < 0.05 * _moved(start, free)


def test_clipping_after_prepare_is_refused():
    model, _, opt = _pair(3)
    opt.prepare_update()
    with pytest.raises(RuntimeError, match="clip before prepare_update"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def test_lightning_value_clipping_is_refused(tmp_path):
    with pytest.raises(ValueError, match="gradient_clip_algorithm='value'"):
        _fit(tmp_path, gradient_clip_val=0.5, gradient_clip_algorithm="value")


def test_fp16_loss_scaling_is_refused():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Linear(16, 6))
    opt = LoGRA(logra_param_groups(model, rank=3), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 12)).pow(2).sum()).backward()
    with pytest.raises(ValueError, match="bf16-mixed"):
        scaler.step(opt)


# ------------------------------------------------------------------------------- logra fit
def test_logra_fit_clipping_options_are_checked():
    with pytest.raises(ConfigError, match="model.gradient_clip_norm=1.0"):
        check_trainer_args({"gradient_clip_val": 1.0})
    with pytest.raises(ConfigError, match="gradient_clip_algorithm='value'"):
        check_trainer_args({"gradient_clip_algorithm": "value"})
    from logra_lightning.rl.module import PolicyGradientModule

    with pytest.raises(ConfigError, match="model.gradient_clip_norm=0"):
        PolicyGradientModule(gradient_clip_norm=0)
    hp = dict(PolicyGradientModule().hparams, gradient_clip_norm=float("nan"))
    with pytest.raises(ConfigError, match="gradient_clip_norm"):
        check_module_args(hp)
