"""Advantage and loss math against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from logra_lightning.grpo import clipped_policy_loss, gather_logprobs, grpo_advantages, k3_kl, token_entropy
from logra_lightning.sequences import pack_sequences, right_align


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
