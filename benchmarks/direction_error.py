"""How far LoGRA's state choices move the update direction, on a Qwen2 shape's real gradients.

Run (~100M shape, 12 steps, ~5 min on a quiet machine):

    .venv/bin/python -m benchmarks.direction_error
    .venv/bin/python -m benchmarks.direction_error --size 25m --steps 8 --out /tmp/d.json

One model (random weights, the ``benchmarks/optimizer_memory.py`` shape, step and data: random
tokens, seq 128, batch 4) and one LoGRA optimizer per variant, all over the same parameters with
``sketch_in_backward=False`` and ``lr=0``: every variant sketches the very same gradients and the
weights never move, so the only difference between the variants is their state. After each
backward every variant prepares its candidate update; per low-rank matrix the full update
``D = U Q^T`` (``P U`` left) is compared with the one of the ``reference`` variant
(``second_moment="full"``, fp32 bases and first moment: the pre-issue-18 LoGRA):
``rel_err = ||D - D_ref||_F / ||D_ref||_F`` and the cosine. ``update_proj_gap`` is small (5) so
the run crosses refreshes (moment rotation included). The embedding (tied with ``lm_head``) is
reported on its own, since its vocabulary-sized rows are what the factored second moment
summarizes most. For scale, every variant's update is also compared (cosine) with dense AdamW's
direction ``m_hat / (sqrt(v_hat) + eps)`` on the same gradients: a rank-64 sketch is far from it
whatever its state, and the question is whether a state choice moves it further. The optimizers'
state bytes are reported next to the errors.
Results: ``benchmarks/results/direction_error.json``.
"""

from __future__ import annotations

import statistics

from benchmarks.common import shape_config
from benchmarks.harness import Benchmark, bench, flat, main
from benchmarks.optimizer_memory import RUN, _build_model
from benchmarks.report import MB, Col, table

FP32 = {"second_moment": "full", "basis_dtype": "float32", "exp_avg_dtype": "float32"}
VARIANTS = {
    "reference": FP32,  # the pre-issue-18 LoGRA
    "bf16_basis": {**FP32, "basis_dtype": "bfloat16"},
    "bf16_exp_avg": {**FP32, "exp_avg_dtype": "bfloat16"},
    "factored_embedding": {**FP32, "second_moment": "auto"},
    "default": {},  # auto (factored embedding), bf16 bases, bf16 exp_avg
    "factored_all_bf16_basis": {**FP32, "second_moment": "factored", "basis_dtype": "bfloat16"},
}


def run(size: str, steps: int, gap: int, rank: int) -> dict:
    import torch

    from logra_lightning.optim import LoGRA, logra_param_groups, optimizer_state_bytes
    from logra_lightning.optim import sketch as sk

    torch.set_num_threads(RUN["full"]["threads"])
    cfg = shape_config(size)
    model = _build_model(cfg, RUN["full"]["seq"])
    names = {id(p): n for n, p in model.named_parameters()}
    opts = {
        v: LoGRA(
            logra_param_groups(model, rank=rank, update_proj_gap=gap),
            lr=0.0,
            sketch_in_backward=False,
            release_host_memory=False,
            **kw,
        )
        for v, kw in VARIANTS.items()
    }
    gen = torch.Generator().manual_seed(0)
    errs: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS if v != "reference"}
    coss: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS if v != "reference"}
    vs_adamw: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    adam = {id(p): [torch.zeros_like(p), torch.zeros_like(p)] for p in model.parameters() if p.ndim == 2}

    def cosine(a, b) -> float:
        a, b = a.double(), b.double()
        return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-300))

    for step in range(steps):
        ids = torch.randint(0, cfg["vocab_size"], (RUN["full"]["batch"], RUN["full"]["seq"]), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        for opt in opts.values():
            opt.prepare_update()  # candidates held (thin U), compared matrix by matrix below
        for p in model.parameters():
            if p.ndim != 2:
                continue
            m, v2 = adam[id(p)]  # torch.optim.AdamW's moments and direction (betas 0.9 / 0.999, eps 1e-8)
            m.lerp_(p.grad, 0.1)
            v2.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
            adamw_dir = (m / (1 - 0.9 ** (step + 1))) / ((v2 / (1 - 0.999 ** (step + 1))).sqrt() + 1e-8)  # [m, n]
            ref = None
            for v, opt in opts.items():  # "reference" first
                pend = opt.step_state.pending.get(p)  # a candidate.PendingUpdate
                if pend is None or not pend.lowrank:
                    continue
                d = sk.lowrank_delta(pend.direction, pend.basis, pend.side)  # [m, n]
                vs_adamw[v].setdefault(names[id(p)], []).append(cosine(d, adamw_dir))
                if v == "reference":
                    ref = d
                    continue
                errs[v].setdefault(names[id(p)], []).append(float((d - ref).norm() / ref.norm().clamp_min(1e-30)))
                coss[v].setdefault(names[id(p)], []).append(cosine(d, ref))
                del d
            del ref, adamw_dir
        for opt in opts.values():
            opt.step()  # lr = 0: the weights stay; moments, step counts and bases advance
        model.zero_grad(set_to_none=True)
        print(
            f"step {step}: "
            + ", ".join(
                f"{v} rel_err median {statistics.median(x[-1] for x in e.values()):.4f}" for v, e in errs.items()
            ),
            flush=True,
        )

    def vs_adam(v: str) -> dict:
        emb = [n for n in vs_adamw[v] if "embed_tokens" in n]
        rest = [n for n in vs_adamw[v] if n not in emb]
        return {
            "cosine_vs_adamw_median_layers_per_step": [
                statistics.median(vs_adamw[v][n][i] for n in rest) for i in range(steps)
            ],
            "cosine_vs_adamw_embedding_per_step": vs_adamw[v][emb[0]] if emb else None,
        }

    def summary(v: str) -> dict:
        emb = [n for n in errs[v] if "embed_tokens" in n]
        rest = [n for n in errs[v] if n not in emb]
        last = {n: errs[v][n][-1] for n in errs[v]}
        return {
            **vs_adam(v),
            "rel_err_median_all_steps": statistics.median(x for n in rest for x in errs[v][n]),
            "rel_err_max_all_steps": max(x for n in rest for x in errs[v][n]),
            "rel_err_median_last_step": statistics.median(last[n] for n in rest),
            "cosine_min_all_steps": min(x for n in rest for x in coss[v][n]),
            "embedding_rel_err_per_step": errs[v][emb[0]] if emb else None,
            "embedding_cosine_per_step": coss[v][emb[0]] if emb else None,
            "rel_err_median_per_step": [statistics.median(errs[v][n][i] for n in rest) for i in range(steps)],
        }

    return {
        "state_bytes": {v: optimizer_state_bytes(o) for v, o in opts.items()},
        "variants": VARIANTS,
        "summary": {"reference": vs_adam("reference"), **{v: summary(v) for v in errs}},
        "per_matrix_rel_err": errs,
    }


@bench(
    "direction_error",
    title="Update direction vs. state storage (issue 18)",
    quick=["--size", "quick", "--steps", "3", "--gap", "2", "--rank", "8"],
    variants=("direction_error_25m",),
)
class DirectionError(Benchmark):
    def add_arguments(self, ap) -> None:
        ap.add_argument("--size", default="100m")
        ap.add_argument("--steps", type=int, default=12)
        ap.add_argument("--gap", type=int, default=5, help="update_proj_gap (refreshes at steps 0, gap, 2 gap, ...)")
        ap.add_argument("--rank", type=int, default=RUN["full"]["rank"])

    def settings(self, args) -> dict:
        return {
            "size": args.size,
            "steps": args.steps,
            "update_proj_gap": args.gap,
            "rank": args.rank,
            "seq": RUN["full"]["seq"],
            "batch": RUN["full"]["batch"],
        }

    def run(self, args, st: dict) -> list[dict]:
        self.out = run(st["size"], st["steps"], st["update_proj_gap"], st["rank"])
        return [
            {"name": v, "ok": True, "error": None, "metrics": {"state_bytes": b, "options": self.out["variants"][v]}}
            for v, b in self.out["state_bytes"].items()
        ]

    def summarize(self, settings: dict, rows: list[dict]) -> dict:
        return {**self.out["summary"], "per_matrix_rel_err": self.out["per_matrix_rel_err"]}

    def section(self, res: dict) -> list[str]:
        """One row per variant: state bytes, update error vs the reference (layers, embedding), cosine to AdamW."""
        st, summary = res["settings"], res["summary"]
        rows = [{**flat(r), **summary[r["name"]]} for r in res["rows"] if r["name"] in summary]

        def last(key: str):
            return lambda r: (r.get(key) or [None])[-1]

        cols = [
            Col("variant", "name"),
            Col("options", lambda r: f"`{r['options']}`"),
            Col("state MB", "state_bytes", "mb1"),
            Col("rel. err median (layers)", "rel_err_median_all_steps", ".4f"),
            Col("median, last step", "rel_err_median_last_step", ".4f"),
            Col("max", "rel_err_max_all_steps", ".3f"),
            Col("embedding, last step", last("embedding_rel_err_per_step"), ".3f"),
            Col("cos vs AdamW, layers (median, last)", last("cosine_vs_adamw_median_layers_per_step"), ".3f"),
            Col("cos vs AdamW, embedding (last)", last("cosine_vs_adamw_embedding_per_step"), ".3f"),
        ]
        reference = next(r["metrics"]["state_bytes"] for r in res["rows"] if r["name"] == "reference")
        return [
            f"Command: `{res['envelope']['command']}` — ~{st['size']}, rank {st['rank']}, {st['steps']} steps, "
            f"update_proj_gap {st['update_proj_gap']}; relative Frobenius error of each matrix's update vs the "
            "all-fp32 full-V LoGRA on the same gradients.",
            "",
            *table(rows, cols),
            "",
            f"Reference state: {reference / MB:.1f} MB.",
            "",
        ]


if __name__ == "__main__":
    main(DirectionError)
