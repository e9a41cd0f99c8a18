"""Advantage and loss math against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from logra_lightning.rl.logprobs import gather_logprobs, token_entropy
from logra_lightning.rl.loss import (
    LossConfig,
    clipped_policy_loss,
    grpo_advantages,
    grpo_loss,
    k3_kl,
    masked_mean,
    tis_weights,
)
from logra_lightning.rl.trajectory import PackedBatch, Trajectory, pack_sequences, right_align


def test_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])  # B=2 groups of G=3
    adv = grpo_advantages(rewards, group_size=3, scale_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3]))
    # unbiased std of (1, 0, 0) is sqrt(1/3)
    std_adv = grpo_advantages(rewards, group_size=3, scale_by_std=True, eps=0.0)
    torch.testing.assert_close(std_adv[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3]) / math.sqrt(1 / 3))


def test_equal_rewards_give_zero_advantage():
    adv = grpo_advantages(torch.ones(4), group_size=4)
    assert torch.equal(adv, torch.zeros(4))


def test_advantage_errors_name_the_problem():
    with pytest.raises(ValueError, match="G=3"):
        grpo_advantages(torch.ones(4), group_size=3)
    with pytest.raises(ValueError, match="group_size >= 2"):
        grpo_advantages(torch.ones(4), group_size=1, scale_by_std=True)


def test_clipped_loss_by_hand():
    # two tokens of one sequence, advantage +1: ratios e^0.5 (clipped at 1.28) and e^-0.5 (not clipped: min picks it)
    old = torch.zeros(1, 2)
    lp = torch.tensor([[0.5, -0.5]], requires_grad=True)
    loss, stats = clipped_policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2), clip_low=0.2, clip_high=0.28)
    expected = -(1.28 + math.exp(-0.5)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # the clipped token has no gradient; the other has d/dlp of -e^lp / 2
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -math.exp(-0.5) / 2]]))


def test_clipped_loss_negative_advantage_clips_low():
    old = torch.zeros(1, 1)
    lp = torch.tensor([[-1.0]], requires_grad=True)  # ratio e^-1 = 0.37 < 0.8
    loss, stats = clipped_policy_loss(lp, old, torch.tensor([-2.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(0.8 * 2.0)  # -min(-0.74, -1.6) = 1.6
    assert stats["clip_frac"].item() == 1.0


def test_mask_and_normalizer():
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = clipped_policy_loss(lp, torch.zeros(2, 3), torch.tensor([1.0, 2.0]), mask)
    assert loss.item() == pytest.approx(-(1 + 1 + 2) / 3)
    half, _ = clipped_policy_loss(lp[:1], torch.zeros(1, 3), torch.tensor([1.0]), mask[:1], normalizer=3)
    assert half.item() == pytest.approx(-2 / 3)  # micro-batch losses add up to the batch mean


def test_k3_and_entropy():
    assert k3_kl(torch.zeros(3), torch.zeros(3)).abs().max() == 0
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert k3_kl(lp, ref).item() == pytest.approx(math.exp(-1) + 1 - 1)
    assert token_entropy(torch.zeros(4)).item() == pytest.approx(math.log(4))


def test_gather_logprobs_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    lp = gather_logprobs(logits, torch.tensor([[1]]), temperature=2.0)
    assert lp.item() == pytest.approx(-math.log(1 + math.e))


def test_pack_and_align_put_engine_logprobs_on_completion_targets():
    b = pack_sequences([[5, 6, 7], [8]], [[1], [9, 9, 1]], pad_id=0)
    aligned = right_align([[-0.1], [-0.2, -0.3, -0.4]], [3, 1], b.mask.shape[1])
    assert torch.equal(aligned != 0, b.mask.bool())
    assert b.targets[b.mask.bool()].tolist() == [1, 9, 9, 1]


def test_token_weights_scale_each_tokens_loss():
    lp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[2.0, 0.5]])
    loss, _ = clipped_policy_loss(lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), token_weights=w)
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    loss.backward()
    torch.testing.assert_close(lp.grad, -w / 2)


def _trajectory(targets, old_lp, adv, mask, tis=None, ref_lp=None) -> Trajectory:
    """A trajectory whose sequences are only what the loss reads (targets and completion mask)."""
    n = len(targets)
    seqs = PackedBatch(torch.zeros(n, targets.shape[1] + 1, dtype=torch.long), torch.ones(n, 1), targets, mask)
    return Trajectory(seqs, torch.zeros(n), adv, old_lp, tis, ref_lp)


def test_grpo_loss_by_hand():
    # one micro-batch of 2 tokens (the batch has 4): ratios e^0.5 (clipped at 1.28) and e^-0.5, advantage +1,
    # TIS weights (2, 0.5), reference logprobs 1 above the policy's (k3 = e - 2 per token), uniform logits over 2
    logits = torch.zeros(1, 2, 2, requires_grad=True)
    targets = torch.tensor([[0, 1]])
    lp = math.log(0.5)
    old = torch.tensor([[lp - 0.5, lp + 0.5]])
    batch = _trajectory(
        targets, old, torch.tensor([1.0]), torch.ones(1, 2), torch.tensor([[2.0, 0.5]]), torch.full((1, 2), lp + 1.0)
    )
    logprobs = gather_logprobs(logits, targets)
    loss, stats = grpo_loss(
        logprobs,
        batch,
        4,
        LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.1),
        entropy=token_entropy(logits.detach()),
    )
    policy = -(2.0 * 1.28 + 0.5 * math.exp(-0.5)) / 4
    ref_kl = 2 * (math.e - 2) / 4
    assert loss.item() == pytest.approx(policy + 0.1 * ref_kl, rel=1e-6)
    assert stats["loss/policy"] == pytest.approx(policy + 0.1 * ref_kl, rel=1e-6)
    assert stats["policy/ref_kl"] == pytest.approx(ref_kl, rel=1e-6)
    # the stats are this micro-batch's share (2 of 4 tokens) of the batch's token means
    assert stats["policy/clip_frac"] == pytest.approx(0.5 * 0.5)
    assert stats["policy/approx_kl"] == pytest.approx(0.5 * (math.exp(0.5) + math.exp(-0.5) - 2) / 2, rel=1e-6)
    assert stats["policy/entropy"] == pytest.approx(0.5 * math.log(2), rel=1e-6)
    assert list(stats) == ["loss/policy", "policy/clip_frac", "policy/approx_kl", "policy/entropy", "policy/ref_kl"]
    _, plain = grpo_loss(logprobs, _trajectory(targets, old, torch.tensor([1.0]), torch.ones(1, 2)), 4)
    assert set(plain) == {"loss/policy", "policy/clip_frac", "policy/approx_kl"}


def _inline_composition(hp, logits, targets, old_lp, adv, mask, tis, ref_lp, micro):
    """The loss as ``PolicyGradientModule.training_step`` composed it inline before ``grpo_loss`` (one epoch)."""
    n_tokens = int(mask.sum())
    stats = {
        "loss/policy": 0.0,
        "policy/clip_frac": 0.0,
        "policy/approx_kl": 0.0,
        "policy/entropy": 0.0,
        "policy/ref_kl": 0.0,
    }
    losses = []
    for lo in range(0, len(targets), micro):
        rows = slice(lo, lo + micro)
        lg, mb_mask = logits[rows], mask[rows]
        mb_tokens = int(mb_mask.sum())
        lp = gather_logprobs(lg, targets[rows], hp["temperature"])
        loss, st = clipped_policy_loss(
            lp,
            old_lp[rows],
            adv[rows],
            mb_mask,
            hp["clip_low"],
            hp["clip_high"],
            normalizer=n_tokens,
            token_weights=tis[rows],
        )
        ref_kl = (k3_kl(lp, ref_lp[rows]) * mb_mask).sum() / n_tokens
        loss = loss + hp["kl_coef"] * ref_kl
        stats["policy/ref_kl"] += ref_kl.item()
        w = mb_tokens / max(n_tokens, 1)
        stats["loss/policy"] += loss.item()
        stats["policy/clip_frac"] += st["clip_frac"].item() * w
        stats["policy/approx_kl"] += st["approx_kl"].item() * w
        with torch.no_grad():
            ent = masked_mean(token_entropy(lg.detach() / hp["temperature"]), mb_mask)
        stats["policy/entropy"] += ent.item() * mb_tokens / max(n_tokens, 1)
        losses.append(loss)
    return losses, stats


def test_grpo_loss_equals_the_previous_inline_composition():
    gen = torch.Generator().manual_seed(0)
    N, T, V = 5, 6, 11
    hp = {"temperature": 0.7, "clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.05}
    logits = torch.randn(N, T, V, generator=gen)
    targets = torch.randint(0, V, (N, T), generator=gen)
    mask = (torch.rand(N, T, generator=gen) < 0.7).float()
    old_lp = gather_logprobs(logits, targets, hp["temperature"]) + 0.3 * torch.randn(N, T, generator=gen)
    engine_lp = old_lp + 0.2 * torch.randn(N, T, generator=gen)
    ref_lp = old_lp + 0.5 * torch.randn(N, T, generator=gen)
    adv = torch.randn(N, generator=gen)
    tis = tis_weights(old_lp, engine_lp, 2.0, mask)
    torch.testing.assert_close(tis, torch.exp(old_lp - engine_lp).clamp(max=2.0) * mask, rtol=0, atol=0)

    a = logits.clone().requires_grad_(True)
    old_losses, old_stats = _inline_composition(hp, a, targets, old_lp, adv, mask, tis, ref_lp, micro=2)
    sum(old_losses).backward()
    b = logits.clone().requires_grad_(True)
    new_stats: dict[str, float] = {}
    for lo in range(0, N, 2):
        rows = slice(lo, lo + 2)
        batch = _trajectory(targets, old_lp, adv, mask, tis, ref_lp).rows(rows)
        lp = gather_logprobs(b[rows], targets[rows], hp["temperature"])
        cfg = LossConfig(clip_low=hp["clip_low"], clip_high=hp["clip_high"], kl_coef=hp["kl_coef"])
        ent = token_entropy(b[rows].detach() / hp["temperature"])
        loss, st = grpo_loss(lp, batch, int(mask.sum()), cfg, entropy=ent)
        assert torch.equal(loss, old_losses[lo // 2])
        loss.backward()
        for key, value in st.items():
            new_stats[key] = new_stats.get(key, 0.0) + value
    assert torch.equal(a.grad, b.grad)
    assert new_stats.keys() == old_stats.keys()
    for key, value in old_stats.items():
        assert new_stats[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
