"""pi_old from the training forward (one PPO epoch) equals a separate no-grad pass, on real steps.

With one update per rollout, ``PolicyGradientModule`` takes pi_old's log-probs, the TIS weights, the engine
drift and the KL probe's base logits from the training forward itself. Here the same two steps run both ways
(LoGRA, KL step control, TIS, a reference KL, micro-batches) and must agree.

Run: ``.venv/bin/python -m pytest tests/test_pi_old.py -q``
"""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest

from logra_lightning.callbacks import KLStepControl
from logra_lightning.data import ArithmeticSource, PromptDataModule
from logra_lightning.optim import LoGRA
from logra_lightning.rl.module import PolicyGradientModule

# the policy is the warmed-up builtin:arithmetic-tiny, which the fixture builds once (conftest: the run order)
pytestmark = pytest.mark.usefixtures("tiny_policy_path")


class Record(L.Callback):
    """Each step's engine drift and logged metrics."""

    def __init__(self) -> None:
        self.gaps: list[tuple[float, float]] = []
        self.metrics: list[dict[str, float]] = []
        self.phases: list[set[str]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.gaps.append(pl_module.engine_logprob_gap)
        keys = ("loss/", "policy/", "kl/predicted", "kl/realized", "kl/step_scale")
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(keys)})
        self.phases.append({k for k in trainer.callback_metrics if k.startswith("perf/time/")})


def two_steps(separate_pass: bool, monkeypatch, passes: list[int]):
    monkeypatch.setattr(PolicyGradientModule, "_separate_pi_old_pass", lambda self: separate_pass)
    module = PolicyGradientModule(
        "builtin:arithmetic-tiny",
        optimizer=partial(LoGRA, lr=1e-3, rank=8, update_proj_gap=1),  # a refresh every step
        group_size=4,
        max_new_tokens=5,
        micro_batch_size=6,
        kl_coef=0.05,
        tis_cap=2.0,
        sampling_seed=0,
    )
    record = Record()
    control = KLStepControl(target_kl=1e-4, sample_tokens=32, measure_every=1)
    trainer = L.Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[control, record],
    )
    module.setup("fit")
    # count the policy's forward passes: the separate pass adds one per micro-batch
    module.policy.register_forward_pre_hook(lambda *_: passes.append(1))
    start = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    trainer.fit(module, PromptDataModule(ArithmeticSource("train"), None, batch_size=4))
    delta = {n: p.detach() - start[n] for n, p in module.policy.named_parameters()}
    return delta, record


def test_training_forward_gives_what_a_separate_pi_old_pass_gives(monkeypatch):
    one_passes, two_passes = [], []
    one, one_rec = two_steps(False, monkeypatch, one_passes)
    two, two_rec = two_steps(True, monkeypatch, two_passes)
    # 16 rows in micro-batches of 6: 3 training forwards a step; the separate pass adds 3 more
    assert len(two_passes) - len(one_passes) == 2 * 3
    timed = {f"perf/time/{p}" for p in ("rollout", "reference", "forward_backward", "optimizer")}
    assert one_rec.phases == [timed] * 2 and two_rec.phases == [timed | {"perf/time/pi_old"}] * 2
    # Both forwards run the same kernels on the same rows at the same weights, so the log-probs agree to fp32
    # rounding; the steps, metrics and drift that follow from them agree as closely
    for a, b in zip(one_rec.gaps, two_rec.gaps):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7)
    for a, b in zip(one_rec.metrics, two_rec.metrics):
        assert a.keys() == b.keys() and {"kl/predicted", "policy/tis_weight_mean", "policy/ref_kl"} <= a.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
    for name, d in two.items():
        assert float((one[name] - d).abs().max()) <= 1e-5 * float(d.abs().max()) + 1e-8, name
    assert max(float(d.abs().max()) for d in two.values()) > 1e-4  # the steps moved the weights
