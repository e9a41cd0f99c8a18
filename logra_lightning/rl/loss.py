"""Policy-gradient math for GRPO-style RL: advantages and the clipped token loss.

Pure functions with shape comments; :class:`~logra_lightning.rl.module.PolicyGradientModule`
holds the state and calls them (:func:`grpo_loss` once per micro-batch of a
:class:`~logra_lightning.rl.trajectory.Trajectory`; the log-probabilities come from
:mod:`~logra_lightning.rl.logprobs`). Notation: ``B``
prompts, ``G`` samples per prompt, ``T`` completion tokens (right-padded, ``mask`` marks real tokens).

Departures from the GRPO paper (DeepSeekMath), as in recent recipes:

1. The loss is averaged over *all tokens of the batch* (DAPO's token-level mean),
   not per sequence then per group, so long completions are not down-weighted.
2. The PPO clip has separate low/high ranges (DAPO "clip-higher").
3. Advantages may skip the division by the group's std (``scale_by_std=False``,
   Dr. GRPO), which removes a difficulty bias toward near-solved prompts.
4. The KL penalty to a reference is optional and off by default; when on it is the
   k3 estimator added per token.

Example::

    >>> import torch
    >>> grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=2, scale_by_std=False)
    tensor([ 0.5000, -0.5000,  0.0000,  0.0000])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from logra_lightning.rl.trajectory import Trajectory


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalized advantages ``(r - mean_group) [/ (std_group + eps)]``.

    Args:
        rewards: ``[B*G]`` rewards, grouped: rows ``i*G .. i*G+G-1`` share prompt ``i``.
        group_size: ``G``.
        scale_by_std: divide by the group's (unbiased) standard deviation.
        eps: added to the std.

    Returns:
        ``[B*G]`` advantages; a group whose samples all got the same reward gets zeros.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [B*G] with G={group_size} dividing its length, got {tuple(rewards.shape)}")
    r = rewards.view(-1, group_size).float()  # [B, G]
    adv = r - r.mean(dim=1, keepdim=True)  # [B, G]
    if scale_by_std:
        if group_size < 2:
            raise ValueError("scale_by_std=True needs group_size >= 2 (the std of one sample is undefined)")
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)  # [B*G]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 if the mask is empty)."""
    return (x * mask).sum() / mask.sum().clamp_min(1)


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    normalizer: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO-clip loss with separate low/high clip ranges (DAPO).

    ``loss = -sum_t min(rho_t A, clip(rho_t, 1-clip_low, 1+clip_high) A) / normalizer``
    with ``rho_t = exp(logprobs - old_logprobs)``.

    Args:
        logprobs: ``[N, T]`` log pi_theta of the sampled tokens (with grad).
        old_logprobs: ``[N, T]`` log pi_old of the same tokens (no grad).
        advantages: ``[N]`` per-sequence advantages, broadcast over tokens.
        mask: ``[N, T]`` 1 for completion tokens, 0 for padding.
        normalizer: token count to divide by; default ``mask.sum()``. Pass the token
            count of the whole batch when this is one micro-batch of several, so the
            micro-batch losses add up to the full-batch token mean.
        token_weights: ``[N, T]`` per-token weights (no grad), e.g. truncated importance
            ratios ``min(pi_old / pi_engine, C)`` (TIS); ``None`` means 1.

    Returns:
        ``(loss, stats)``; stats (detached): ``clip_frac`` (fraction of tokens where
        the clipped term was chosen), ``approx_kl`` (k3 estimate of KL(old||new)).

    Example::

        >>> lp = torch.zeros(1, 2, requires_grad=True)
        >>> loss, _ = clipped_policy_loss(lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2))
        >>> loss.item()
        -1.0
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    adv = advantages.unsqueeze(-1)  # [N, 1]
    unclipped = ratio * adv  # [N, T]
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv  # [N, T]
    per_token = -torch.minimum(unclipped, clipped)  # [N, T]
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    denom = mask.sum().clamp_min(1) if normalizer is None else normalizer
    loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped < unclipped).to(logprobs.dtype), mask),
            "approx_kl": masked_mean(torch.exp(-log_ratio) - 1 + log_ratio, mask),
        }
    return loss, stats


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): ``exp(ref - lp) - (ref - lp) - 1`` (``[N, T]``, >= 0)."""
    d = ref_logprobs - logprobs  # [N, T]
    return torch.exp(d) - d - 1


def tis_weights(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float, mask: torch.Tensor) -> torch.Tensor:
    """Truncated importance weights ``min(pi_trainer / pi_engine, cap)``: ``[N, T]``, 0 where ``mask`` is 0."""
    return torch.exp(logprobs - engine_logprobs).clamp(max=cap) * mask


@dataclass(frozen=True)
class LossConfig:
    """The loss's settings (the module's ``clip_low``, ``clip_high``, ``kl_coef``)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0


def grpo_loss(
    logprobs: torch.Tensor,
    batch: Trajectory,
    num_tokens: int,
    cfg: LossConfig = LossConfig(),
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The whole loss of one micro-batch: PPO-clip policy term (TIS-weighted) ``+ kl_coef * k3 KL`` to a reference.

    Every term is a sum over this micro-batch's tokens divided by ``num_tokens``, the token
    count of the whole batch, so the losses of a batch's micro-batches add up to the loss of
    the batch at once (its token mean), and so do the stats.

    Args:
        logprobs: ``[n, T]`` log pi_theta of the micro-batch's targets (with grad).
        batch: the micro-batch (``mask``, ``advantages``, ``old_logprobs``, ``tis_weights``, ``ref_logprobs``).
        num_tokens: completion tokens in the whole batch (this micro-batch's and the others').
        cfg: clip range ``[1 - clip_low, 1 + clip_high]`` and the KL term's weight (used when
            ``batch.ref_logprobs`` is set).
        entropy: ``[n, T]`` per-token entropy of the policy (no grad), for the ``policy/entropy`` stat.

    Returns:
        ``(loss, stats)``: ``loss`` a scalar with grad; ``stats`` plain floats, each this
        micro-batch's share of the batch value (sum them over the micro-batches):
        ``loss/policy`` (the loss itself), ``policy/clip_frac``, ``policy/approx_kl``,
        ``policy/entropy`` (with ``entropy``), ``policy/ref_kl`` (with ``ref_logprobs``).

    Example::

        >>> from logra_lightning.rl.trajectory import Trajectory, pack_sequences
        >>> seqs = pack_sequences([[0]], [[1, 2]], pad_id=0)  # one sample, 2 completion tokens
        >>> lp = torch.full((1, 2), -1.0, requires_grad=True)  # = pi_old: ratio 1
        >>> batch = Trajectory(seqs, torch.ones(1), torch.ones(1), lp.detach())
        >>> loss, stats = grpo_loss(lp, batch, num_tokens=4)  # half the batch's tokens
        >>> loss.item(), stats["policy/clip_frac"]
        (-0.5, 0.0)
    """
    mask = batch.seqs.mask
    loss, st = clipped_policy_loss(
        logprobs,
        batch.old_logprobs,
        batch.advantages,
        mask,
        cfg.clip_low,
        cfg.clip_high,
        normalizer=num_tokens,
        token_weights=batch.tis_weights,
    )
    if batch.ref_logprobs is not None:
        ref_kl = (k3_kl(logprobs, batch.ref_logprobs) * mask).sum() / num_tokens  # scalar, this micro-batch's share
        loss = loss + cfg.kl_coef * ref_kl
    share = int(mask.sum()) / max(num_tokens, 1)  # this micro-batch's fraction of the batch's tokens
    stats = {
        "loss/policy": loss.item(),
        "policy/clip_frac": st["clip_frac"].item() * share,
        "policy/approx_kl": st["approx_kl"].item() * share,
    }
    if entropy is not None:
        stats["policy/entropy"] = masked_mean(entropy, mask).item() * share
    if batch.ref_logprobs is not None:
        stats["policy/ref_kl"] = ref_kl.item()
    return loss, stats
