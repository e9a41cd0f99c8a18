"""bf16 update rules (logra_lightning.optim.rounding) against exact (float64) arithmetic, and in LoGRA."""

from __future__ import annotations

import pytest
import torch

from logra_lightning.optim import LoGRA
from logra_lightning.optim.rounding import (
    MODES,
    DeltaRows,
    add_by_rule,
    add_kahan,
    add_nearest,
    add_stochastic,
    lost_updates,
    stochastic_round_bf16,
)


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 numbers just below and above each float32 ``x`` (exact: truncate, then step one ulp up)."""
    bits = x.view(torch.int32)
    low = torch.bitwise_and(bits, ~0xFFFF).view(torch.float32)  # magnitude truncated
    high = (torch.bitwise_and(bits, ~0xFFFF) + 0x10000).view(torch.float32)
    return torch.minimum(low, high), torch.maximum(low, high)


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, generator=g) * torch.logspace(-3, 2, 64)  # both signs, many exponents
    lo, hi = bf16_neighbours(x)
    samples = torch.stack([stochastic_round_bf16(x, g).float() for _ in range(4000)])  # [4000, 64]
    assert ((samples == lo) | (samples == hi)).all()
    # the mean is x up to sampling noise: std of one sample <= ulp/2, of the mean <= ulp/(2*sqrt(4000))
    ulp = (hi - lo).double()
    err = (samples.double().mean(0) - x.double()).abs()
    assert (err <= 5 * ulp / (2 * 4000**0.5)).all(), (err / ulp).max()
    exact = torch.tensor([1.0, -0.5, 3.0, 0.0])  # already bf16: never moved
    assert torch.equal(stochastic_round_bf16(exact, g).float(), exact)
    assert torch.isinf(stochastic_round_bf16(torch.tensor([float("inf")]), g)).all()
    with pytest.raises(TypeError, match="expected float32"):
        stochastic_round_bf16(exact.double())


def test_many_small_updates_nearest_loses_them_kahan_and_stochastic_keep_them():
    """1000 updates of 1e-4 to weights near 1 (half an ulp is 2^-9 ~ 2e-3): exact sum is +0.1."""
    g = torch.Generator().manual_seed(1)
    w0 = (1 + 0.01 * torch.randn(256, generator=g)).to(torch.bfloat16)
    delta = torch.full((256,), 1e-4)
    exact = w0.double() + 1000 * delta.double()
    near, kahan, comp, stoch = w0.clone(), w0.clone(), torch.zeros(256, dtype=torch.bfloat16), w0.clone()
    lost = 0
    for _ in range(1000):
        new = add_nearest(near, delta)
        lost += lost_updates(near, new, delta)
        near = new
        kahan, comp = add_kahan(kahan, delta, comp)
        stoch = add_stochastic(stoch, delta, g)
    assert torch.equal(near, w0) and lost == 256 * 1000  # every update rounded away
    ulp = 2.0**-7  # bf16 spacing on [1, 2)
    # w + c tracks the exact sum up to the compensation's own bf16 rounding (measured 2.8% of the +0.1 here)
    assert ((kahan.double() + comp.double()) - exact).abs().max() < 0.05 * 0.1
    assert (kahan.double() - exact).abs().max() <= ulp  # and w itself is within one ulp of it
    assert (kahan.double() - w0.double()).mean() > 0.08
    # stochastic: an unbiased random walk, per entry std sqrt(N p (1 - p)) ulps with p = 1e-4 / ulp (3.5 ulps here)
    p = 1e-4 / ulp
    std = (1000 * p * (1 - p)) ** 0.5 * ulp
    err = stoch.double() - exact
    assert err.abs().mean() < 1.5 * std and err.mean().abs() < 3 * std / 256**0.5  # no bias over 256 entries


def test_kahan_single_step_matches_exact_arithmetic():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(1000, generator=g).to(torch.bfloat16)
    comp = (1e-3 * torch.randn(1000, generator=g)).to(torch.bfloat16)
    delta = 1e-2 * torch.randn(1000, generator=g)
    new, new_comp = add_kahan(w, delta, comp)
    exact = w.double() + comp.double() + delta.double()
    assert torch.equal(new, (w.float() + (delta + comp.float())).to(torch.bfloat16))
    # the residual rounding to bf16 is the only loss: relative 2^-9 of the compensation
    assert ((new.double() + new_comp.double()) - exact).abs().max() <= new_comp.double().abs().max() * 2.0**-8 + 1e-7


@pytest.mark.parametrize("mode", ["nearest", "stochastic", "kahan"])
def test_logra_with_bf16_weights_applies_its_update_with_the_rule(mode):
    """A bf16 copy of a model gets the fp32 run's update up to the rule's rounding; nearest counts lost entries."""
    torch.manual_seed(0)
    fp32 = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    bf16 = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    bf16.load_state_dict(fp32.state_dict())
    bf16 = bf16.to(torch.bfloat16)
    start = {k: v.float().clone() for k, v in bf16.state_dict().items()}
    fp32.load_state_dict(start)
    x = torch.randn(16, 32)
    opts = [
        LoGRA(list(m.named_parameters()), lr=1e-4, rank=4, update_proj_gap=50, bf16_update=mode) for m in (fp32, bf16)
    ]
    for _ in range(5):
        for model, opt, inp in zip((fp32, bf16), opts, (x, x.bfloat16())):
            model(inp).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    moved = {k: (v - start[k]).abs().max() for k, v in fp32.state_dict().items()}
    assert all(m > 0 for m in moved.values())
    w_fp32, w_bf16 = fp32[0].weight.detach().double(), bf16[0].weight.detach().double()
    ulp = w_fp32.abs().clamp_min(1e-3) * 2.0**-7
    if mode == "kahan":
        total = w_bf16 + opts[1].state[bf16[0].weight]["bf16_comp"].double()
        assert ((total - w_fp32).abs() / ulp).max() < 0.5  # the bf16 gradients differ slightly; far below an ulp
    assert ((w_bf16 - w_fp32).abs() / ulp).max() <= (
        5.0 if mode == "stochastic" else 2.0
    )  # <= 1 ulp per random rounding
    assert opts[1].low_precision_updates == 5 * sum(p.numel() for p in bf16.parameters())
    assert opts[0].low_precision_updates == 0 and opts[0].lost_updates == 0  # fp32 weights: plain fp32 adds
    if mode == "nearest":
        assert opts[1].lost_updates > 0.5 * opts[1].low_precision_updates  # lr 1e-4 on weights ~0.1: mostly lost
    with pytest.raises(ValueError, match="Invalid bf16_update: 'up'"):
        LoGRA(list(fp32.named_parameters()), rank=4, bf16_update="up")


def test_logra_under_bf16_autocast_keeps_fp32_sketches_and_updates():
    """Lightning's bf16-mixed runs backward and step() inside autocast; LoGRA's own math must stay fp32."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [LoGRA(list(m.named_parameters()), lr=1e-3, rank=4, update_proj_gap=2) for m in models]
    x = torch.randn(16, 32)
    for _ in range(3):
        for i, (model, opt) in enumerate(zip(models, opts)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
                if i == 1:  # as under Lightning: backward and step inside the autocast region
                    loss.backward()
                    opt.step()
            if i == 0:
                loss.backward()
                opt.step()
            opt.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("rule", MODES)
def test_row_blocks_give_the_whole_matrix_result_bit_for_bit(rule):
    """The rounded add in blocks of rows (a low-rank Δ expanded block by block) equals the add of the whole
    fp32 update: same weights, same compensation, same random bits, same lost count."""
    gen = torch.Generator().manual_seed(0)
    w0 = (torch.randn(300, 40, generator=gen) * 0.05).to(torch.bfloat16)
    u, q = torch.randn(300, 4, generator=gen), torch.randn(40, 4, generator=gen)
    full = (u @ q.T).mul_(1e-4)  # [300, 40], mostly below half an ulp
    results = []
    for delta, chunk in ((full, 1 << 30), (DeltaRows(lambda lo, hi: (u[lo:hi] @ q.T).mul_(1e-4), (300, 40)), 7 * 40)):
        w, state = w0.clone(), {"bf16_comp": torch.full_like(w0, 1e-4)} if rule == "kahan" else {}
        lost = add_by_rule(rule, w, delta, state, seed=3, chunk_elements=chunk)
        results.append((w, state.get("bf16_comp"), lost))
    (w_a, c_a, lost_a), (w_b, c_b, lost_b) = results
    assert torch.equal(w_a, w_b) and lost_a == lost_b
    assert c_a is None or torch.equal(c_a, c_b)
    assert not torch.equal(w_a, w0)  # the update did something
