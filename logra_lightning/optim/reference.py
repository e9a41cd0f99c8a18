"""Slow, obviously-correct LoGRA: full gradients kept, projected in ``step``, plain loops.

The fast :class:`~logra_lightning.optim.LoGRA` is tested against this. It shares
only the *random* pieces with the fast path (initial basis, test-matrix seeds,
``basis_from_range``) so both draw the same bases; the Adam arithmetic, the
projection and the moment rotation are written out here by hand.

Example::

    >>> import torch
    >>> lin = torch.nn.Linear(8, 8)
    >>> opt = LoGRAReference(list(lin.named_parameters()), lr=1e-2, rank=2, update_proj_gap=5)
    >>> lin(torch.randn(4, 8)).sum().backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import torch

from logra_lightning.optim import sketch as sk
from logra_lightning.optim.groups import normalize_params, split_named_params


class LoGRAReference(torch.optim.Optimizer):
    """Reference LoGRA (single-phase ``step``). Same arguments as ``LoGRA`` minus ``sketch_in_backward``."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, rank=None,
                 update_proj_gap=200, scale=1.0, side="auto", refresh="randomized", oversample=8,
                 include=None, exclude=None, seed=0):  # fmt: skip
        groups = normalize_params(params)
        if rank is not None and not any("rank" in g for g in groups):
            groups = [
                s for g in groups
                for s in split_named_params(zip(g["param_names"], g["params"]), rank, include=include, exclude=exclude)
            ]  # fmt: skip
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, update_proj_gap=update_proj_gap,
                        scale=scale, side=side, refresh=refresh, oversample=oversample)  # fmt: skip
        super().__init__(groups, defaults)
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if group.get("rank") is not None:
                    m, n = p.shape
                    side = group["side"] if group["side"] != "auto" else ("right" if m <= n else "left")
                    seed_p = sk.mix_seed(seed, index)
                    r = group["rank"]
                    self.state[p] = {
                        "side_right": torch.tensor(side == "right"),
                        "seed": torch.tensor(seed_p),
                        "step": torch.tensor(0),
                        "basis": sk.random_orthonormal(n if side == "right" else m, r, seed_p),
                        "exp_avg": torch.zeros((m, r) if side == "right" else (r, n)),
                        "exp_avg_sq": torch.zeros((m, r) if side == "right" else (r, n)),
                    }
                index += 1

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                st = self.state[p]
                if group.get("rank") is None:  # plain AdamW
                    if not st:
                        st.update(step=torch.tensor(0), exp_avg=torch.zeros_like(g), exp_avg_sq=torch.zeros_like(g))
                    st["step"] += 1
                    t = int(st["step"])
                    st["exp_avg"] = b1 * st["exp_avg"] + (1 - b1) * g
                    st["exp_avg_sq"] = b2 * st["exp_avg_sq"] + (1 - b2) * g * g
                    m_hat = st["exp_avg"] / (1 - b1**t)
                    v_hat = st["exp_avg_sq"] / (1 - b2**t)
                    p.mul_(1 - lr * wd).add_(-lr * m_hat / (v_hat.sqrt() + eps))
                    continue
                right = bool(st["side_right"])
                q = st["basis"]
                s = g @ q if right else q.T @ g  # [m, r] | [r, n]
                if not torch.isfinite(s).all():
                    continue
                r = group["rank"]
                new_q = None
                full = q.shape[0] == q.shape[1]
                if not full and int(st["step"]) % group["update_proj_gap"] == 0:
                    if group["refresh"] == "svd":
                        u_, _, vh = torch.linalg.svd(g, full_matrices=False)
                        new_q = sk._fix_signs(vh[:r].T if right else u_[:, :r])
                    else:
                        k = r + group["oversample"]
                        rows = p.shape[0] if right else p.shape[1]
                        omega = sk.gaussian(rows, k, sk.mix_seed(int(st["seed"]), int(st["step"]), 1))
                        y = g.T @ omega if right else g @ omega
                        new_q = sk.basis_from_range(y, r) if torch.isfinite(y).all() else None
                st["step"] += 1
                t = int(st["step"])
                st["exp_avg"] = b1 * st["exp_avg"] + (1 - b1) * s
                st["exp_avg_sq"] = b2 * st["exp_avg_sq"] + (1 - b2) * s * s
                u = (st["exp_avg"] / (1 - b1**t)) / ((st["exp_avg_sq"] / (1 - b2**t)).sqrt() + eps)
                delta = u @ q.T if right else q @ u  # [m, n]
                p.mul_(1 - lr * wd).add_(-lr * group["scale"] * delta)
                if new_q is not None:
                    rot = q.T @ new_q  # [r, r]
                    if right:
                        st["exp_avg"], st["exp_avg_sq"] = st["exp_avg"] @ rot, st["exp_avg_sq"] @ (rot * rot)
                    else:
                        st["exp_avg"], st["exp_avg_sq"] = rot.T @ st["exp_avg"], (rot * rot).T @ st["exp_avg_sq"]
                    st["basis"] = new_q
        return loss
