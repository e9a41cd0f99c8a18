"""``PolicyGradientModule``: GRPO-style RL of a causal LM with manual optimization.

One ``training_step`` is one RL iteration, and reads like a script:
rollout (B prompts x G samples, with sampling logprobs) -> rewards -> group-normalized
advantages -> token-level PPO-clip loss (+ optional k3 KL to a frozen reference) ->
micro-batched ``manual_backward`` -> ``optimizer.step()``. The math is in
:mod:`logra_lightning.grpo`; the optimizer comes from the config (``torch.optim.AdamW``
or :class:`~logra_lightning.optim.LoGRA`), the engine from an
:class:`~logra_lightning.rollout.EngineSpec`.

Run: ``logra fit --config configs/arithmetic_tiny.yaml``.

Protocols this module offers to callbacks:

* ``engine`` — the rollout engine (weight sync sends updates to it);
* ``engine_logprob_gap`` — ``(mean, max)`` |engine - trainer| logprob over the latest
  rollout's sampled tokens (drift of the engine's copy of the policy);
* ``kl_probe_logits(max_tokens)`` — logits ``[N, V]`` at a fixed token subsample of the
  current step's batch at the current weights (predicted-KL step control);
* phases ``rollout``, ``forward_backward``, ``optimizer`` announced through
  :func:`~logra_lightning.phases.announce_phase` (memory monitoring).

Departures from GRPO as published are listed in :mod:`logra_lightning.grpo`. Also:

1. ``old_logprobs`` are recomputed by the trainer on the rollout (not taken from the
   engine), so with one PPO epoch the ratio is exactly 1 and the loss is the plain
   policy gradient; the engine's logprobs are used to measure drift.
2. ``reward/accuracy`` and ``val/accuracy`` count a sample as correct when its reward
   is at least ``correct_reward`` (1.0 by default).

Logged metrics:
    ``reward/mean``, ``reward/std``, ``reward/accuracy``, ``reward/errors``, ``val/accuracy``,
    ``loss/policy``, ``policy/entropy``, ``policy/clip_frac``, ``policy/approx_kl``,
    ``policy/ref_kl`` (with ``kl_coef > 0``), ``completion/length_mean``,
    ``completion/clipped_ratio``, ``perf/step_seconds``, ``perf/tokens_per_second``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchmetrics import MeanMetric
from typing_extensions import override

from logra_lightning.errors import ConfigError
from logra_lightning.grpo import clipped_policy_loss, gather_logprobs, grpo_advantages, k3_kl, masked_mean, token_entropy
from logra_lightning.models import load_policy
from logra_lightning.optim.strategy_check import check_strategy_supported
from logra_lightning.phases import announce_phase
from logra_lightning.rewards import ExactMatchReward, safe_rewards
from logra_lightning.rollout import EngineSpec, HFEngineSpec, Rollout, SamplingConfig
from logra_lightning.sequences import PackedBatch, pack_sequences, right_align
from logra_lightning.warmup import resolve_model


def _check(key: str, ok: bool, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"model.{key}={value!r}: allowed {allowed}")


class PolicyGradientModule(L.LightningModule):
    """GRPO/DAPO-style policy-gradient RL on a causal LM (manual optimization).

    Args:
        model: HF hub name, local HF directory, or ``builtin:arithmetic-tiny`` (built and
            warmed up locally, cached; see :mod:`logra_lightning.warmup`).
        optimizer: optimizer factory (``OptimizerCallable``), called with the policy's
            ``(name, param)`` pairs; e.g. ``torch.optim.AdamW`` or ``logra_lightning.optim.LoGRA``.
        engine: rollout engine spec (default: in-process HF ``generate`` on the policy's weights).
        reward: ``reward(prompts, completions, answers) -> list[float]`` (default exact match).
        group_size: samples per prompt ``G``.
        max_new_tokens: completion length limit for rollouts.
        temperature, top_p: rollout sampling.
        clip_low, clip_high: PPO clip range ``[1 - clip_low, 1 + clip_high]``.
        scale_by_std: divide advantages by the group std (``False``: Dr. GRPO).
        kl_coef: weight of the k3 KL penalty to a frozen copy of the initial policy (0: off,
            and no reference model is built).
        ppo_epochs: optimizer steps per rollout batch.
        micro_batch_size: sequences per forward/backward (``None``: the whole batch).
        eval_max_new_tokens: completion limit for held-out greedy evaluation.
        correct_reward: reward at or above which a sample counts as correct.
        activation_checkpointing: enable HF gradient checkpointing on the policy.
        torch_threads: ``torch.set_num_threads`` at setup (``None`` leaves it). On small
            models 1 thread was 10-25x faster than 2 on the 2-core machine (DESIGN.md §5).
        kl_probe_seed: seed of the token subsample returned by ``kl_probe_logits``.

    Raises:
        ConfigError: an argument out of range (names the key and the allowed range).

    Example::

        >>> import lightning as L
        >>> from logra_lightning.data import ArithmeticSource, PromptDataModule
        >>> module = PolicyGradientModule("builtin:arithmetic-tiny", group_size=4)
        >>> dm = PromptDataModule(ArithmeticSource("train"), ArithmeticSource("test"), batch_size=8)
        >>> trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False)
        >>> trainer.fit(module, dm)  # doctest: +SKIP
    """

    def __init__(
        self,
        model: str = "builtin:arithmetic-tiny",
        optimizer: OptimizerCallable = torch.optim.AdamW,
        engine: EngineSpec | None = None,
        reward: Callable | None = None,
        group_size: int = 8,
        max_new_tokens: int = 6,
        temperature: float = 1.0,
        top_p: float = 1.0,
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        scale_by_std: bool = True,
        kl_coef: float = 0.0,
        ppo_epochs: int = 1,
        micro_batch_size: int | None = None,
        eval_max_new_tokens: int | None = None,
        correct_reward: float = 1.0,
        activation_checkpointing: bool = False,
        torch_threads: int | None = 1,
        kl_probe_seed: int = 0,
    ) -> None:
        super().__init__()
        _check("group_size", isinstance(group_size, int) and group_size >= 1, group_size, "integers >= 1")
        _check("group_size", group_size >= 2 or not scale_by_std, group_size,
               ">= 2 when scale_by_std=True (the std of one sample is undefined); set scale_by_std=false")  # fmt: skip
        _check("max_new_tokens", isinstance(max_new_tokens, int) and max_new_tokens >= 1, max_new_tokens, "integers >= 1")
        _check("temperature", temperature > 0, temperature, "values > 0")
        _check("top_p", 0 < top_p <= 1, top_p, "values in (0, 1]")
        _check("clip_low", 0 <= clip_low < 1, clip_low, "values in [0, 1)")
        _check("clip_high", clip_high >= 0, clip_high, "values >= 0")
        _check("kl_coef", kl_coef >= 0, kl_coef, "values >= 0")
        _check("ppo_epochs", isinstance(ppo_epochs, int) and ppo_epochs >= 1, ppo_epochs, "integers >= 1")
        _check("micro_batch_size", micro_batch_size is None or micro_batch_size >= 1, micro_batch_size,
               "None or integers >= 1")  # fmt: skip
        _check("torch_threads", torch_threads is None or torch_threads >= 1, torch_threads, "None or integers >= 1")
        self.save_hyperparameters(ignore=["optimizer", "engine", "reward"])
        self.automatic_optimization = False
        self.model_spec = model
        self.optimizer_factory = optimizer
        self.engine_spec = engine or HFEngineSpec()
        self.reward_fn = reward or ExactMatchReward()
        self.sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        self.policy: torch.nn.Module | None = None
        self.tokenizer = None
        self.engine = None
        self.model_path: str | None = None
        self.engine_logprob_gap: tuple[float, float] | None = None
        self.val_accuracy = MeanMetric()
        self.accuracy_history: list[tuple[int, float]] = []
        self._ref: list[torch.nn.Module] = []  # a list keeps the frozen reference out of state_dict
        self._probe: PackedBatch | None = None
        self._reward_errors = 0
        self._fit_started = 0.0

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, stage: str) -> None:
        if self.policy is not None:
            return
        if self._trainer is not None:
            check_strategy_supported(self.trainer, self.optimizer_factory)  # before any model is built
        if self.hparams.torch_threads:
            torch.set_num_threads(self.hparams.torch_threads)
        self.model_path = resolve_model(self.model_spec)
        self.policy, self.tokenizer = load_policy(self.model_path)
        self.policy.train()  # from_pretrained returns eval mode; Qwen2 has no dropout, but hooks and callbacks look
        if self.hparams.activation_checkpointing:
            self.policy.gradient_checkpointing_enable()
            self.policy.config.use_cache = False
        if self.hparams.kl_coef > 0:
            ref, _ = load_policy(self.model_path)
            self._ref = [ref.eval().requires_grad_(False)]
        self.engine = self.engine_spec.build(self.model_path, self.policy, self.tokenizer)

    @override
    def configure_model(self) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy

        if self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy):
            from logra_lightning.fsdp import shard_policy

            shard_policy(self.policy, self.device_mesh)

    @override
    def configure_optimizers(self):
        return self.optimizer_factory(list(self.policy.named_parameters()))

    @override
    def teardown(self, stage: str) -> None:
        if self.engine is not None and stage == "fit":
            self.engine.close()

    # ------------------------------------------------------------- the RL step
    @override
    def training_step(self, batch: dict[str, list], batch_idx: int) -> None:
        start = time.perf_counter()
        hp, opt = self.hparams, self.optimizers()
        G = hp.group_size
        prompts, answers = batch["prompt"], batch["answer"]
        prompt_ids = [self.tokenizer.encode(p) for p in prompts]

        with announce_phase(self, "rollout"):
            rollout = self.engine.generate(prompt_ids, n=G, sampling=self.sampling)
        rewards = self._score([p for p in prompts for _ in range(G)], rollout.texts, [a for a in answers for _ in range(G)])
        adv = grpo_advantages(rewards, G, scale_by_std=hp.scale_by_std).to(self.device)  # [B*G]

        seqs = pack_sequences([p for p in prompt_ids for _ in range(G)], rollout.completion_ids,
                              self.tokenizer.pad_token_id).to(self.device)  # fmt: skip
        old_lp = self._logprobs(seqs)  # [N, L-1], no grad: pi_old
        self._measure_engine_gap(rollout, seqs, old_lp, [len(p) for p in prompt_ids for _ in range(G)])
        ref_lp = self._logprobs(seqs, self._ref[0]) if self._ref else None
        self._probe = seqs

        n_tokens = seqs.num_tokens
        micro = hp.micro_batch_size or len(seqs.ids)
        stats: dict[str, float] = {"loss/policy": 0.0, "policy/clip_frac": 0.0, "policy/approx_kl": 0.0,
                                   "policy/entropy": 0.0, "policy/ref_kl": 0.0}  # fmt: skip
        for epoch in range(hp.ppo_epochs):
            with announce_phase(self, "forward_backward"):
                for lo in range(0, len(seqs.ids), micro):
                    rows = slice(lo, lo + micro)
                    mb = seqs.rows(rows)
                    logits = self.policy(input_ids=mb.ids, attention_mask=mb.attention_mask).logits[:, :-1]  # [n, L-1, V]
                    lp = gather_logprobs(logits, mb.targets, hp.temperature)  # [n, L-1]
                    loss, st = clipped_policy_loss(lp, old_lp[rows], adv[rows], mb.mask, hp.clip_low, hp.clip_high,
                                                   normalizer=n_tokens)  # fmt: skip
                    if ref_lp is not None:
                        ref_kl = (k3_kl(lp, ref_lp[rows]) * mb.mask).sum() / n_tokens
                        loss = loss + hp.kl_coef * ref_kl
                        stats["policy/ref_kl"] += ref_kl.item() / hp.ppo_epochs
                    self.manual_backward(loss)
                    w = mb.num_tokens / max(n_tokens, 1) / hp.ppo_epochs  # token weight of this micro-batch
                    stats["loss/policy"] += loss.item() / hp.ppo_epochs
                    stats["policy/clip_frac"] += st["clip_frac"].item() * w
                    stats["policy/approx_kl"] += st["approx_kl"].item() * w
                    if epoch == 0:
                        with torch.no_grad():
                            ent = masked_mean(token_entropy(logits.detach() / hp.temperature), mb.mask)
                        stats["policy/entropy"] += ent.item() * mb.num_tokens / max(n_tokens, 1)
            with announce_phase(self, "optimizer"):
                opt.step()
                opt.zero_grad()
        if ref_lp is None:
            stats.pop("policy/ref_kl")

        seconds = time.perf_counter() - start
        lengths = [len(c) for c in rollout.completion_ids]
        self.log_dict(stats, batch_size=len(prompts))
        self.log_dict({
            "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "reward/errors": float(self._reward_errors),
            "completion/length_mean": sum(lengths) / len(lengths),
            "completion/clipped_ratio": 1.0 - sum(rollout.finished) / len(rollout.finished),
            "perf/step_seconds": seconds,
            "perf/tokens_per_second": sum(lengths) / seconds,
        }, batch_size=len(prompts))  # fmt: skip
        self.log_dict({"reward/mean": rewards.mean().item(),
                       "reward/accuracy": (rewards >= hp.correct_reward).float().mean().item()},
                      prog_bar=True, batch_size=len(prompts))  # fmt: skip

    def _score(self, prompts: list[str], completions: list[str], answers: list[str]) -> torch.Tensor:
        values, errors, first = safe_rewards(self.reward_fn, prompts, completions, answers)
        if errors:
            if not self._reward_errors:
                rank_zero_warn(f"reward function failed on {errors} sample(s) at step {self.global_step} "
                               f"(they get reward 0; counted in reward/errors). First error: {first}")  # fmt: skip
            self._reward_errors += errors
        return torch.tensor(values, dtype=torch.float32)  # [N]

    @torch.no_grad()
    def _logprobs(self, seqs: PackedBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Log-probabilities of the targets ``[N, L-1]`` under ``model`` (default: the policy), micro-batched."""
        model = model or self.policy
        micro = self.hparams.micro_batch_size or len(seqs.ids)
        out = []
        for lo in range(0, len(seqs.ids), micro):
            mb = seqs.rows(slice(lo, lo + micro))
            logits = model(input_ids=mb.ids, attention_mask=mb.attention_mask).logits[:, :-1]  # [n, L-1, V]
            out.append(gather_logprobs(logits, mb.targets, self.hparams.temperature))
        return torch.cat(out)

    def _measure_engine_gap(self, rollout: Rollout, seqs: PackedBatch, trainer_lp: torch.Tensor, plens: list[int]) -> None:
        engine_lp = right_align(rollout.logprobs, plens, trainer_lp.shape[1]).to(trainer_lp.device)  # [N, L-1]
        diff = (engine_lp - trainer_lp).abs() * seqs.mask
        self.engine_logprob_gap = ((diff.sum() / seqs.mask.sum().clamp_min(1)).item(), diff.max().item())

    # ---------------------------------------------------------- KL probe protocol
    @torch.no_grad()
    def kl_probe_logits(self, max_tokens: int) -> torch.Tensor:
        """Logits ``[N, V]`` (N <= ``max_tokens``) at a fixed subsample of the current batch's completion tokens.

        The subsample depends only on the batch and ``global_step``, so every call within
        one step returns the same positions (at whatever the weights are then).
        """
        if self._probe is None:
            raise RuntimeError("kl_probe_logits() is only available inside training_step (no batch yet)")
        seqs = self._probe
        pos = seqs.mask.nonzero()  # [M, 2] (row, position)
        gen = torch.Generator().manual_seed(self.hparams.kl_probe_seed * 1_000_003 + self.global_step)
        pick = pos[torch.randperm(len(pos), generator=gen)[:max_tokens].to(pos.device)]  # [N, 2]
        rows = pick[:, 0].unique()  # sorted
        sub = seqs.rows(rows)
        logits = self.policy(input_ids=sub.ids, attention_mask=sub.attention_mask).logits[:, :-1]  # [R, L-1, V]
        local_row = torch.searchsorted(rows, pick[:, 0])
        return logits[local_row, pick[:, 1]].float()  # [N, V]

    # ------------------------------------------------------------- evaluation
    @override
    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        correct = self._greedy_correct(batch["prompt"], batch["answer"])
        self.val_accuracy.update(correct)
        self.log("val/accuracy", self.val_accuracy, prog_bar=True, batch_size=len(correct))

    def _greedy_correct(self, prompts: list[str], answers: list[str]) -> torch.Tensor:
        hp = self.hparams
        sampling = SamplingConfig(max_new_tokens=hp.eval_max_new_tokens or hp.max_new_tokens, temperature=0.0)
        out = self.engine.generate([self.tokenizer.encode(p) for p in prompts], n=1, sampling=sampling)
        return (self._score(prompts, out.texts, answers) >= hp.correct_reward).float()

    def evaluate(self) -> float | None:
        """Greedy held-out accuracy over the datamodule's whole validation set (``None`` without one)."""
        dm = self.trainer.datamodule
        records = getattr(dm, "val_records", None)
        if not records:
            return None
        size = getattr(dm, "val_batch_size", 64)
        hits = [self._greedy_correct([r["prompt"] for r in records[i : i + size]], [r["answer"] for r in records[i : i + size]])
                for i in range(0, len(records), size)]  # fmt: skip
        return torch.cat(hits).mean().item()

    @override
    def on_train_start(self) -> None:
        self._fit_started = time.perf_counter()
        acc = self.evaluate()
        if acc is not None:
            self.accuracy_history.append((self.global_step, acc))
            for logger in self.loggers:
                logger.log_metrics({"val/accuracy": acc}, step=self.global_step)

    @override
    def on_fit_end(self) -> None:
        if not self.accuracy_history:
            return
        acc = self.evaluate()
        self.accuracy_history.append((self.global_step, acc))
        for logger in self.loggers:
            logger.log_metrics({"val/accuracy": acc}, step=self.global_step)
        before = self.accuracy_history[0][1]
        summary = {"accuracy_before": before, "accuracy_after": acc, "steps": self.global_step,
                   "train_seconds": time.perf_counter() - self._fit_started, "log_dir": self.trainer.log_dir}  # fmt: skip
        if self.trainer.is_global_zero and self.trainer.log_dir:
            Path(self.trainer.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.trainer.log_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
        rank_zero_info(
            f"\nheld-out greedy accuracy: before RL {before:.1%} -> after {self.global_step} RL steps {acc:.1%} "
            f"({'+' if acc >= before else ''}{100 * (acc - before):.1f} points, {summary['train_seconds']:.0f} s)\n"
            f"TensorBoard logs: {self.trainer.log_dir}   (view: tensorboard --logdir runs)"
        )

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["logra"] = {"accuracy_history": list(self.accuracy_history), "reward_errors": self._reward_errors}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("logra", {})
        self.accuracy_history = [tuple(x) for x in state.get("accuracy_history", [])]
        self._reward_errors = state.get("reward_errors", 0)
        if self.policy is None:  # restoring outside fit: build the policy so its weights can load
            self.setup("validate")
