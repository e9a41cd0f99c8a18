"""Bytes all-reduced per step and gradient memory under DDP: LoGRA's sketch all-reduce vs dense DDP.

Run (2 gloo processes on the CPU; a few minutes):

    .venv/bin/python -m benchmarks.ddp_comm                    # ~25M Qwen2 shape, rank 64
    .venv/bin/python -m benchmarks.ddp_comm --quick --size quick --steps 2

Rows, each a fresh pair of processes training the same model on halves of the same batches:

* ``adamw_ddp``: AdamW under DDP (every gradient in DDP's buckets);
* ``logra_plain_ddp``: LoGRA under plain DDP (what ``Trainer(strategy="ddp")`` gives: full
  gradients kept for DDP, sketched in the step; mode ``"grad"``);
* ``logra_sketch_allreduce``: LoGRA with its matrices kept out of DDP (``strategy="logra_ddp"``):
  DDP reduces the dense-group params, LoGRA all-reduces the sketches (mode ``"sketch"``).

Measured per row: the bytes DDP all-reduces per step (a counting comm hook on every bucket),
the bytes LoGRA all-reduces (``LoGRA.data_parallel_bytes``) on the refresh step (step 0: range
sketches too) and on a plain step, their average over a refresh period (``update_proj_gap``),
DDP's bucket memory (the fp32 copy of every gradient it reduces), the peak RSS of rank 0, and
whether the two replicas ended bit-identical. For real model shapes the same per-step bytes are
computed from the shapes (``projected``; the measured rows check the formula).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import peak_rss, qwen2, shape_config
from benchmarks.harness import Benchmark, bench, flat, main, row
from benchmarks.report import Col, load_text, table

ROWS = ("adamw_ddp", "logra_plain_ddp", "logra_sketch_allreduce")
RANK, GAP, OVERSAMPLE = 64, 200, 8
SEQ, PER_RANK = 64, 2
PROJECTED = ("qwen2.5-0.5b", "qwen2.5-7b", "llama-3-8b")


def build(size: str) -> torch.nn.Module:
    return qwen2(shape_config(size), checkpointing=False).float()


def _worker(rank: int, row: str, size: str, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store_{row}", rank=rank, world_size=2)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from logra_lightning.optim import LoGRA, keep_out_of_ddp, logra_param_groups

        model = build(size)
        vocab = model.config.vocab_size
        if row == "adamw_ddp":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        else:
            opt = LoGRA(logra_param_groups(model, rank=RANK, update_proj_gap=GAP), lr=1e-5, oversample=OVERSAMPLE)
            if row == "logra_sketch_allreduce":
                keep_out_of_ddp(model, opt.lowrank_params())
                opt.setup_data_parallel()
        ddp = DDP(model)
        per_step: list[int] = []
        counted = [0]

        def counting_hook(state, bucket):
            counted[0] += bucket.buffer().numel() * bucket.buffer().element_size()
            fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        ddp.register_comm_hook(None, counting_hook)
        logra_bytes: list[int] = []
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, vocab, (2 * PER_RANK, SEQ), generator=g)[rank * PER_RANK : (rank + 1) * PER_RANK]
            before_ddp, before_logra = counted[0], getattr(opt, "data_parallel_bytes", 0)
            ddp(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            per_step.append(counted[0] - before_ddp)
            logra_bytes.append(getattr(opt, "data_parallel_bytes", 0) - before_logra)
        info = ddp._get_ddp_logging_data()
        params = {n: p.detach() for n, p in model.named_parameters()}
        digest = float(sum(p.double().sum() for p in params.values()))
        record = {
            "ddp_bytes_per_step": per_step,
            "logra_bytes_per_step": logra_bytes,
            "ddp_bucket_bytes": int(info.get("total_parameter_size_bytes", 0)),
            "peak_rss_bytes": peak_rss(),
            "digest": digest,
            "params": sum(p.numel() for p in model.parameters()),
        }
        torch.save(params, f"{out}/{row}_rank{rank}.pt")
        Path(f"{out}/{row}_rank{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


def projected_bytes(shapes: dict[str, tuple[int, ...]], rank: int, gap: int, oversample: int) -> dict[str, float]:
    """fp32 bytes per step under dense DDP and with LoGRA's sketch all-reduce (refresh averaged over ``gap``).

    A matrix ``[m, n]`` is right-sketched (``[m, r]``, range ``[n, r + p]``) when ``m <= n`` and
    left-sketched (``[r, n]``, range ``[m, r + p]``) otherwise; embeddings are forced right. Every
    other param is reduced densely by DDP in both.
    """
    dense = sketch = rng = other = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        dense += numel
        if len(shape) != 2:
            other += numel
            continue
        m, n = shape
        right = m <= n or "embed" in name
        sketch += (m if right else n) * rank + 1  # + the matrix's "had a gradient" flag
        rng += (n if right else m) * (rank + oversample)
    return {
        "dense_ddp": 4.0 * dense,
        "logra_plain_step": 4.0 * (sketch + other),
        "logra_per_step_avg": 4.0 * (sketch + other + rng / gap),
    }


def _shapes_of(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _real_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """Every parameter of a real model, by name: built on the meta device from its shape file."""
    from logra_lightning.models.loading import parameter_shapes

    shapes = Path(__file__).resolve().parents[1] / "logra_lightning/models/shapes"
    return parameter_shapes(json.loads((shapes / f"{name}.json").read_text()))


@bench("ddp_comm", title="DDP: bytes all-reduced per step", quick=["--size", "quick", "--steps", "2"])
class DdpComm(Benchmark):
    flags = {"steps": 3, "work_dir": None}

    def add_arguments(self, ap) -> None:
        ap.add_argument("--size", default="25m", help="benchmarks/configs/qwen2-<size>.json")

    def settings(self, args) -> dict:
        return {
            "size": args.size,
            "rank": RANK,
            "update_proj_gap": GAP,
            "oversample": OVERSAMPLE,
            "steps": args.steps,
            "world": 2,
            "batch_per_rank": [PER_RANK, SEQ],
        }

    def run(self, args, settings: dict) -> list[dict]:
        work = Path(args.work_dir or f"/tmp/ddp_comm_{os.getpid()}")
        work.mkdir(parents=True, exist_ok=True)
        return [row(name, lambda: self._pair(name, args, work)) for name in ROWS]

    def _pair(self, name: str, args, work: Path) -> dict:
        """One row: a fresh pair of processes; bytes per step and whether the replicas ended identical."""
        mp.spawn(_worker, args=(name, args.size, args.steps, str(work)), nprocs=2, join=True)
        r0 = json.loads((work / f"{name}_rank0.json").read_text())
        weights = [torch.load(work / f"{name}_rank{r}.pt", weights_only=True) for r in range(2)]
        refresh = r0["ddp_bytes_per_step"][0] + r0["logra_bytes_per_step"][0]
        plain = r0["ddp_bytes_per_step"][-1] + r0["logra_bytes_per_step"][-1]
        return {
            **r0,
            "replicas_identical": all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0]),
            "refresh_step_bytes": refresh,
            "plain_step_bytes": plain,
            "per_step_avg_bytes": plain + (refresh - plain) / GAP,
        }

    def summarize(self, settings: dict, rows: list[dict]) -> dict:
        settings["params"] = next((r["metrics"]["params"] for r in rows if r["ok"]), None)
        return {
            "formula_for_measured_model": projected_bytes(_shapes_of(build(settings["size"])), RANK, GAP, OVERSAMPLE),
            "projected": {n: projected_bytes(_real_shapes(n), RANK, GAP, OVERSAMPLE) for n in PROJECTED},
        }

    def section(self, res: dict) -> list[str]:
        st, e, rows = res["settings"], res["envelope"], {r["name"]: flat(r) for r in res["rows"]}
        dense = rows["adamw_ddp"]["per_step_avg_bytes"]
        cols = [
            Col("row", "name"),
            Col("MB/step", "plain_step_bytes", "mb2"),
            Col("MB on a refresh step", "refresh_step_bytes", "mb2"),
            Col("MB/step (avg over gap)", "per_step_avg_bytes", "mb2"),
            Col("× dense DDP", lambda r: r["per_step_avg_bytes"] / dense, ".3f"),
            Col("DDP bucket MB", "ddp_bucket_bytes", "mb2"),
            Col("peak RSS MB (rank 0)", "peak_rss_bytes", "mb0"),
            Col("replicas identical", lambda r: "yes" if r["replicas_identical"] else "**no**"),
        ]
        proj = [{"name": n, **p} for n, p in res["summary"]["projected"].items()]
        proj_cols = [
            Col("model", "name"),
            Col("dense DDP GB", "dense_ddp", "gb2"),
            Col("LoGRA sketch all-reduce GB", "logra_per_step_avg", "gb2"),
            Col("ratio", lambda p: p["logra_per_step_avg"] / p["dense_ddp"], ".3f"),
        ]
        return [
            f"Command: `{e['command']}` — {e['wall_seconds']:.0f} s, load {load_text(e['load_start'])}; "
            f"~{st['size']} Qwen2 shape ({st['params'] / 1e6:.1f}M params), 2 gloo processes, LoGRA rank "
            f"{st['rank']}, update_proj_gap {st['update_proj_gap']}, oversample {st['oversample']}.",
            "",
            *table(list(rows.values()), cols),
            "",
            "Computed from the shapes (same formula as the measured rows), fp32, per step:",
            "",
            *table(proj, proj_cols),
            "",
        ]

    def headline(self, results: dict) -> list[str]:
        res = results.get("ddp_comm")
        if not res:
            return []
        st, rows = res["settings"], {r["name"]: r["metrics"] for r in res["rows"]}
        ratio = rows["logra_sketch_allreduce"]["per_step_avg_bytes"] / rows["adamw_ddp"]["per_step_avg_bytes"]
        return [
            f'- DDP with LoGRA (`strategy="logra_ddp"`), ~{st["size"]}, rank {st["rank"]}: **{ratio:.3f}×** the '
            "bytes all-reduced per step of dense DDP, replicas bit-identical "
            "([table](#ddp-bytes-all-reduced-per-step))."
        ]


if __name__ == "__main__":
    main(DdpComm)
