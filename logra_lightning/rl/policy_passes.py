"""Every pass the RL step makes over the policy, on one micro-batch plan per batch.

:class:`PolicyPasses` is a base of :class:`~logra_lightning.rl.module.PolicyGradientModule` and holds
the step's model work between the rollout and the optimizer:

* :meth:`~PolicyPasses._trajectory`: the step's :class:`~logra_lightning.rl.trajectory.Trajectory`
  (packed sequences, group-normalized advantages, the engine's log-probs) and the frozen
  reference's log-probs; with ``ppo_epochs > 1`` a no-grad pass gives pi_old first;
* :meth:`~PolicyPasses._loss_and_backward`: one PPO epoch, loss and ``manual_backward`` per
  micro-batch; with one epoch its own detached log-probs are pi_old's (the module's departure 1);
* :meth:`~PolicyPasses._plan_micro_batches`: rows per micro-batch by token budget
  (:mod:`~logra_lightning.rl.micro_batches`), planned once per batch and as many on every rank;
* :meth:`~PolicyPasses.kl_probe_logits`: the KL probe protocol, whose base logits are recorded by
  whichever pass runs first at the step's starting weights (:class:`~logra_lightning.kl.probe.KLProbe`),
  and :meth:`~PolicyPasses.kl_probe_jvp`, the same positions' logit change along an update in one pass.

It reads the module's ``hparams``, ``policy``, ``tokenizer``, ``device``, ``global_step``,
``trainer``, the frozen reference ``_ref``, the probe state ``_probe`` / ``_kl_probe``, the
padding-free flag ``_packed``, the plan cache ``_plan`` and the phase timer ``_seconds``.

Example::

    >>> from logra_lightning.rl.module import PolicyGradientModule
    >>> issubclass(PolicyGradientModule, PolicyPasses)
    True
"""

from __future__ import annotations

import math
from functools import partial

import torch

from logra_lightning.kl.jvp import Tangent
from logra_lightning.rl.logprobs import sequence_logprobs, token_logprobs
from logra_lightning.rl.loss import LossConfig, grpo_advantages, grpo_loss, tis_weights
from logra_lightning.rl.micro_batches import plan_micro_batches, split_to_count
from logra_lightning.rl.phases import announce_phase
from logra_lightning.rl.trajectory import PackedBatch, Trajectory, logprob_gap, pack_sequences, right_align
from logra_lightning.rollout import Rollout


class PolicyPasses:
    """The trajectory, the PPO epochs' loss and backward, the log-prob passes and the KL probe protocol."""

    def _trajectory(self, prompt_ids: list[list[int]], rollout: Rollout, rewards: torch.Tensor) -> Trajectory:
        """The step's :class:`~logra_lightning.rl.trajectory.Trajectory`: sequences, advantages, and what stays fixed
        over the PPO epochs (the engine's and the reference's logprobs; pi_old's and the TIS weights where
        :meth:`_separate_pi_old_pass`, else the first epoch's training forward fills them in).

        Makes this batch the KL probe's.
        """
        hp = self.hparams
        seqs = pack_sequences(prompt_ids, rollout.completion_ids, self.tokenizer.pad_token_id).to(self.device)
        self._probe = seqs
        self._kl_probe.cache.clear()
        engine_lp = right_align(rollout.logprobs, [len(p) for p in prompt_ids], seqs.targets.shape[1])  # [N, L-1]
        traj = Trajectory(
            seqs=seqs,
            rewards=rewards,
            advantages=grpo_advantages(rewards, hp.group_size, scale_by_std=hp.scale_by_std).to(self.device),  # [N]
            old_logprobs=None,
            engine_logprobs=engine_lp.to(self.device),
        )
        if self._ref:
            with announce_phase(self, "reference", self._seconds):
                traj.ref_logprobs = self._logprobs(seqs, self._ref[0])  # [N, L-1]
        if self._separate_pi_old_pass():
            with announce_phase(self, "pi_old", self._seconds):
                self._set_pi_old(traj, self._logprobs(seqs))  # [N, L-1], no grad
        return traj

    def _separate_pi_old_pass(self) -> bool:
        """Whether pi_old needs a pass of its own: with one epoch it is the training forward itself, detached."""
        return self.hparams.ppo_epochs > 1

    def _set_pi_old(self, traj: Trajectory, old_lp: torch.Tensor) -> None:
        """Fix pi_old's logprobs ``[N, L-1]`` in ``traj``, the TIS weights from them, and the engine's drift."""
        traj.old_logprobs = old_lp
        if self.hparams.tis_cap is not None:
            traj.tis_weights = tis_weights(old_lp, traj.engine_logprobs, self.hparams.tis_cap, traj.seqs.mask)
        self.engine_logprob_gap = logprob_gap(old_lp, traj.engine_logprobs, traj.seqs.mask)

    def _loss_and_backward(self, traj: Trajectory, epoch: int, stats: dict[str, float]) -> bool:
        """One PPO epoch: loss and ``manual_backward`` per micro-batch; False if a loss was not finite.

        Without pi_old's logprobs in ``traj`` (one epoch), each micro-batch's own detached logprobs are
        pi_old's, and once all ran they are stored in ``traj`` (TIS weights and engine drift from them).
        """
        hp, finite = self.hparams, True
        cfg = LossConfig(clip_low=hp.clip_low, clip_high=hp.clip_high, kl_coef=hp.kl_coef)
        own = traj.old_logprobs is None  # this forward is pi_old's
        old_lp = torch.zeros_like(traj.seqs.mask) if own else None  # [N, L-1], filled micro-batch by micro-batch
        probe = self._probe_recorder(traj.seqs) if own else None
        for group in self._plan_micro_batches(traj.seqs):
            rows = torch.as_tensor(group, device=self.device)
            mb = traj.rows(rows).trimmed()
            logprobs, entropy = token_logprobs(
                self.policy,
                mb.seqs,
                hp.temperature,
                entropy=epoch == 0,
                on_logits=None if probe is None else partial(probe.add, rows),
                chunk_size=hp.lm_head_chunk_size,
                packed=self._packed,
            )  # [n, L-1]
            if own:
                mb.old_logprobs = old_lp[rows, : logprobs.shape[1]] = logprobs.detach()
                if hp.tis_cap is not None:
                    mb.tis_weights = tis_weights(mb.old_logprobs, mb.engine_logprobs, hp.tis_cap, mb.seqs.mask)
            loss, st = grpo_loss(logprobs, mb, traj.num_tokens, cfg, entropy=entropy)
            self.manual_backward(loss)  # also on a NaN loss: under DDP every rank must reduce gradients
            finite = finite and math.isfinite(st["loss/policy"])
            for key, value in st.items():  # stats are shares of the batch; entropy is from epoch 0 only
                stats[key] = stats.get(key, 0.0) + (value if key == "policy/entropy" else value / hp.ppo_epochs)
        if own:
            self._set_pi_old(traj, old_lp)
        if probe is not None:
            probe.save(self.policy)
        return finite

    def _logprobs(self, seqs: PackedBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Log-probabilities of the targets ``[N, L-1]`` under ``model`` (default: the policy), micro-batched.

        For the policy, once a :class:`~logra_lightning.callbacks.KLStepControl` has asked for
        probe logits, the logits at this batch's probe positions are kept for its first call.
        """
        probe = self._probe_recorder(seqs) if model is None else None
        lp = sequence_logprobs(
            model or self.policy,
            seqs,
            self._plan_micro_batches(seqs),
            self.hparams.temperature,
            on_logits=probe.add if probe is not None else None,
            chunk_size=self.hparams.lm_head_chunk_size,
            packed=self._packed,
        )
        if probe is not None:
            probe.save(self.policy)
        return lp

    def _probe_recorder(self, seqs: PackedBatch):
        """The KL probe's recorder of this batch's base logits at the current weights, or ``None`` (no probe asked)."""
        # Under autocast these logits differ from the probe's fp32 ones by far more than the probe measures.
        if torch.is_autocast_enabled(self.device.type):
            return None
        return self._kl_probe.base_recorder(seqs, self.global_step)

    def _plan_micro_batches(self, seqs: PackedBatch) -> list[list[int]]:
        """Rows per micro-batch (:func:`~logra_lightning.rl.micro_batches.plan_micro_batches`), as many on every rank.

        Planned once per batch: the ``pi_old``, reference and loss passes use the same micro-batches.
        """
        if self._plan[0] is seqs:
            return self._plan[1]
        hp, lengths = self.hparams, seqs.lengths.tolist()
        plan = plan_micro_batches(
            lengths, max_rows=hp.micro_batch_size, max_tokens=hp.max_tokens_per_micro_batch, packed=self._packed
        )
        if hp.max_tokens_per_micro_batch is not None and self._trainer is not None and self.trainer.world_size > 1:
            # every rank runs as many forward/backward passes (DDP and FSDP2 communicate in each)
            count = int(self.trainer.strategy.reduce(torch.tensor(len(plan), device=self.device), reduce_op="max"))
            plan = split_to_count(plan, count, lengths, self._packed)
        self._plan = (seqs, plan)
        return plan

    @torch.no_grad()
    def kl_probe_logits(self, max_tokens: int) -> torch.Tensor:
        """Logits ``[N, V]`` (N <= ``max_tokens``) at a fixed subsample of the current batch's completion tokens.

        The subsample (whole completions in a seeded order, :func:`~logra_lightning.kl.probe.probe_positions`)
        depends only on the batch and ``global_step``, so every call within one step returns
        the same positions (at whatever the weights are then). The call at unchanged weights reuses
        the logits of the step's first forward, the loss's or ``pi_old``'s
        (:class:`~logra_lightning.kl.probe.ProbeCache`).
        """
        if self._probe is None:
            raise RuntimeError("kl_probe_logits() is only available inside training_step (no batch yet)")
        return self._kl_probe.logits(self.policy, self._probe, self.global_step, max_tokens)

    def kl_probe_jvp(self, max_tokens: int, tangent: Tangent) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[N, V]`` at :meth:`kl_probe_logits`' positions and their derivative along ``tangent``.

        ``tangent(param)`` is the update of ``param`` (``None``: unchanged); one forward-mode pass
        (:func:`~logra_lightning.kl.jvp.logits_and_tangent`) in the caller's autocast.
        """
        if self._probe is None:
            raise RuntimeError("kl_probe_jvp() is only available inside training_step (no batch yet)")
        return self._kl_probe.logits_and_tangent(self.policy, self._probe, self.global_step, max_tokens, tangent)
