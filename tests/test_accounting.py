"""Exact byte accounting of params, live grads and optimizer state.

Run: ``.venv/bin/python -m pytest tests/test_accounting.py -q``
"""

from __future__ import annotations

import torch
from torch import nn

from logra_lightning.optim import LoGRA, grad_bytes, logra_param_groups, optimizer_state_bytes, param_bytes

torch.set_num_threads(1)


def test_adamw_param_grad_and_state_bytes():
    model = nn.Linear(4, 3)  # weight 12 + bias 3 fp32 = 60 B
    opt = torch.optim.AdamW(model.parameters())
    assert (param_bytes(model), grad_bytes(model), optimizer_state_bytes(opt)) == (60, 0, 0)
    model(torch.randn(2, 4)).sum().backward()
    assert grad_bytes(model) == 60
    opt.step()
    # per param: fp32 scalar step (4 B) + exp_avg + exp_avg_sq -> (4 + 48 + 48) + (4 + 12 + 12)
    assert optimizer_state_bytes(opt) == 128
    opt.zero_grad()
    assert grad_bytes(model) == 0


def test_tied_params_and_mixed_dtypes_counted_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False).to(torch.bfloat16)
    head.weight = emb.weight  # tied: one fp32 [10, 4]
    model = nn.Sequential(emb, head, nn.LayerNorm(4).to(torch.float16))
    assert param_bytes(model) == 10 * 4 * 4 + 2 * 4 * 2


def test_logra_state_is_thin():
    model = nn.Linear(8, 6)  # [6, 8]: right sketch, moments [6, 2], basis [8, 2]
    opt = LoGRA(logra_param_groups(model, rank=2, update_proj_gap=10), lr=1e-3)
    # low-rank weight: step + seed (int64, 8 B each) + bf16 basis 32 + bf16 exp_avg 24 + fp32 exp_avg_sq 48
    # (the sketch, like a grad, is gone after step)
    assert optimizer_state_bytes(opt) == 8 + 8 + 32 + 24 + 48
    model(torch.randn(2, 8)).sum().backward()
    assert grad_bytes(model) == 6 * 4  # the weight's gradient was sketched and freed; the bias's is live
    # step 0 also holds the range sketch Y = G.T @ Omega: [8, rank + oversample] = [8, 10]
    assert optimizer_state_bytes(opt) == 120 + 8 * 10 * 4
    opt.step()
    opt.zero_grad()
    # range sketch consumed; dense bias: int64 step + two [6] fp32 moments
    assert optimizer_state_bytes(opt) == 120 + 8 + 24 + 24
    fp32 = LoGRA(logra_param_groups(model, rank=2), lr=1e-3, basis_dtype="float32", exp_avg_dtype="float32")
    assert optimizer_state_bytes(fp32) == 8 + 8 + 64 + 2 * 48  # the previous default: all fp32
    factored = LoGRA(logra_param_groups(model, rank=2), lr=1e-3, second_moment="factored")
    assert optimizer_state_bytes(factored) == 8 + 8 + 32 + 24 + 4 * (6 + 2)  # V as row [6] and column [2] means


def test_views_of_one_storage_counted_once():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    buf = torch.zeros(5, 4)  # 80 B
    p = opt.param_groups[0]["params"][0]
    opt.state[p] = {"a": buf[:2], "b": buf[2:], "nested": [buf.view(-1), {"c": torch.zeros(2, dtype=torch.float64)}]}
    assert optimizer_state_bytes(opt) == 80 + 16
