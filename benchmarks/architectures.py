"""Every supported architecture, trained and synced: LoGRA steps, low-rank syncs into vLLM, drift.

For each family in :data:`logra_lightning.models.architectures.ARCHITECTURES` a tiny random-init
model is built locally (2 layers, hidden 128, head dim 64, fp32), then ``steps`` RL steps
of :class:`~logra_lightning.rl.module.PolicyGradientModule` run on arithmetic prompts (reward: the
share of digits in a completion, so a random-init model gets varied rewards) with
LoGRA, a vLLM CPU engine, and :class:`~logra_lightning.callbacks.LowRankWeightSync`
(one full sync at the start, a low-rank sync after every step). Recorded per family:
the engine-vs-trainer |logprob| gap on every step's sampled completions (what the syncs
keep near zero) and on fresh samples after the last sync, how far the policy moved,
bytes per low-rank sync against a full one, and which matrices LoGRA sketched.

    python -m benchmarks.architectures            # all families -> benchmarks/results/architectures.json
    python -m benchmarks.architectures --only phi3 qwen3_moe --out /tmp/arch.json
    python -m benchmarks.architectures --quick    # phi3 only, 2 steps

``tests/test_architectures.py`` runs :func:`run_arch` for each family (two in ``make test``).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from benchmarks.common import ROOT, engine_drift
from benchmarks.harness import Benchmark, bench, main
from benchmarks.report import Col, met

DRIFT_LIMIT = 1e-4  # max |engine - trainer| logprob after the low-rank syncs (fp32)
TIED = {"gemma3", "qwen3"}  # tied input/output embeddings (like Gemma 3 and small Qwen3); the rest untied
PROMPTS = ["12+34=", "7+8=", "99+1=", "5+5="]


def digit_share(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Reward: the share of digits in a completion (a random-init model gets varied rewards, so steps train)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def run_arch(arch: str, workdir: str | Path, steps: int = 4, lr: float = 3e-3, rank: int = 8) -> dict:
    """Build, train ``steps`` steps and sync family ``arch``; return its record (see the module notes)."""
    import lightning as L

    from logra_lightning.callbacks import LowRankWeightSync
    from logra_lightning.data import ArithmeticSource, PromptDataModule
    from logra_lightning.models import TinyModelConfig, build_tiny_model
    from logra_lightning.models.architectures import ARCHITECTURES
    from logra_lightning.optim import LoGRA
    from logra_lightning.rl.module import PolicyGradientModule
    from logra_lightning.rollout import VLLMEngineSpec
    from logra_lightning.sync.wire import tensor_nbytes

    t0 = time.perf_counter()
    path = build_tiny_model(
        Path(workdir) / arch, TinyModelConfig(architecture=arch, num_layers=2, tie_word_embeddings=arch in TIED)
    )
    gaps: list[list[float]] = []
    record: dict = {"architecture": arch, "hf_class": ARCHITECTURES[arch].hf_class, "tied_embeddings": arch in TIED}

    class Watch(L.Callback):
        def on_train_start(self, trainer, pl_module):
            record["start_weights"] = {n: p.detach().clone() for n, p in pl_module.policy.named_parameters()}
            record["engine_init"] = {k: v for k, v in pl_module.engine.init_info.items() if k != "packed_dependents"}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            gaps.append(list(pl_module.engine_logprob_gap or (float("nan"), float("nan"))))  # nan: a skipped step
            pl_module.engine_logprob_gap = None

        def on_train_end(self, trainer, pl_module):  # the engine is still up: sample after the last sync
            prompts = [pl_module.tokenizer.encode(p) for p in PROMPTS]
            record["final_gap_mean"], record["final_gap_max"] = engine_drift(
                pl_module.engine, pl_module.policy, prompts, max_new_tokens=8
            )
            start = record.pop("start_weights")
            moved = [
                float((p.detach() - start[n]).norm() / start[n].norm().clamp_min(1e-12))
                for n, p in pl_module.policy.named_parameters()
                if p.ndim >= 2
            ]
            record["relative_weight_change_max"] = max(moved)
            opt = trainer.optimizers[0]
            record["lowrank_params"] = sum(len(g["params"]) for g in opt.param_groups if g.get("rank"))
            record["lowrank_3d_params"] = sum(
                p.ndim == 3 for g in opt.param_groups if g.get("rank") for p in g["params"]
            )
            record["dense_params"] = sum(len(g["params"]) for g in opt.param_groups if not g.get("rank"))

    sync = LowRankWeightSync(full_sync_every=0)
    module = PolicyGradientModule(
        model=path,
        optimizer=functools.partial(LoGRA, lr=lr, rank=rank, update_proj_gap=2, weight_decay=0.01),
        engine=VLLMEngineSpec(dtype="float32", kv_cache_space_gb=0.25, max_model_len=64, seed=0),
        reward=digit_share,
        group_size=8,
        max_new_tokens=8,
        torch_threads=1,
    )
    source = functools.partial(ArithmeticSource, max_digits=2, ops="+", test_size=16, seed=0)
    dm = PromptDataModule(source("train"), source("test"), batch_size=8, val_batch_size=16)
    trainer = L.Trainer(
        max_steps=steps,
        callbacks=[sync, Watch()],
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(Path(workdir) / arch),  # where the module's summary.json goes
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, dm)
    dense_bytes = sum(map(tensor_nbytes, module.policy.parameters()))
    record.update(
        steps=steps,
        full_syncs=sync.full_syncs,
        lowrank_syncs=sync.lowrank_syncs,
        step_gap_mean=[g[0] for g in gaps],
        step_gap_max=[g[1] for g in gaps],
        drift_max=max([g[1] for g in gaps[1:] if g[1] == g[1]] + [record["final_gap_max"]]),
        skipped_steps=module.faults.skipped_steps,
        lowrank_sync_bytes=(sync.total_bytes - dense_bytes) / max(sync.lowrank_syncs, 1),
        full_sync_bytes=dense_bytes,
        params=sum(p.numel() for p in module.policy.parameters()),
        seconds=time.perf_counter() - t0,
    )
    record["lowrank_sync_share"] = record["lowrank_sync_bytes"] / dense_bytes
    return record


@bench("architectures", title="Every architecture: low-rank sync into vLLM", full=[], quick=[])
class Architectures(Benchmark):
    columns = [
        Col("family", "name"),
        Col("HF / vLLM class", lambda r: f"`{r['hf_class']}`"),
        Col("embeddings", lambda r: "tied" if r["tied_embeddings"] else "untied"),
        Col(
            "LoGRA matrices / dense params",
            lambda r: f"{r['lowrank_params']} ({r['lowrank_3d_params']} 3-D) / {r['dense_params']}",
        ),
        Col("drift max", lambda r: f"**{r['drift_max']:.1e}** ({met(r['drift_max'] <= DRIFT_LIMIT)})"),
        Col("low-rank sync bytes / full", "lowrank_sync_share", ".3f"),
        Col("max relative weight change", "relative_weight_change_max", ".3f"),
        Col("s", "seconds", ".0f"),
    ]

    def add_arguments(self, ap) -> None:
        from logra_lightning.models.architectures import ARCHITECTURES

        ap.add_argument("--only", nargs="*", default=list(ARCHITECTURES), choices=list(ARCHITECTURES))
        ap.add_argument("--steps", type=int, default=4)
        ap.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "bench_runs" / "architectures")

    def settings(self, args) -> dict:
        if args.quick:  # one family, 2 steps: a smoke run
            args.only, args.steps = ["phi3"], 2
        self.workdir = args.workdir
        return {"drift_limit": DRIFT_LIMIT, "steps": args.steps}

    def row_names(self, args, settings: dict) -> list[str]:
        import torch

        torch.set_num_threads(1)
        return args.only

    def measure(self, name: str, settings: dict) -> dict:
        return run_arch(name, self.workdir, steps=settings["steps"])

    def describe(self, res: dict) -> str:
        steps = next((r["metrics"]["steps"] for r in res["rows"] if r["ok"]), "?")
        return (
            "Per family: a tiny random-init model (2 layers, hidden 128, head dim 64, fp32), "
            f"{steps} GRPO steps with LoGRA (rank 8) and a vLLM CPU engine (fp32) kept in sync by one full sync, "
            "then a low-rank sync after every step. Drift: max |engine - trainer| logprob of sampled tokens after the "
            f"low-rank syncs (limit {res['settings']['drift_limit']:g})."
        )


if __name__ == "__main__":
    import torch

    torch.multiprocessing.set_start_method("spawn", force=True)
    main(Architectures)
