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


def _round(t: torch.Tensor, dtype) -> torch.Tensor:
    """``t`` in fp32 holding the values a store of ``dtype`` holds (LoGRA upcasts its bf16 state)."""
    return t.to(torch.bfloat16).float() if dtype in ("bfloat16", torch.bfloat16) else t


class LoGRAReference(torch.optim.Optimizer):
    """Reference LoGRA (single-phase ``step``). Same arguments as ``LoGRA`` minus ``sketch_in_backward``."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        *,
        rank=None,
        update_proj_gap=200,
        scale=1.0,
        side="auto",
        refresh="randomized",
        oversample=8,
        second_moment="auto",
        basis_dtype="bfloat16",
        exp_avg_dtype="bfloat16",
        include=None,
        exclude=None,
        seed=0,
    ):
        groups = normalize_params(params)
        if rank is not None and not any("rank" in g for g in groups):
            groups = [
                s
                for g in groups
                for s in split_named_params(zip(g["param_names"], g["params"]), rank, include=include, exclude=exclude)
            ]
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            update_proj_gap=update_proj_gap,
            scale=scale,
            side=side,
            refresh=refresh,
            oversample=oversample,
            second_moment=second_moment,
            basis_dtype=basis_dtype,
            exp_avg_dtype=exp_avg_dtype,
        )
        super().__init__(groups, defaults)
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if group.get("rank") is not None:
                    m, n = p.shape
                    side = group["side"] if group["side"] != "auto" else ("right" if m <= n else "left")
                    seed_p = sk.mix_seed(seed, index)
                    r = group["rank"]
                    right_side = side == "right"
                    a, b = (m, r) if right_side else (r, n)
                    self.state[p] = {
                        "side_right": torch.tensor(side == "right"),
                        "seed": torch.tensor(seed_p),
                        "step": torch.tensor(0),
                        "basis": _round(sk.random_orthonormal(n if right_side else m, r, seed_p), group["basis_dtype"]),
                        "exp_avg": torch.zeros(a, b),
                    }
                    mode = group["second_moment"]  # auto: factored for a right sketch of a tall matrix (embeddings)
                    if not (mode == "factored" or (mode == "auto" and side == "right" and m > n)):
                        self.state[p]["exp_avg_sq"] = torch.zeros(a, b)
                    else:  # row / column means of the second moment (Adafactor's factors)
                        self.state[p]["row"], self.state[p]["col"] = torch.zeros(a), torch.zeros(b)
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
                new_q = _round(new_q, group["basis_dtype"]) if new_q is not None else None
                st["step"] += 1
                t = int(st["step"])
                if group["exp_avg_dtype"] in ("float32", torch.float32):
                    st["exp_avg"] = b1 * st["exp_avg"] + (1 - b1) * s
                else:  # the fp32 lerp LoGRA computes, rounded to what a bf16 store holds
                    st["exp_avg"] = _round(torch.lerp(st["exp_avg"], s, 1 - b1), group["exp_avg_dtype"])
                if "exp_avg_sq" in st:
                    v = st["exp_avg_sq"] = b2 * st["exp_avg_sq"] + (1 - b2) * s * s
                else:
                    st["row"] = b2 * st["row"] + (1 - b2) * (s * s).mean(dim=1)
                    st["col"] = b2 * st["col"] + (1 - b2) * (s * s).mean(dim=0)
                    small = st["col"] if right else st["row"]  # the rank-sized factor: its mean is V's mean
                    v = st["row"][:, None] * st["col"][None, :] / max(float(small.mean()), 1e-38)
                u = (st["exp_avg"] / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
                delta = u @ q.T if right else q @ u  # [m, n]
                p.mul_(1 - lr * wd).add_(-lr * group["scale"] * delta)
                if new_q is not None:
                    rot = q.T @ new_q  # [r, r]
                    turned = st["exp_avg"] @ rot if right else rot.T @ st["exp_avg"]
                    st["exp_avg"] = _round(turned, group["exp_avg_dtype"])
                    if "exp_avg_sq" in st:
                        st["exp_avg_sq"] = st["exp_avg_sq"] @ (rot * rot) if right else (rot * rot).T @ st["exp_avg_sq"]
                    else:  # turn the rank-sized factor; rescale the other so V's row/column means stay exact
                        key, other = ("col", "row") if right else ("row", "col")
                        old_mean = float(st[key].mean())
                        st[key] = (rot * rot).T @ st[key]
                        if old_mean > 0:
                            st[other] = st[other] * (st[key].mean() / old_mean)
                    st["basis"] = new_q
        return loss
