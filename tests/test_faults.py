"""Injected faults cost a step, not the run: NaN/inf values, unusable batches, a failing engine, bad rewards.

Each test injects one fault into a short fit of the tiny policy and checks the behaviour
documented in :mod:`logra_lightning.rl.faults`: what is skipped, what is counted, what state
is left untouched, and what the error says when training has to stop.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import lightning as L
import pytest
import torch
from conftest import ListLogger  # tests/conftest.py
from lightning.pytorch.callbacks import ModelCheckpoint

from logra_lightning.data import ArithmeticSource, PromptDataModule
from logra_lightning.errors import TrainingError
from logra_lightning.io.checkpoint import AtomicCheckpointIO
from logra_lightning.optim import LoGRA
from logra_lightning.rl.faults import degenerate_rollout, grads_finite
from logra_lightning.rl.module import PolicyGradientModule
from logra_lightning.rollout import Rollout

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "logra": lambda params: LoGRA(params, lr=1e-3, rank=4, update_proj_gap=50),
}


class Snapshots(L.Callback):
    """Weights and optimizer state before and after each batch, and which batch is running."""

    def __init__(self) -> None:
        self.batch = -1
        self.before: dict[int, tuple] = {}
        self.after: dict[int, tuple] = {}

    @staticmethod
    def _take(trainer, pl_module) -> tuple:
        params = {n: p.detach().clone() for n, p in pl_module.policy.named_parameters()}
        return trainer.global_step, params, copy.deepcopy(trainer.optimizers[0].state_dict()["state"])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch = batch_idx
        self.before[batch_idx] = self._take(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[batch_idx] = self._take(trainer, pl_module)


def assert_untouched(snap: Snapshots, batch: int) -> None:
    (step0, params0, state0), (step1, params1, state1) = snap.before[batch], snap.after[batch]
    assert step1 == step0, "the optimizer stepped"
    for name, p in params0.items():
        assert torch.equal(p, params1[name]), f"{name} changed"
    assert state0.keys() == state1.keys()
    for idx, st in state0.items():
        for key, value in st.items():
            other = state1[idx][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (idx, key)


def fit(tmp_path, optimizer="adamw", max_steps=2, callbacks=(), ckpt_path=None, **kwargs) -> L.Trainer:
    module = PolicyGradientModule(
        "builtin:arithmetic-tiny", optimizer=OPTIMIZERS[optimizer], group_size=4, max_new_tokens=5, **kwargs
    )
    dm = PromptDataModule(ArithmeticSource("train"), None, batch_size=4)
    trainer = L.Trainer(
        max_steps=max_steps,
        default_root_dir=tmp_path,
        logger=False,
        callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        plugins=[AtomicCheckpointIO()],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer


# ---------------------------------------------------------------- non-finite
class NaNLogits(L.Callback):
    """Makes the policy's logits NaN in the loss's forward pass (the one with grad) of the batches ``when`` picks.

    Rollouts and ``pi_old`` run without grad and stay finite, so only the loss is NaN.
    """

    def __init__(self, snap: Snapshots, when) -> None:
        self.snap, self.when = snap, when

    def on_train_start(self, trainer, pl_module):
        def poison(module, args, out):
            return out * math.nan if torch.is_grad_enabled() and self.when(self.snap.batch) else None

        pl_module.policy.lm_head.register_forward_hook(poison)


@pytest.mark.parametrize("optimizer", ["adamw", "logra"])
def test_nan_loss_skips_the_step_without_touching_any_state(tmp_path, tiny_policy_path, optimizer):
    snap = Snapshots()
    with pytest.warns(UserWarning, match=r"non-finite loss at global step 1: optimizer step skipped"):
        trainer = fit(tmp_path, optimizer, max_steps=2, callbacks=[snap, NaNLogits(snap, lambda batch: batch == 1)])
    assert sorted(snap.before) == [0, 1, 2]  # batch 1 was skipped, batch 2 took the second step
    assert_untouched(snap, 1)
    assert trainer.global_step == 2
    assert trainer.logged_metrics["health/skipped_steps"] == 1.0
    assert trainer.lightning_module.faults.consecutive_skips == 0  # reset by the good step after it


@pytest.mark.parametrize("optimizer", ["adamw", "logra"])
def test_inf_gradient_with_finite_loss_skips_the_step(tmp_path, tiny_policy_path, optimizer):
    snap = Snapshots()

    class InfGrad(L.Callback):
        def on_train_start(self, trainer, pl_module):
            w = pl_module.policy.model.layers[0].mlp.down_proj.weight
            w.register_hook(lambda g: g * math.inf if snap.batch == 0 else g)  # LoGRA sketches this into inf

    with pytest.warns(UserWarning, match="non-finite gradients at global step 0"):
        trainer = fit(tmp_path, optimizer, max_steps=1, callbacks=[snap, InfGrad()])
    assert_untouched(snap, 0)
    assert trainer.global_step == 1 and trainer.logged_metrics["health/skipped_steps"] == 1.0


def test_a_skip_on_another_rank_skips_the_step_here(tmp_path, tiny_policy_path):
    snap = Snapshots()

    calls = []

    class OtherRankSawNaN(L.Callback):  # stands in for a rank whose gradients were not finite
        def on_train_start(self, trainer, pl_module):
            real = trainer.strategy.reduce_boolean_decision

            def reduce(ok, all=True):  # per batch: 1st call = "rollout usable?", 2nd = "step finite?"
                calls.append(snap.batch)
                return real(ok and not (snap.batch == 0 and calls.count(0) == 2), all)

            trainer.strategy.reduce_boolean_decision = reduce

    trainer = fit(tmp_path, "logra", max_steps=1, callbacks=[snap, OtherRankSawNaN()])
    assert_untouched(snap, 0)
    assert calls == [0, 0, 1, 1]  # every decision went through the strategy's all-reduce
    assert trainer.logged_metrics["health/skipped_steps"] == 1.0


def test_too_many_consecutive_skips_stop_with_a_resumable_checkpoint(tmp_path, tiny_policy_path):
    snap = Snapshots()
    nan = NaNLogits(snap, lambda batch: batch >= 1)
    with pytest.raises(TrainingError, match=r"3 consecutive steps skipped at global step 1 .*max_consecutive_skips=2"):
        fit(tmp_path, "adamw", max_steps=5, callbacks=[snap, nan], max_consecutive_skips=2)
    halted = tmp_path / "checkpoints" / "halted-step=1.ckpt"
    assert halted.is_file()
    state = torch.load(halted, weights_only=False, map_location="cpu")
    assert state["global_step"] == 1 and state["logra"]["skipped_steps"] == 3
    for name, p in snap.after[0][1].items():  # the weights after the last good step
        assert torch.equal(state["state_dict"][f"policy.{name}"], p), name

    trainer = fit(  # the cause is fixed (no NaNLogits): resume from it
        tmp_path / "resumed", "adamw", max_steps=2, ckpt_path=str(halted)
    )
    assert trainer.global_step == 2


# ------------------------------------------------------------ unusable batches
def test_empty_and_all_truncated_batches_are_skipped_and_counted(tmp_path, tiny_policy_path):
    snap = Snapshots()

    class BreakRollouts(L.Callback):
        def on_train_start(self, trainer, pl_module):
            real = pl_module.engine.generate

            def generate(prompt_ids, n, sampling):
                out = real(prompt_ids, n, sampling)
                if snap.batch == 1:  # every sample cut at max_new_tokens
                    return dataclasses.replace(out, finished=[False] * len(out))
                if snap.batch == 2:  # nothing generated at all
                    return Rollout(
                        out.prompt_ids,
                        [[] for _ in out.completion_ids],
                        [[] for _ in out.logprobs],
                        ["" for _ in out.texts],
                        [False] * len(out),
                        n=n,
                    )
                return out

            pl_module.engine.generate = generate

    with pytest.warns(UserWarning, match="all truncated at global step 1: batch skipped"):
        trainer = fit(tmp_path, "logra", max_steps=2, callbacks=[snap, BreakRollouts()])
    assert sorted(snap.before) == [0, 1, 2, 3]
    assert_untouched(snap, 1)
    assert_untouched(snap, 2)
    assert trainer.logged_metrics["health/skipped_batches"] == 2.0
    assert trainer.logged_metrics["health/skipped_steps"] == 0.0


class EditRollouts(L.Callback):
    """Passes every rollout of the fit's engine through :meth:`edit` (``out``: the rollout, ``n``: samples per
    prompt)."""

    def edit(self, out: Rollout, n: int) -> Rollout:
        raise NotImplementedError

    def on_train_start(self, trainer, pl_module):
        real = pl_module.engine.generate
        pl_module.engine.generate = lambda prompt_ids, n, sampling: self.edit(real(prompt_ids, n, sampling), n)


def test_truncated_reward_replaces_the_score_of_cut_completions_only(tmp_path, tiny_policy_path):
    seen = []

    class CutOddSamples(EditRollouts):  # samples 1, 3, 5, ... reported cut at max_new_tokens
        def edit(self, out, n):
            return dataclasses.replace(out, finished=[i % 2 == 0 for i in range(len(out))])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((pl_module.last_samples.rewards, dict(trainer.callback_metrics)))

    fit(tmp_path, "adamw", max_steps=2, callbacks=[CutOddSamples()], reward=_one_per_char, truncated_reward=-3.0)
    for rewards, metrics in seen:
        assert rewards[1::2] == [-3.0] * (len(rewards) // 2)
        assert all(r >= 0 for r in rewards[0::2])  # finished samples keep their score (a length, >= 0)
        assert metrics["reward/mean"].item() == pytest.approx(sum(rewards) / len(rewards))
        assert metrics["reward/score_mean"].item() > metrics["reward/mean"].item()  # the scores were all >= 0


def _one_per_char(prompts, completions, answers):
    return [float(len(c)) for c in completions]


def test_evaluations_after_a_skipped_batch_are_logged_on_the_training_metrics_axis(tmp_path, tiny_policy_path):
    class CutSecondBatch(EditRollouts):
        rollouts = 0  # the held-out evaluation samples once per prompt, a training rollout n > 1

        def edit(self, out, n):
            self.rollouts += n > 1
            return dataclasses.replace(out, finished=[False] * len(out)) if n > 1 and self.rollouts == 2 else out

    logger = ListLogger()
    module = PolicyGradientModule("builtin:arithmetic-tiny", group_size=4, max_new_tokens=5)
    dm = PromptDataModule(ArithmeticSource("train"), ArithmeticSource("test", test_size=8), batch_size=4)
    trainer = L.Trainer(
        max_steps=2, logger=logger, log_every_n_steps=1, callbacks=[CutSecondBatch()], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="all truncated at global step 1"):
        trainer.fit(module, dm)
    trained = [step for step, m in logger.rows if "perf/step_seconds" in m]
    evaluated = [step for step, m in logger.rows if "val/accuracy" in m]
    assert trainer.global_step == 2 and trained == [0, 1, 2]  # batch 1 was skipped, and logged its health
    assert evaluated == [0, 3]  # before RL, and after the last batch: not at global step 2, among batch 2's metrics
    assert [step for step, _ in module.accuracy_history] == [0, 2]  # the fit summary counts optimizer steps


def test_degenerate_rollout_rule():
    ok = Rollout([[1]], [[5, 1], [6]], [[0.0, 0.0], [0.0]], ["a", "b"], [True, False], n=2)
    assert degenerate_rollout(ok) is None
    assert degenerate_rollout(dataclasses.replace(ok, finished=[False, False])) == "all truncated"
    assert degenerate_rollout(dataclasses.replace(ok, completion_ids=[[], []])) == "empty"


def test_grads_finite_sees_logra_sketches():
    model = torch.nn.Linear(8, 8)
    opt = LoGRA(list(model.named_parameters()), rank=2)
    model(torch.randn(4, 8)).sum().backward()
    assert model.weight.grad is None and grads_finite(opt)  # sketched and freed in backward
    (model(torch.randn(4, 8)) * math.inf).sum().backward()
    assert not grads_finite(opt)
    opt.zero_grad()
    assert grads_finite(opt)


# ------------------------------------------------------------ failing components
def test_engine_failure_stops_naming_the_step_and_keeps_the_last_checkpoint(tmp_path, tiny_policy_path):
    class EngineDiesAtStep2(L.Callback):
        def on_train_start(self, trainer, pl_module):
            real = pl_module.engine.generate

            def generate(prompt_ids, n, sampling):
                if trainer.global_step == 2:
                    raise ConnectionError("engine process died")
                return real(prompt_ids, n, sampling)

            pl_module.engine.generate = generate

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True, save_top_k=0)
    with pytest.raises(TrainingError, match=r"failed at global step 2 \(ConnectionError: engine process died\)") as err:
        fit(tmp_path, "adamw", max_steps=4, callbacks=[ckpt, EngineDiesAtStep2()])
    last = tmp_path / "ckpt" / "last.ckpt"
    assert str(last) in str(err.value) and "--ckpt_path last" in str(err.value)
    assert torch.load(last, weights_only=False, map_location="cpu")["global_step"] == 2


def test_nonfinite_and_raising_rewards_count_as_reward_errors():
    def reward(prompts, completions, answers):
        return [math.nan if c == "nan" else 1.0 for c in completions]

    module = PolicyGradientModule(reward=reward, group_size=2)
    with pytest.warns(UserWarning, match="reward function failed on 1 sample"):
        rewards = module._score(["p", "p"], ["nan", "4"], ["4", "4"])
    assert rewards.tolist() == [0.0, 1.0] and module.faults.reward_errors == 1
