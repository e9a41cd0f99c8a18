"""Tests of ``LowRankWeightSync`` through a real Lightning ``Trainer``, with ``HFEngine(copy_weights=True)``.

The HF engine implements the same update methods as the vLLM engine, so these tests
check the callback's logic exactly (engine weights vs trainer weights); the vLLM path
is tested in ``tests/test_vllm_engine.py``.

Run: ``.venv/bin/python -m pytest tests/test_weight_sync.py -q``
"""

from __future__ import annotations

import copy
import dataclasses

import lightning as L
import pytest
import torch
from conftest import ListLogger  # tests/conftest.py
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from logra_lightning.callbacks.weight_sync import LowRankWeightSync
from logra_lightning.models import TinyModelConfig, build_tiny_model, load_policy
from logra_lightning.optim import LoGRA
from logra_lightning.rollout import HFEngine, LowRankUpdate

torch.set_num_threads(1)

RANK = 4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TinyModelConfig(num_layers=1))


class SyncedModule(L.LightningModule):
    """Manual optimization on a fixed token batch; engine is a private HF copy of the policy."""

    def __init__(self, path: str, optimizer: str = "logra", named_from_module: bool = False, share: bool = False):
        super().__init__()
        self.automatic_optimization = False
        self.policy, self.tokenizer = load_policy(path)
        self.engine = HFEngine(self.policy, self.tokenizer, copy_weights=not share)
        self.optimizer_name, self.named_from_module = optimizer, named_from_module
        self.engine_logprob_gap = None
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 100, (4, 12), generator=g)  # [B, T]

    def _logprobs(self, model) -> torch.Tensor:
        logits = model(self.ids).logits[:, :-1].float()  # [B, T-1, V]
        return torch.log_softmax(logits, -1).gather(-1, self.ids[:, 1:, None]).squeeze(-1)  # [B, T-1]

    def training_step(self, batch, batch_idx):
        with torch.no_grad():  # drift of the engine's copy before this step
            diff = (self._logprobs(self.engine.model) - self._logprobs(self.policy)).abs()
        self.engine_logprob_gap = (diff.mean().item(), diff.max().item())
        opt = self.optimizers()
        loss = -self._logprobs(self.policy).mean()
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        named = list(self.named_parameters() if self.named_from_module else self.policy.named_parameters())
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW([p for _, p in named], lr=1e-2)
        return LoGRA(named, lr=1e-2, weight_decay=0.01, rank=RANK, update_proj_gap=3)

    def train_dataloader(self):
        return DataLoader(list(range(64)), batch_size=1)


class PhaseRecorder(L.Callback):
    def __init__(self) -> None:
        self.phases: list[str] = []

    def on_phase_start(self, trainer, pl_module, name: str) -> None:
        self.phases.append(name)


def fit(module, steps: int, callbacks=(), ckpt_path=None, default_root_dir=None) -> tuple[L.Trainer, ListLogger]:
    logger = ListLogger()
    trainer = L.Trainer(
        max_steps=steps,
        logger=logger,
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        accelerator="cpu",
        default_root_dir=default_root_dir,
        log_every_n_steps=1,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, logger


def assert_engine_matches_policy(module, atol: float = 1e-5) -> None:
    engine = dict(module.engine.model.named_parameters())
    for name, p in module.policy.named_parameters():
        torch.testing.assert_close(engine[name], p, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def expected_lowrank_bytes(policy, basis: bool = True, wire_bytes: int = 4) -> int:
    """Rank accounting per matrix: with its basis r*(m+n) numbers, the coefficient alone r*min(m, n)
    (right sketch [m, r] when m <= n, else left [r, n]); plus every dense (1-D) param's fp32 value."""
    total = 0
    for _, p in policy.named_parameters():
        if p.ndim == 2:
            total += RANK * (sum(p.shape) if basis else min(p.shape)) * wire_bytes
        else:
            total += p.numel() * p.element_size()
    return total


# Which of 6 low-rank syncs carry bases with update_proj_gap=3: the first, and each one after a refresh
# (a refresh after completed steps 0 and 3 takes effect from steps 2 and 5).
BASIS_SYNCS = [True, True, False, False, True, False]


def test_lowrank_syncs_keep_engine_equal_to_trainer(tiny_path):
    module, phases = SyncedModule(tiny_path), PhaseRecorder()
    sync = LowRankWeightSync(full_sync_every=0)
    _, logger = fit(module, steps=6, callbacks=[sync, phases])

    assert_engine_matches_policy(module)
    assert sync.full_syncs == 1 and sync.lowrank_syncs == 6
    assert logger.series("sync/full_syncs") == [1.0] * 7  # start + 6 batches, never another full sync
    dense = sum(p.numel() * 4 for p in module.policy.parameters())
    assert logger.series("sync/dense_bytes")[-1] == dense
    lowrank = logger.series("sync/bytes")[1:]
    with_basis, coef = expected_lowrank_bytes(module.policy), expected_lowrank_bytes(module.policy, basis=False)
    assert lowrank == [float(with_basis if b else coef) for b in BASIS_SYNCS]
    basis_bytes = logger.series("sync/basis_bytes")[1:]
    assert basis_bytes == [float(with_basis - coef if b else 0) for b in BASIS_SYNCS]
    assert lowrank[0] / dense < 0.2 and coef / dense < 0.1
    # drift measured before each step stays at rounding level
    assert max(logger.series("sync/logprob_abs_diff_max")) < 1e-4
    seconds = logger.series("sync/seconds")
    assert len(seconds) == 7 and all(s > 0 for s in seconds)  # every sync (start + 6) was timed
    assert phases.phases.count("weight_sync") == 7


def test_names_are_mapped_to_policy_names(tiny_path):
    """An optimizer built from the module's names ('policy.model...') still sends HF names."""
    module = SyncedModule(tiny_path, named_from_module=True)
    fit(module, steps=2, callbacks=[LowRankWeightSync()])
    assert_engine_matches_policy(module)


def test_periodic_full_sync(tiny_path):
    module, sync = SyncedModule(tiny_path), LowRankWeightSync(full_sync_every=2)
    _, logger = fit(module, steps=5, callbacks=[sync])
    assert sync.full_syncs == 1 + 2  # start, after step 2, after step 4
    assert logger.series("sync/full_syncs") == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    bytes_ = logger.series("sync/bytes")
    assert bytes_[2] == bytes_[0] == logger.series("sync/dense_bytes")[0]
    # step 3 is a low-rank sync right after a full one: it resends the basis it would otherwise skip
    assert BASIS_SYNCS[2] is False and logger.series("sync/basis_bytes")[3] > 0
    assert_engine_matches_policy(module)


def test_optimizer_without_factors_falls_back_to_full_sync(tiny_path):
    module, sync = SyncedModule(tiny_path, optimizer="adamw"), LowRankWeightSync()
    with pytest.warns(UserWarning, match="full weight sync after every step"):
        _, logger = fit(module, steps=3, callbacks=[sync])
    assert sync.full_syncs == 4
    assert logger.series("sync/bytes") == logger.series("sync/dense_bytes")
    assert_engine_matches_policy(module, atol=0)


def test_shared_weights_engine_is_left_alone(tiny_path):
    module = SyncedModule(tiny_path, share=True)
    with pytest.warns(UserWarning, match="nothing to sync"):
        _, logger = fit(module, steps=2, callbacks=[LowRankWeightSync()])
    assert logger.series("sync/bytes") == []


def test_engine_failure_names_the_step_and_keeps_last_checkpoint(tiny_path, tmp_path):
    class FailingEngine(HFEngine):
        calls = 0

        def apply_lowrank_updates(self, updates, dense=()):
            FailingEngine.calls += 1
            if FailingEngine.calls == 3:
                raise RuntimeError("worker died")
            super().apply_lowrank_updates(updates, dense)

    module = SyncedModule(tiny_path)
    module.engine = FailingEngine(module.policy, module.tokenizer, copy_weights=True)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    with pytest.raises(RuntimeError, match="failed at global step 3.*worker died"):
        fit(module, steps=6, callbacks=[LowRankWeightSync(), ckpt], default_root_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["step=1.ckpt", "step=2.ckpt"]


def test_resume_restores_counters_and_full_syncs(tiny_path, tmp_path):
    module = SyncedModule(tiny_path)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    fit(module, steps=2, callbacks=[LowRankWeightSync(full_sync_every=10), ckpt], default_root_dir=tmp_path)

    resumed, sync = SyncedModule(tiny_path), LowRankWeightSync(full_sync_every=10)
    _, logger = fit(resumed, steps=4, callbacks=[sync], ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert sync.full_syncs == 2  # first fit's start sync (restored) + the resume sync
    assert sync.lowrank_syncs == 2 + 2 and sync.steps_since_full == 2
    assert logger.rows[0][0] == 2 and logger.rows[0][1]["sync/full_syncs"] == 2.0  # logged at the resume step
    assert logger.series("sync/basis_bytes")[1] > 0  # the first low-rank sync after resume carries the bases
    assert_engine_matches_policy(resumed)


def test_invalid_argument_is_named():
    with pytest.raises(ValueError, match="full_sync_every: -1"):
        LowRankWeightSync(full_sync_every=-1)
    with pytest.raises(ValueError, match="wire_dtype: 'fp8'"):
        LowRankWeightSync(wire_dtype="fp8")
    with pytest.raises(ValueError, match="check_drift_every: -1"):
        LowRankWeightSync(check_drift_every=-1)
    with pytest.raises(ValueError, match="drift_entries: 0"):
        LowRankWeightSync(drift_entries=0)


def test_drift_check_on_an_engine_that_cannot_report_is_refused_at_start(tiny_path):
    with pytest.raises(RuntimeError, match="HFEngine cannot report .* set check_drift_every: 0"):
        fit(SyncedModule(tiny_path), steps=1, callbacks=[LowRankWeightSync(check_drift_every=1)])


# ------------------------------------------------- the engine keeps the basis (protocol)
def test_engine_refuses_a_coefficient_for_a_basis_it_does_not_hold(tiny_path):
    """A coefficient-only update is applied only onto the basis version it names; anything else is refused
    (naming the param) before any weight changes."""
    policy, tok = load_policy(tiny_path)
    engine = HFEngine(policy, tok, copy_weights=True)
    name = "model.layers.0.self_attn.q_proj.weight"
    m, n = dict(policy.named_parameters())[name].shape
    g = torch.Generator().manual_seed(0)
    coef, basis = torch.randn(m, RANK, generator=g), torch.randn(RANK, n, generator=g)
    first = LowRankUpdate(name, 1.0, coef, basis, basis="right", version="a.1")
    before = {k: v.clone() for k, v in engine.model.named_parameters()}
    with pytest.raises(ValueError, match=f"{name}: the engine holds no basis"):
        engine.apply_lowrank_updates([first.without_basis()])
    engine.apply_lowrank_updates([first])
    w1 = dict(engine.model.named_parameters())[name].clone()
    torch.testing.assert_close(w1, before[name] + coef @ basis)
    with pytest.raises(ValueError, match=f"{name}: the engine holds basis version a.1 .* needs version a.2"):
        engine.apply_lowrank_updates([LowRankUpdate(name, 1.0, coef, None, basis="right", version="a.2")])
    torch.testing.assert_close(dict(engine.model.named_parameters())[name], w1, rtol=0, atol=0)
    engine.apply_lowrank_updates([first.without_basis()])  # the held version: applied onto the kept basis
    torch.testing.assert_close(dict(engine.model.named_parameters())[name], w1 + coef @ basis)


def test_message_carries_the_coefficient_alone_and_a_shared_basis_once():
    from logra_lightning.sync.frames import decode, encode

    m, n, r = 48, 32, 4
    coef, basis = torch.randn(m, r), torch.randn(r, n)
    u = LowRankUpdate("w", 0.9, coef, basis, basis="right", version="s.3")
    (full, _), (alone, buffer) = encode([u]), encode([u.without_basis()])
    assert r * n * 4 <= full["nbytes"] - alone["nbytes"] < r * n * 4 + 64  # the basis (64-byte aligned)
    assert u.without_basis().nbytes == r * m * 4
    (got,), _ = decode(alone, buffer)
    assert got.right is None and torch.equal(got.left, coef) and (got.basis, got.version) == ("right", "s.3")
    pieces = [dataclasses.replace(u, name=f"w{e}", key="w") for e in range(3)]  # expert pieces share a basis
    assert encode(pieces)[0]["nbytes"] - encode(pieces[:1])[0]["nbytes"] == 2 * r * m * 4
    assert all(torch.equal(p.right, basis) for p in decode(*encode(pieces))[0])


def test_logra_versions_follow_refreshes_and_reloads():
    """LoGRA names the basis each update used: the same id until a refresh installs another, a new one after
    load_state_dict (a resumed optimizer never reuses an id)."""
    model = torch.nn.Linear(8, 6, bias=False)
    opt = LoGRA(list(model.named_parameters()), lr=1e-2, rank=2, update_proj_gap=3)
    opt.record_updates = True
    versions = []
    for _ in range(7):
        model(torch.randn(4, 8)).pow(2).sum().backward()
        used = opt.state[model.weight]["basis"]  # [n, r]
        opt.step()
        opt.zero_grad()
        (step,) = opt.pop_applied_updates()
        versions.append(step[0].version)
        assert step[0].basis == "right" and torch.equal(step[0].right, used.T)
    new = [i for i in range(7) if i == 0 or versions[i] != versions[i - 1]]
    assert new == [0, 1, 4]  # the steps that carry bases in the callback (BASIS_SYNCS)
    opt.load_state_dict(opt.state_dict())  # the same basis values, loaded into new tensors
    model(torch.randn(4, 8)).pow(2).sum().backward()
    opt.step()
    assert opt.pop_applied_updates()[0][0].version not in versions
    twin = copy.deepcopy(model)
    opt2 = LoGRA(list(twin.named_parameters()), lr=1e-2, rank=2, update_proj_gap=3)
    opt2.load_state_dict(opt.state_dict())
    opt2.record_updates = True
    twin(torch.randn(4, 8)).pow(2).sum().backward()
    opt2.step()
    assert opt2.pop_applied_updates()[0][0].version not in versions  # another optimizer: never the same id


@pytest.mark.parametrize("match", [True, False])
def test_bf16_wire_halves_the_bytes_and_matching_keeps_engine_equal(tiny_path, match):
    module = SyncedModule(tiny_path)
    sync = LowRankWeightSync(wire_dtype="bfloat16", match_rounding=match)
    _, logger = fit(module, steps=6, callbacks=[sync])
    lowrank = logger.series("sync/bytes")[1:]
    dense_part = expected_lowrank_bytes(module.policy, basis=False, wire_bytes=0)
    assert lowrank == [float(expected_lowrank_bytes(module.policy, basis=b, wire_bytes=2)) for b in BASIS_SYNCS]
    assert lowrank[2] - dense_part == (expected_lowrank_bytes(module.policy, basis=False) - dense_part) / 2
    engine = dict(module.engine.model.named_parameters())
    worst = max(float((engine[n] - p).abs().max()) for n, p in module.policy.named_parameters())
    if match:  # the trainer applied the rounded update too: equal up to fp32 arithmetic
        assert worst < 1e-5
    else:  # the engine got the rounded update: bf16's 2^-9 relative error of each step's update
        assert 1e-5 < worst < 1e-2
