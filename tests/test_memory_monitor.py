"""MemoryMonitor through a real Trainer and TensorBoard logger.

Run: ``.venv/bin/python -m pytest tests/test_memory_monitor.py -q``
"""

from __future__ import annotations

import gc
import os
import types
from contextlib import nullcontext

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from logra_lightning.callbacks.memory import GB, MemoryMonitor
from logra_lightning.optim import LoGRA, logra_param_groups, optimizer_state_bytes
from logra_lightning.optim.host_memory import bound_kernel_caches, trim
from logra_lightning.rl.phases import announce_phase

torch.set_num_threads(1)
SPIKE_BYTES = 200 * 2**20  # allocated and freed inside the rollout phase


class TinyModule(L.LightningModule):
    """Manual optimization; with ``announce=True`` the step is split into announced phases."""

    def __init__(self, optimizer: str = "adamw", announce: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.optimizer_name, self.announce = optimizer, announce
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))

    def _phase(self, name: str):
        if self.announce:
            return announce_phase(self, name)
        return nullcontext()

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        with self._phase("rollout"):
            spike = torch.ones(SPIKE_BYTES // 4)  # touched pages: a real RSS peak, gone before the phase ends
            del spike
        with self._phase("forward_backward"):
            loss = (self.net(x) - y).pow(2).mean()
            self.manual_backward(loss)
        with self._phase("optimizer"):
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        if self.optimizer_name == "logra":
            return LoGRA(logra_param_groups(self.net, rank=4, update_proj_gap=2), lr=1e-3)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g))
        return DataLoader(data, batch_size=16)


def fit(tmp_path, module: TinyModule, **monitor_kwargs) -> dict[str, list[float]]:
    logger = TensorBoardLogger(tmp_path, name="mem")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[MemoryMonitor(**monitor_kwargs)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    scalars = {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    scalars["_state_bytes"] = [optimizer_state_bytes(trainer.optimizers[0])]
    return scalars


def test_fallback_phases_and_adamw_accounting(tmp_path):
    scalars = fit(tmp_path, TinyModule("adamw", announce=False))
    for phase in ("forward_backward", "optimizer"):
        peak, current = scalars[f"memory/{phase}/peak_gb"], scalars[f"memory/{phase}/current_gb"]
        assert len(peak) == 3
        assert all(p >= c > 0.01 for p, c in zip(peak, current))  # a peak RSS is at least the RSS at the end
    assert not any(k.startswith("memory/rollout") for k in scalars)  # nothing announced
    assert not any(k.endswith("reserved_gb") for k in scalars)  # CUDA only
    assert "memory/engine_rss_gb" not in scalars  # the module has no engine
    n_params = 32 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8
    assert scalars["memory/params_gb"][-1] == pytest.approx(n_params * 4 / GB, rel=1e-6)
    assert scalars["memory/grads_gb"][-1] == pytest.approx(n_params * 4 / GB, rel=1e-6)  # AdamW keeps full grads
    # AdamW: fp32 step scalar + two moments per param
    expected = 6 * 4 + 2 * n_params * 4
    assert scalars["_state_bytes"][0] == expected
    assert scalars["memory/optimizer_state_gb"][-1] == pytest.approx(expected / GB, rel=1e-6)
    # the spike (in the fallback forward_backward phase) is a real peak, seen by the kernel's high-water mark
    fb_peak, fb_current = scalars["memory/forward_backward/peak_gb"], scalars["memory/forward_backward/current_gb"]
    assert max(p - c for p, c in zip(fb_peak, fb_current)) > 0.75 * SPIKE_BYTES / GB


def test_announced_phases_per_rank_and_logra_accounting(tmp_path):
    # LoGRA trims the heap inside backward (optim/host_memory.py): hand back what earlier tests in
    # this process left free first, or the first step's trim shows it as a forward_backward "peak"
    gc.collect()
    trim()
    scalars = fit(tmp_path / "logra", TinyModule("logra", announce=True), per_rank=True)
    pre = "memory/rank0"
    for phase in ("rollout", "forward_backward", "optimizer"):
        assert len(scalars[f"{pre}/{phase}/peak_gb"]) == 3
        assert len(scalars[f"{pre}/{phase}/current_gb"]) == 3
    assert not any(k.startswith("memory/forward_backward") for k in scalars)  # per_rank renames every key

    # the spike lives inside `rollout` only: its peak is ~SPIKE_BYTES above the RSS at its end,
    # while the next phase starts after the buffer is freed and does not see it
    def headroom(phase: str) -> list[float]:
        return [p - c for p, c in zip(scalars[f"{pre}/{phase}/peak_gb"], scalars[f"{pre}/{phase}/current_gb"])]

    rollout, fb = headroom("rollout"), headroom("forward_backward")
    assert min(rollout) > 0.75 * SPIKE_BYTES / GB
    assert max(fb) < 0.25 * SPIKE_BYTES / GB
    logra_state = scalars["_state_bytes"][0]
    assert scalars[f"{pre}/optimizer_state_gb"][-1] == pytest.approx(logra_state / GB, rel=1e-6)

    adamw = fit(tmp_path / "adamw", TinyModule("adamw", announce=True))
    assert adamw["memory/optimizer_state_gb"][-1] == pytest.approx(adamw["_state_bytes"][0] / GB, rel=1e-6)
    assert logra_state < 0.5 * adamw["_state_bytes"][0]
    # LoGRA frees low-rank grads in backward: only the biases' grads are live
    assert scalars[f"{pre}/grads_gb"][-1] == pytest.approx((64 + 64 + 8) * 4 / GB, rel=1e-6)


def test_engine_memory_is_logged_when_the_engine_reports_it(tmp_path):
    module = TinyModule("adamw")
    module.engine = types.SimpleNamespace(rss_bytes=lambda: 3 * 10**9)  # VLLMEngine's: tests/test_vllm_engine.py
    assert fit(tmp_path, module)["memory/engine_rss_gb"] == [3.0, 3.0, 3.0]


def test_kernel_caches_are_bounded_unless_the_user_set_them_and_the_environment_is_left_as_it_was(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "8")
    before = dict(os.environ)
    assert bound_kernel_caches() == ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    assert dict(os.environ) == before


def test_kernel_caches_are_bounded_under_no_grad_and_inference_mode(monkeypatch):
    for context in (torch.no_grad, torch.inference_mode):
        monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
        with context():
            assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in bound_kernel_caches()


def test_refuses_trainer_without_logger():
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        callbacks=[MemoryMonitor()],
        max_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.raises(MisconfigurationException, match="logger=False"):
        trainer.fit(TinyModule())


def test_argument_validation():
    with pytest.raises(ValueError, match="Invalid sample_interval: 0"):
        MemoryMonitor(sample_interval=0)


class FakeProbe:
    """A device whose memory the test sets by hand (stands in for CUDA's allocator counters)."""

    def __init__(self) -> None:
        self.now = self.high = 0

    def set(self, nbytes: int) -> None:
        self.now, self.high = nbytes, max(self.high, nbytes)

    def current(self) -> int:
        return self.now

    def peak(self) -> int:
        return self.high

    def reset_peak(self) -> None:
        self.high = self.now

    def extra(self) -> dict[str, int]:
        return {"reserved_gb": 7 * 10**9}

    def close(self) -> None:
        pass


def test_nested_phases_keep_the_inner_peak_and_report_reserved():
    from types import SimpleNamespace

    logged: dict[str, float] = {}
    module = SimpleNamespace(log_dict=lambda metrics, **kw: logged.update(metrics))
    trainer = SimpleNamespace(training=True, sanity_checking=False)
    monitor, probe = MemoryMonitor(), FakeProbe()
    monitor._probe = probe
    probe.set(1 * 10**9)
    monitor.on_phase_start(trainer, module, "optimizer")
    probe.set(2 * 10**9)
    monitor.on_phase_start(trainer, module, "weight_sync")  # resets the device peak: the outer phase must keep 2 GB
    probe.set(5 * 10**9)
    probe.set(3 * 10**9)
    monitor.on_phase_end(trainer, module, "weight_sync")
    assert (logged["memory/weight_sync/peak_gb"], logged["memory/weight_sync/current_gb"]) == (5.0, 3.0)
    probe.set(1 * 10**9)
    monitor.on_phase_end(trainer, module, "optimizer")
    assert (logged["memory/optimizer/peak_gb"], logged["memory/optimizer/current_gb"]) == (5.0, 1.0)
    assert logged["memory/optimizer/reserved_gb"] == 7.0
    monitor.on_phase_start(trainer, module, "optimizer")  # a second optimizer step in the same batch, lower peak
    monitor.on_phase_end(trainer, module, "optimizer")
    assert logged["memory/optimizer/peak_gb"] == 5.0  # the step's value is the max over its repeats
