"""Tests of predicted-KL step control: the quadratic, the scale it picks, and the callback in a Trainer.

Run: ``.venv/bin/python -m pytest tests/test_kl_control.py -q``
"""

from __future__ import annotations

import copy
import csv
import math

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from logra_lightning.callbacks.kl_control import KLStepControl, is_two_phase
from logra_lightning.kl.estimates import exact_kl, finite_difference_epsilon, softmax_variance_kl
from logra_lightning.optim import LoGRA

torch.set_num_threads(1)

V, T, B = 24, 12, 16
KEYS = {"kl/predicted", "kl/predicted_unscaled", "kl/realized", "kl/step_scale", "kl/calibration"}


class ToyLM(nn.Module):
    """Per-position softmax model with a little context: logits [B, T, V]."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, 32)
        self.mix = nn.Linear(32, 32)
        self.head = nn.Linear(32, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)  # [B, T, H]
        h = h + torch.tanh(self.mix(h.cumsum(1) / torch.arange(1, ids.shape[1] + 1).view(1, -1, 1)))
        return self.head(h)  # [B, T, V]


def sequences(n: int, seed: int) -> list[torch.Tensor]:
    """Counting sequences with a random start and occasional noise: something to learn."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, V, (n, 1), generator=g)
    ids = (start + torch.arange(T + 1)) % V  # [n, T+1]
    noise = torch.rand(ids.shape, generator=g) < 0.1
    return list(torch.where(noise, torch.randint(0, V, ids.shape, generator=g), ids).split(B))


class ToyModule(L.LightningModule):
    def __init__(self, optimizer: str = "logra", lr: float = 3e-2, steps_per_batch: int = 0):
        super().__init__()
        self.net = ToyLM()
        self.optimizer_name, self.lr = optimizer, lr
        self.steps_per_batch = steps_per_batch  # 0: automatic optimization
        self.automatic_optimization = steps_per_batch == 0
        self.batch: torch.Tensor | None = None

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.net(ids[:, :-1])  # [B, T, V]
        return nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))

    def training_step(self, ids, batch_idx):
        self.batch = ids
        if self.automatic_optimization:
            return self.loss(ids)
        opt = self.optimizers()
        for _ in range(self.steps_per_batch):  # PPO-style epochs over one batch
            opt.zero_grad()
            self.manual_backward(self.loss(ids))
            opt.step()

    def kl_probe_logits(self, max_tokens: int) -> torch.Tensor:
        return self.net(self.batch[:, :-1]).reshape(-1, V)[:max_tokens]  # [N, V], fixed positions

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.net.parameters(), lr=self.lr, weight_decay=0.01)
        return LoGRA(list(self.net.named_parameters()), lr=self.lr, rank=4, update_proj_gap=5, weight_decay=0.01)


def fit(module, control, steps, tmp_path=None, **kw):
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        callbacks=[control],
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        logger=CSVLogger(tmp_path, name="csv") if tmp_path else False,
        **kw,
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(sequences(8 * B, 0), batch_size=None))
    return trainer


def prepared(module, opt):
    ids = sequences(B, 1)[0]
    module.batch = ids
    module.loss(ids).backward()
    opt.prepare_update()
    return ids


def test_quadratic_matches_exact_kl_for_tiny_perturbations():
    module = ToyModule()
    opt = module.configure_optimizers()
    prepared(module, opt)
    with torch.no_grad():
        base = module.kl_probe_logits(10_000)  # [B*T, V]
        eps = finite_difference_epsilon(opt.update_max_abs())
        opt.perturb_(eps)
        K = float(softmax_variance_kl(base, (module.kl_probe_logits(10_000).double() - base.double()) / eps))
        opt.perturb_(-eps)
        ratios = []
        for t in (0.02, 0.05, 0.1):  # KL from ~1e-6 to ~1e-4
            opt.perturb_(t)
            ratios.append(float(exact_kl(base, module.kl_probe_logits(10_000))) / (t * t * K))
            opt.perturb_(-t)
    assert 1e-6 < 0.02**2 * K and 0.1**2 * K < 3e-4, K
    for r in ratios:
        assert r == pytest.approx(1.0, abs=0.03), ratios


def test_scale_selection_hits_target():
    target = 1e-3
    control = KLStepControl(target_kl=target, min_scale=0.0, sample_tokens=B * T, measure_every=1)
    fit(ToyModule(lr=0.1), control, steps=8)
    records = list(control.history)
    assert len(records) == 8
    scaled = [r for r in records if r["eta"] < 1.0]
    assert len(scaled) >= 6  # lr=0.1 moves the toy policy well past the target
    first = records[0]
    assert first["calibration"] == 1.0 and first["eta"] < 0.5
    assert first["realized"] == pytest.approx(target, rel=0.05)  # uncalibrated quadratic at the target
    for r in scaled[1:]:  # calibrated predictions
        assert r["realized"] == pytest.approx(target, rel=0.05), [x["realized"] for x in records]


def read_csv_keys(tmp_path) -> set[str]:
    (path,) = list(tmp_path.glob("csv/version_*/metrics.csv"))
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return {k for row in rows for k, v in row.items() if v not in ("", None)}


@pytest.mark.parametrize("optimizer", ["logra", "adamw"])
def test_trainer_logs_metrics_and_bounds_realized_kl(tmp_path, optimizer):
    target = 5e-4
    control = KLStepControl(target_kl=target, min_scale=0.0, sample_tokens=64, measure_every=2)
    trainer = fit(ToyModule(optimizer, lr=0.05), control, steps=8, tmp_path=tmp_path)
    assert is_two_phase(trainer.optimizers[0]) == (optimizer == "logra")
    assert KEYS | {"kl/control_seconds"} <= read_csv_keys(tmp_path)
    measured = [r for r in control.history if r["realized"] is not None]
    assert [r["step"] for r in measured] == [0, 2, 4, 6]
    (path,) = list(tmp_path.glob("csv/version_*/metrics.csv"))
    with open(path) as f:
        rows = list(csv.DictReader(f))
    # realized KL only on measured steps (no stale value re-sent in between), at the step the
    # batch's other metrics have (so the curves line up), which here is the optimizer step
    realized_rows = [r for r in rows if r.get("kl/realized")]
    assert [float(r["kl/realized"]) for r in realized_rows] == pytest.approx(
        [r["realized"] for r in measured], rel=1e-6
    )
    scale_steps = [int(r["step"]) for r in rows if r.get("kl/step_scale")]
    assert scale_steps == list(range(8))
    assert [int(r["step"]) for r in realized_rows] == [0, 2, 4, 6]
    assert min(r["eta"] for r in control.history) < 1.0  # the control acted
    assert all(r["realized"] <= 1.5 * target for r in measured), [r["realized"] for r in measured]
    logged = trainer.callback_metrics
    last = control.history[-1]
    assert float(logged["kl/step_scale"]) == pytest.approx(last["eta"], rel=1e-6)
    assert float(logged["kl/predicted"]) == pytest.approx(last["eta"] ** 2 * last["K"] * last["calibration"], rel=1e-6)


def test_snapshot_fallback_applies_eta_times_the_adamw_step():
    module = ToyModule("adamw", lr=0.05)
    reference = copy.deepcopy(module.net)
    control = KLStepControl(target_kl=1e-4, sample_tokens=64, measure_every=1)
    fit(module, control, steps=1)
    eta = control.history[0]["eta"]
    assert 0.0 < eta < 0.5
    opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.01)
    start = [p.detach().clone() for p in reference.parameters()]
    ids = sequences(8 * B, 0)[0]
    nn.functional.cross_entropy(reference(ids[:, :-1]).reshape(-1, V), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    for p, full, w0 in zip(module.net.parameters(), reference.parameters(), start):
        torch.testing.assert_close(p.detach() - w0, eta * (full.detach() - w0), rtol=1e-4, atol=1e-7)


def test_manual_optimization_several_steps_per_batch():
    target = 5e-4
    control = KLStepControl(target_kl=target, sample_tokens=64, measure_every=1)
    trainer = fit(ToyModule(lr=0.05, steps_per_batch=3), control, steps=9)
    assert trainer.global_step == 9  # one per optimizer step
    assert [r["step"] for r in control.history] == list(range(9))
    assert all(r["realized"] <= 1.5 * target for r in control.history)
    assert any(r["eta"] < 1.0 for r in list(control.history)[3:])  # later epochs on a batch are controlled too


def test_resume_restores_calibration(tmp_path):
    control = KLStepControl(target_kl=1e-3, sample_tokens=64, measure_every=1)
    trainer = fit(ToyModule(lr=0.1), control, steps=4)
    assert control.calibration != 1.0 and control._num_measurements == 4
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["callbacks"]
    assert saved[control.state_key]["calibration"] == pytest.approx(control.calibration)
    assert "target_kl" in control.state_key

    data = torch.utils.data.DataLoader(sequences(8 * B, 0), batch_size=None)
    for target in (1e-3, 2e-3):  # another target is another state_key: its calibration starts afresh
        resumed = KLStepControl(target_kl=target, sample_tokens=64, measure_every=1)
        L.Trainer(
            max_steps=5,
            accelerator="cpu",
            callbacks=[resumed],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(ToyModule(lr=0.1), data, ckpt_path=ckpt)
        first = resumed.history[0]
        if target == 1e-3:
            assert first["step"] == 4
            assert first["calibration"] == pytest.approx(control.calibration, rel=1e-12)
        else:
            assert first["step"] == 0 and first["calibration"] == 1.0


def test_state_dict_round_trip_is_plain_values():
    control = KLStepControl(target_kl=1e-3)
    control._log_cal_ema, control._num_measurements, control._steps = -0.2, 3, 30
    state = control.state_dict()
    assert all(isinstance(v, (int, float)) for v in state.values())
    fresh = KLStepControl(target_kl=1e-3)
    fresh.load_state_dict(state)
    assert fresh.calibration == pytest.approx(control.calibration) and fresh._steps == 30
    assert control.calibration == pytest.approx(math.exp(-0.2 / (1 - 0.7**3)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(target_kl=0.0), r"Invalid target_kl: 0.0 \(must be a finite number > 0\)"),
        (dict(target_kl=float("nan")), r"Invalid target_kl: nan"),
        (dict(target_kl=1e-3, max_scale=0.0), r"Invalid max_scale: 0.0 \(must be a finite number > 0\)"),
        (dict(target_kl=1e-3, min_scale=2.0), r"Invalid min_scale: 2.0 \(must be in \[0, max_scale=1.0\]\)"),
        (dict(target_kl=1e-3, min_scale=-0.1), r"Invalid min_scale: -0.1"),
        (dict(target_kl=1e-3, sample_tokens=0), r"Invalid sample_tokens: 0 \(must be an int >= 1\)"),
        (dict(target_kl=1e-3, measure_every=-1), r"Invalid measure_every: -1 \(must be an int >= 0"),
        (dict(target_kl=1e-3, probe_weight_change=0), r"Invalid probe_weight_change: 0"),
        (dict(target_kl=1e-3, calibration_rate=0.0), r"Invalid calibration_rate: 0.0 \(must be in \(0, 1\]\)"),
        (dict(target_kl=1e-3, calibration_bounds=(2.0, 4.0)), r"Invalid calibration_bounds: \(2.0, 4.0\)"),
    ],
)
def test_argument_validation_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KLStepControl(**kwargs)


def test_setup_rejects_module_without_probe():
    class NoProbe(ToyModule):
        kl_probe_logits = None

    with pytest.raises(MisconfigurationException, match=r"kl_probe_logits\(max_tokens: int\).*NoProbe does not"):
        fit(NoProbe(), KLStepControl(target_kl=1e-3), steps=1)


def test_two_controls_on_one_trainer_are_rejected():
    controls = [KLStepControl(target_kl=1e-3), KLStepControl(target_kl=2e-3)]
    with pytest.raises(MisconfigurationException, match=r"2 `KLStepControl` callbacks.*keep one"):
        L.Trainer(max_steps=1, callbacks=controls, logger=False, accelerator="cpu").fit(ToyModule(), sequences(B, 0))


def test_probe_that_changes_positions_is_reported():
    class Drifting(ToyModule):
        calls = 0

        def kl_probe_logits(self, max_tokens):
            self.calls += 1
            return super().kl_probe_logits(max_tokens - self.calls)

    with pytest.raises(RuntimeError, match="same token positions"):
        fit(Drifting(), KLStepControl(target_kl=1e-3, sample_tokens=64), steps=1)


def test_example_runs_on_the_tiny_qwen2():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "kl_control_in_your_project.py"
    spec = importlib.util.spec_from_file_location("kl_control_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    summary = example.main(["--steps", "6", "--batch-size", "16", "--measure-every", "2", "--sample-tokens", "64"])
    assert summary["max_realized_over_target"] <= 1.5
    assert summary["median_abs_log_ratio"] < math.log(1.5)


def test_calibration_rule_tracks_a_consistent_bias_within_bounds():
    from logra_lightning.kl.estimates import calibration_from_ema, informative_measurement, update_log_calibration

    ema, n = 0.0, 0
    assert calibration_from_ema(ema, n, 0.3, (0.25, 4.0)) == 1.0
    for _ in range(3):  # the quadratic consistently predicts half of what happens
        ema, n = update_log_calibration(ema, n, realized=2e-3, predicted_raw=1e-3, rate=0.3)
        assert calibration_from_ema(ema, n, 0.3, (0.25, 4.0)) == pytest.approx(2.0)
    for _ in range(20):
        ema, n = update_log_calibration(ema, n, realized=1e-3, predicted_raw=1e-1, rate=0.3)
    assert calibration_from_ema(ema, n, 0.3, (0.25, 4.0)) == 0.25  # clamped
    assert informative_measurement(realized=1e-3, predicted_raw=1e-3, target=1e-3)
    assert not informative_measurement(realized=1e-3, predicted_raw=0.9e-6, target=1e-3)  # too small a step
    assert not informative_measurement(realized=float("nan"), predicted_raw=1e-3, target=1e-3)
    assert not informative_measurement(realized=0.0, predicted_raw=1e-3, target=1e-3)
