"""``PolicyGradientModule``: GRPO-style RL of a causal LM with manual optimization.

One ``training_step`` is one RL iteration, and reads like a script:
rollout (B prompts x G samples, with sampling logprobs) -> rewards -> group-normalized
advantages -> token-level PPO-clip loss (+ optional k3 KL to a frozen reference) ->
micro-batched ``manual_backward`` -> ``optimizer.step()``. The math is in
:mod:`logra_lightning.rl.loss`; the optimizer comes from the config (``torch.optim.AdamW``
or :class:`~logra_lightning.optim.LoGRA`), the engine from an
:class:`~logra_lightning.rollout.EngineSpec`.

Run: ``logra fit --config configs/arithmetic_tiny.yaml``.

Protocols this module offers to callbacks:

* ``engine`` — the rollout engine (weight sync sends updates to it);
* ``engine_logprob_gap`` — ``(mean, max)`` |engine - trainer| logprob over the latest
  rollout's sampled tokens (drift of the engine's copy of the policy);
* ``kl_probe_logits(max_tokens)`` — logits ``[N, V]`` at a fixed token subsample of the
  current step's batch at the current weights (predicted-KL step control);
* ``kl_probe_jvp(max_tokens, tangent)`` — the same positions' logits and their derivative
  along an update, one forward-mode pass (``KLStepControl(probe="jvp")``);
* phases ``rollout``, ``reference``, ``pi_old``, ``forward_backward``, ``optimizer`` announced through
  :func:`~logra_lightning.rl.phases.announce_phase` (memory monitoring), and timed.

Departures from GRPO as published are listed in :mod:`logra_lightning.rl.loss`. Also:

1. ``old_logprobs`` are the trainer's at the weights the step starts from (not the engine's), so
   with one PPO epoch the ratio is exactly 1 and the loss is the plain policy gradient. Then
   pi_old is the training forward's own log-probs, detached, and no separate pass runs (slime,
   NeMo-RL and prime-rl do the same); the engine drift, the TIS weights and the KL probe's base
   logits come from that forward too. With ``ppo_epochs > 1`` a no-grad pass computes pi_old
   before the first epoch. The engine's logprobs are used to measure drift and for TIS.
2. ``reward/accuracy`` and ``val/accuracy`` count a sample as correct when its reward
   is at least ``correct_reward`` (1.0 by default).
3. Each rollout samples with a seed derived from ``(sampling_seed, rollout index, rank)``,
   not from torch's global RNG, so a run resumed from a checkpoint samples exactly what the
   uninterrupted run sampled (the index is checkpointed; Lightning does not save the global RNG).

Faults (a bad sample, a NaN, an empty batch, a failing engine) cost a step, not the run; the
behaviour for each is tabulated in :mod:`logra_lightning.rl.faults`. The module's bases hold the
rest of the step by job: the passes over the policy on one micro-batch plan
(:class:`~logra_lightning.rl.policy_passes.PolicyPasses`), seeded sampling and rewards
(:class:`~logra_lightning.rl.sampling.EngineSampling`), the step's metrics
(:class:`~logra_lightning.rl.step_metrics.StepMetrics`) and held-out evaluation
(:class:`~logra_lightning.rl.evaluation.HeldOutEvaluation`); argument checks are
:func:`~logra_lightning.config.checks.check_module_args`.

Logged metrics:
    ``reward/mean``, ``reward/std``, ``reward/accuracy`` (of the rewards trained on), ``reward/score_mean`` (with
    ``truncated_reward``: before cut completions are given it), ``reward/errors``, ``val/accuracy``,
    ``loss/policy``, ``policy/entropy``, ``policy/clip_frac``, ``policy/approx_kl``,
    ``policy/ref_kl`` (with ``kl_coef > 0``), ``policy/tis_weight_mean`` (with ``tis_cap``), ``rollout/policy_lag``
    (with ``off_policy_steps``: syncs between the sampling weights and the trained ones), ``completion/length_mean``,
    ``completion/clipped_ratio``, ``perf/step_seconds``, ``perf/tokens_per_second``, ``perf/mfu`` (the training
    phase's model FLOPs utilization against ``perf/peak_tflops``, :mod:`~logra_lightning.rl.throughput`),
    ``perf/time/<phase>``
    (seconds of the step in each phase that ran: ``rollout``, ``reference``, ``pi_old``, ``forward_backward``,
    ``optimizer``, which includes KL step control's ``kl/control_seconds``; the weight sync's is ``sync/seconds``),
    ``health/skipped_steps``, ``health/skipped_batches`` (cumulative counts), ``grad/norm`` (with
    ``gradient_clip_norm``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable
from torchmetrics import MeanMetric
from typing_extensions import override

from logra_lightning.builtin.registry import resolve_model
from logra_lightning.config.checks import check_engine_context, check_module_args
from logra_lightning.data.module import record_fields, repeat_fields
from logra_lightning.errors import ConfigError
from logra_lightning.kl.probe import KLProbe
from logra_lightning.models import load_policy, load_tokenizer
from logra_lightning.models.fsdp import decoder_layers
from logra_lightning.models.lora import LoRA
from logra_lightning.optim.clipping import clip_grad_norm_
from logra_lightning.optim.host_memory import bound_kernel_caches
from logra_lightning.optim.strategy_check import check_strategy_supported
from logra_lightning.rewards import as_reward
from logra_lightning.rl.evaluation import HeldOutEvaluation
from logra_lightning.rl.faults import FaultPolicy, all_ranks_agree, degenerate_rollout, grads_finite
from logra_lightning.rl.lm_head import DEFAULT_CHUNK_SIZE
from logra_lightning.rl.logprobs import position_logits
from logra_lightning.rl.loss import masked_mean
from logra_lightning.rl.micro_batches import use_padding_free
from logra_lightning.rl.offpolicy import OffPolicyQueue, Submitted
from logra_lightning.rl.phases import announce_phase
from logra_lightning.rl.policy_passes import PolicyPasses
from logra_lightning.rl.samples import ScoredSamples
from logra_lightning.rl.sampling import EngineSampling
from logra_lightning.rl.step_metrics import StepMetrics
from logra_lightning.rl.throughput import ModelDims
from logra_lightning.rl.trajectory import PackedBatch
from logra_lightning.rollout import EngineSpec, HFEngineSpec, OffPolicyEngine, SamplingConfig


class PolicyGradientModule(HeldOutEvaluation, PolicyPasses, EngineSampling, StepMetrics, L.LightningModule):
    """GRPO/DAPO-style policy-gradient RL on a causal LM (manual optimization).

    Args:
        model: HF hub name, local HF directory, or ``builtin:arithmetic-tiny`` (built and
            warmed up locally, cached; see :mod:`logra_lightning.builtin.registry`).
        optimizer: optimizer factory (``OptimizerCallable``), called with the policy's
            ``(name, param)`` pairs; e.g. ``torch.optim.AdamW`` or ``logra_lightning.optim.LoGRA``.
        engine: rollout engine spec (default: in-process HF ``generate`` on the policy's weights).
        reward: ``reward(prompts, completions, answers, **fields) -> list[float]`` (default exact match): a
            callable, ``path/to/file.py:function``, ``module.function``, or a list of these (their sum); the
            function gets the record fields it names (:mod:`~logra_lightning.rewards.user`).
        group_size: samples per prompt ``G``.
        max_new_tokens: completion length limit for rollouts.
        temperature, top_p: rollout sampling.
        clip_low, clip_high: PPO clip range ``[1 - clip_low, 1 + clip_high]``.
        scale_by_std: divide advantages by the group std (``False``: Dr. GRPO).
        kl_coef: weight of the k3 KL penalty to a frozen copy of the initial policy (0: off,
            and no reference model is built).
        ppo_epochs: optimizer steps per rollout batch.
        micro_batch_size: sequences per forward/backward (``None``: the whole batch, or as many as
            ``max_tokens_per_micro_batch`` allows).
        max_tokens_per_micro_batch: tokens per forward/backward (``None``: off): rows sorted by
            length and packed first-fit, padding-free where the model supports it, else each
            micro-batch padded to its own longest row (:mod:`~logra_lightning.rl.micro_batches`).
            Also bounds the ``pi_old``/reference passes. A row longer than this runs alone.
        lm_head_chunk_size: tokens per block through the LM head (:mod:`~logra_lightning.rl.lm_head`):
            the logits ``[n, L, V]`` never exist whole, only ``[chunk, V]`` at a time, and only at
            completion tokens. ``None``: whole logits.
        padding_free: with ``max_tokens_per_micro_batch``, run each micro-batch's rows packed in one
            row (``None``: when the model family supports it; ``True``: required; ``False``: padded buckets).
        eval_max_new_tokens: completion limit for held-out greedy evaluation.
        correct_reward: reward at or above which a sample counts as correct.
        activation_checkpointing: enable HF gradient checkpointing on the policy.
        torch_threads: ``torch.set_num_threads`` at setup (``None`` leaves it). On small
            models 1 thread was 10-25x faster than 2 on the 2-core machine (docs/design.md §7).
        kl_probe_seed: seed of the token subsample returned by ``kl_probe_logits``.
        lr_warmup_steps: ramp the learning rate linearly from 0 over this many optimizer steps.
        tis_cap: truncated importance sampling (TIS): weight each token's loss by
            ``min(pi_trainer / pi_engine, tis_cap)`` on the sampled token, correcting for an
            engine whose numerics differ from the trainer's (e.g. vLLM in bf16). ``None``: off.
        max_consecutive_skips: stop (after writing a checkpoint) when more than this many
            steps in a row were skipped (non-finite values or unusable batches); ``None``: never.
        sampling_seed: base seed of the per-rollout sampling seeds (``None``: torch's initial
            seed at setup, i.e. ``seed_everything``'s). Saved in checkpoints.
        adapter: train LoRA factors instead of the weights (:class:`~logra_lightning.models.LoRA`);
            the optimizer then gets only the factors, and the engine, syncs and exports see the merged weights.
        gradient_clip_norm: clip each step's gradients to this global L2 norm (``None``: off); with LoGRA
            the norm covers its sketches (:mod:`~logra_lightning.optim.clipping`). Logs ``grad/norm``
            (before clipping). Lightning's ``trainer.gradient_clip_val`` does not apply to manual optimization.
        off_policy_steps: ``1``: sample the next batch's rollout while this step trains (one step
            off-policy, :mod:`~logra_lightning.rl.offpolicy`; needs an engine that samples in the
            background, ``VLLMServerEngineSpec``, and ``tis_cap``); ``0``: on-policy.
        attn_implementation: the policy's attention kernel (HF's ``attn_implementation``: ``"eager"``,
            ``"sdpa"``, ...; ``None``: the model's default). On CPU under ``bf16-mixed`` with short sequences,
            ``"eager"`` was faster than ``"sdpa"``, whose bf16 backward is slow (docs/speed.md).
        compile: ``torch.compile`` each decoder layer (``dynamic=True``: sequence lengths vary per step), which
            fuses the elementwise work between the matmuls; the first step pays the compilation. One process only.
        peak_flops: one device's peak FLOP/s in the training dtype, the denominator of ``perf/mfu`` (e.g. a
            GPU's datasheet figure); ``None``: measured at the first step by a short matmul
            (:func:`~logra_lightning.rl.throughput.measure_peak_flops`).
        truncated_reward: the reward of a completion cut at ``max_new_tokens``, in place of its score (e.g. ``0``:
            an unfinished answer counts as wrong, so a policy that learns to keep talking after its answer is
            taught to stop; logs ``reward/score_mean``, the mean before it). ``None``: cut completions are scored
            like any other (docs/failures.md).

    Raises:
        ConfigError: an argument out of range (names the key and the allowed range); in
            ``setup``, a prompt longer than the engine allows; in ``configure_optimizers``,
            an optimizer argument the optimizer rejects.
        TrainingError: the rollout engine failed, or too many steps in a row were skipped.

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
        reward: str | Callable | list[str | Callable] | None = None,
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
        max_tokens_per_micro_batch: int | None = None,
        lm_head_chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        padding_free: bool | None = None,
        eval_max_new_tokens: int | None = None,
        correct_reward: float = 1.0,
        activation_checkpointing: bool = False,
        torch_threads: int | None = None,
        kl_probe_seed: int = 0,
        lr_warmup_steps: int = 0,
        max_consecutive_skips: int | None = 10,
        sampling_seed: int | None = None,
        tis_cap: float | None = None,
        adapter: LoRA | None = None,
        gradient_clip_norm: float | None = None,
        off_policy_steps: int = 0,
        peak_flops: float | None = None,
        attn_implementation: str | None = None,
        compile: bool = False,
        truncated_reward: float | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "engine", "reward", "adapter"])
        check_module_args(self.hparams)
        bound_kernel_caches()  # before the first bf16 matmul: packed micro-batches would grow them every step
        self.adapter = adapter
        if adapter is not None:  # as plain values: checkpoints load with weights_only=True, and a resume re-parses it
            self.hparams["adapter"] = adapter.hparams()
        self.automatic_optimization = False
        self.model_spec = model
        self.optimizer_factory = optimizer
        self.engine_spec = engine or HFEngineSpec()
        self.reward_fn = as_reward(reward)
        self.sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        self.policy: torch.nn.Module | None = None
        self.tokenizer = None
        self.engine = None
        self.model_path: str | None = None
        self.engine_logprob_gap: tuple[float, float] | None = None
        self.val_accuracy, self.test_accuracy = MeanMetric(), MeanMetric()
        self.accuracy_history: list[tuple[int, float]] = []
        self._ref: list[torch.nn.Module] = []  # a list keeps the frozen reference out of state_dict
        self._probe: PackedBatch | None = None  # the current step's batch, which the KL probe samples
        self._kl_probe = KLProbe(kl_probe_seed, partial(position_logits, chunk_size=lm_head_chunk_size))
        self._packed = False  # micro-batches run padding-free (decided in setup, from the model)
        self._plan: tuple[PackedBatch | None, list[list[int]]] = (None, [])  # a batch and its rows per micro-batch
        self.faults = FaultPolicy(max_consecutive_skips, max_new_tokens)  # counters checkpointed
        self._fit_started = 0.0
        self._rollouts = 0  # the sampling position (checkpointed)
        self._sampling_seed = sampling_seed
        self._queue = OffPolicyQueue()  # off_policy_steps=1: the batch sampled ahead
        self._seconds: dict[str, float] = {}  # this step's wall time per phase
        self._dims: ModelDims | None = None  # the policy's sizes, for perf/mfu
        self._peak_flops = peak_flops
        self.last_samples: ScoredSamples | None = None  # the latest scored rollout (for the completions callback)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, stage: str) -> None:
        if self.policy is not None:
            return
        if self._trainer is not None:
            check_strategy_supported(self.trainer, self.optimizer_factory)  # before any model is built
            if self.hparams.compile and self.trainer.world_size > 1:
                raise ConfigError(
                    f"model.compile=true is supported on one process only (this run has {self.trainer.world_size}); "
                    "set model.compile=false"
                )
        if self.hparams.torch_threads:
            torch.set_num_threads(self.hparams.torch_threads)
        self.model_path = resolve_model(self.model_spec)
        if self._sampling_seed is None:
            self._sampling_seed = torch.initial_seed()
        dm = self.trainer.datamodule if self._trainer is not None else None
        if hasattr(dm, "use_tokenizer"):  # chat-template prompts (GSM8K/MATH sources) before their lengths are checked
            dm.use_tokenizer(load_tokenizer(self.model_path))
        check_engine_context(
            getattr(self.engine_spec, "options", {}),
            getattr(dm, "train_records", None),
            self.model_path,
            self.model_spec,
            self.hparams.max_new_tokens,
        )  # before policy and engine
        self.policy, self.tokenizer = load_policy(self.model_path)
        if self.hparams.attn_implementation is not None:
            try:
                self.policy.set_attn_implementation(self.hparams.attn_implementation)
            except (ValueError, ImportError) as err:
                raise ConfigError(f"model.attn_implementation={self.hparams.attn_implementation!r}: {err}") from None
        self._dims = ModelDims.of(self.policy)
        self.policy.train()  # from_pretrained returns eval mode; Qwen2 has no dropout, but hooks and callbacks look
        self._packed = use_padding_free(
            self.hparams.max_tokens_per_micro_batch, self.hparams.padding_free, self.policy.config
        )
        if self.hparams.activation_checkpointing:
            self.policy.gradient_checkpointing_enable()
            self.policy.config.use_cache = False
        if self.hparams.kl_coef > 0:
            ref, _ = load_policy(self.model_path)
            self._ref = [ref.eval().requires_grad_(False)]
        self.engine = self.engine_spec.build(self.model_path, self.policy, self.tokenizer)
        if self.hparams.off_policy_steps and not isinstance(self.engine, OffPolicyEngine):
            self.engine.close()
            raise ConfigError(
                f"model.off_policy_steps=1 needs an engine that samples while the trainer trains; "
                f"{type(self.engine).__name__} does not: use logra_lightning.rollout.VLLMServerEngineSpec, "
                "or set model.off_policy_steps=0"
            )
        if self.adapter is not None:  # after the engine: an engine with its own copy copies the base model
            self.policy = self.adapter.attach(self.policy)
            self.engine = self.adapter.engine_view(self.engine)
        if self.hparams.compile:  # last: the layers are compiled as trained (adapter attached), at their first call
            for layer in decoder_layers(self.policy):
                layer.compile(dynamic=True)

    @override
    def configure_model(self) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy

        if self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy):
            from logra_lightning.models.fsdp import shard_policy

            shard_policy(self.policy, self.device_mesh)

    @override
    def configure_optimizers(self):
        try:
            opt = self.optimizer_factory([(n, p) for n, p in self.policy.named_parameters() if p.requires_grad])
            opt = opt if self.adapter is None else self.adapter.wrap_optimizer(opt)
        except ValueError as err:  # torch.optim and LoGRA reject bad hyperparameters with ValueError
            raise ConfigError(f"model.optimizer: {err}") from None
        if not self.hparams.lr_warmup_steps:
            return opt
        # Adam's first steps move every weight by ~lr whatever the gradient's size; on noisy RL
        # gradients a linear ramp keeps those first steps from undoing the warm-up.
        warm = self.hparams.lr_warmup_steps
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / warm, end_factor=1.0, total_iters=warm - 1)
        return {"optimizer": opt, "lr_scheduler": sched}

    @override
    def teardown(self, stage: str) -> None:
        if self.engine is not None and stage == "fit":
            self._queue.drop()  # its rollout is never trained on; the engine finishes it before closing
            self.engine.close()

    # ------------------------------------------------------------- the RL step
    @override
    def training_step(self, batch: dict[str, list], batch_idx: int) -> None:
        start = time.perf_counter()
        self._seconds.clear()
        hp, G = self.hparams, self.hparams.group_size
        prompts, answers, fields = batch["prompt"], batch["answer"], record_fields(batch)
        prompt_ids = [self.tokenizer.encode(p) for p in prompts]

        if hp.off_policy_steps:  # submit this batch, train on the one sampled while the previous step trained
            ahead = Submitted(
                prompts, answers, prompt_ids, self.engine.submit(prompt_ids, G, self._next_sampling()), fields
            )
            if (behind := self._queue.exchange(ahead)) is None:
                return  # the first batch of a fit only fills the pipeline
            prompts, answers, prompt_ids, fields = behind.prompts, behind.answers, behind.prompt_ids, behind.fields
            with announce_phase(self, "rollout", self._seconds):
                rollout = self._checked(lambda: self.engine.wait(behind.pending), len(prompt_ids) * G)
            lag = self.engine.policy_lag(rollout)
            if lag is not None:
                self.log("rollout/policy_lag", float(lag), batch_size=len(prompts))
        else:
            lag = 0
            with announce_phase(self, "rollout", self._seconds):
                rollout = self._generate(prompt_ids, G)
        unusable = degenerate_rollout(rollout)
        if not all_ranks_agree(self._trainer, unusable is None):
            self.faults.skip("batch", unusable or "unusable rollout on another rank", self.trainer, self.global_step)
            self._log_health(rollout, start, len(prompts))
            return
        rewards = self._score(
            [p for p in prompts for _ in range(G)],
            rollout.texts,
            [a for a in answers for _ in range(G)],
            repeat_fields(fields, G),
        )
        if hp.truncated_reward is not None:
            self.log("reward/score_mean", rewards.mean().item(), batch_size=len(prompts))
            rewards = torch.where(torch.tensor(rollout.finished), rewards, hp.truncated_reward)  # [N]
        self.last_samples = ScoredSamples.of(
            self.global_step, prompts, answers, G, rollout.texts, rewards, self.faults.last_parts
        )
        self.log_dict({f"reward/{k}": v for k, v in self.last_samples.part_means().items()}, batch_size=len(prompts))
        traj = self._trajectory([p for p in prompt_ids for _ in range(G)], rollout, rewards)
        stats: dict[str, float] = {}
        for epoch in range(hp.ppo_epochs):
            with announce_phase(self, "forward_backward", self._seconds):
                finite = self._loss_and_backward(traj, epoch, stats)
            with announce_phase(self, "optimizer", self._seconds):
                self._optimizer_step(finite)
        if lag != 0:  # the engine's logprobs are of older weights: their gap to the trainer's is lag, not sync drift
            self.engine_logprob_gap = None
        if traj.tis_weights is not None:
            stats["policy/tis_weight_mean"] = masked_mean(traj.tis_weights, traj.seqs.mask).item()
        self._log_step(stats, rewards, rollout, start, len(prompts))
        self._log_mfu(traj, len(prompts))

    def _optimizer_step(self, finite: bool) -> None:
        """Step, or skip the step on every rank: a non-finite loss, gradient or sketch moves nothing.

        ``zero_grad()`` clears gradients and sketches either way; a skipped step leaves the moments,
        the learning rate and the callbacks' state as they were.
        """
        opt = self.optimizers()
        if all_ranks_agree(self._trainer, finite and grads_finite(opt)):
            if self.hparams.gradient_clip_norm is not None:  # the global norm, LoGRA's sketches included
                norm = clip_grad_norm_(
                    [p for g in opt.param_groups for p in g["params"]], self.hparams.gradient_clip_norm
                )
                self.log("grad/norm", float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            opt.step()
            self.faults.stepped()
            if self.lr_schedulers() is not None:
                self.lr_schedulers().step()
        else:
            self.faults.skip(
                "step", "non-finite loss" if not finite else "non-finite gradients", self.trainer, self.global_step
            )
        opt.zero_grad()

    # ------------------------------------------------------------ checkpoints
    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["logra"] = {
            "accuracy_history": list(self.accuracy_history),
            **self.faults.state_dict(),  # reward_errors, skipped_steps, skipped_batches, consecutive_skips
            "rollouts": self._rollouts,  # the next rollout's sampling seed follows from it
            "sampling_seed": self._sampling_seed,
        }

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("logra", {})
        self.accuracy_history = [tuple(x) for x in state.get("accuracy_history", [])]
        self.faults.load_state_dict(state)
        self._rollouts = state.get("rollouts", 0)
        if state.get("sampling_seed") is not None and self.hparams.sampling_seed is None:
            self._sampling_seed = state["sampling_seed"]
        if self.policy is None:  # restoring outside fit: build the policy so its weights can load
            self.setup("validate")
