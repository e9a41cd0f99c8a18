"""One small Lightning fit of a tiny LM under a given strategy; every rank writes its final weights.

A helper of ``tests/test_ddp.py`` and ``tests/test_multinode.py``, run as a script because
Lightning's ``ddp`` and ``ModelParallelStrategy`` start the other processes by re-running
``sys.argv`` (and a multi-node run is two processes the test launches itself). The one-process
reference runs call :func:`main` with an argument list in the test's own process.

Every optimizer step takes one fixed global batch of ``BATCH`` sequences; rank ``r`` of ``W``
trains on rows ``[r*BATCH/W, (r+1)*BATCH/W)``, split into ``--accumulate`` micro-batches. So
a run on one process and a run on ``W`` processes see the same data, and with a mean loss the
same gradient: their weights must agree to rounding.

Run: ``python tests/lightning_strategies.py --strategy logra_ddp --devices 2 --out /tmp/o``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

from logra_lightning.optim import LoGRA, logra_param_groups

VOCAB, SEQ, BATCH, WIDTH = 64, 12, 8, 32
# fp32 storage and eps 1e-6: the runs compared differ in summation order (one batch vs halves),
# which bf16 rounding of a basis or an Adam eps of 1e-8 on tiny entries would magnify
HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
LOGRA = dict(rank=4, update_proj_gap=2, basis_dtype="float32", exp_avg_dtype="float32")


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)  # [B, T]


class Net(nn.Module):
    """Embedding -> residual MLP -> LayerNorm -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # [B, T, D]
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(self.norm(h))  # [B, T, V]


class TinyLM(L.LightningModule):
    """:class:`Net` trained on next-token cross-entropy."""

    def __init__(self, optimizer: str, manual: bool, accumulate: int, clip: float | None) -> None:
        super().__init__()
        self.optimizer_name, self.accumulate, self.clip = optimizer, accumulate, clip
        self.automatic_optimization = not manual
        torch.manual_seed(0)
        self.net = Net()
        self.record: dict = {}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(ids)

    def configure_model(self) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy

        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for name in ("up", "down", "head"):
                fully_shard(getattr(self.net, name), mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), **HP)
        return LoGRA(logra_param_groups(self.net, **LOGRA), **HP)

    def _rows(self, micro: int) -> torch.Tensor:
        world, rank = self.trainer.world_size, self.global_rank
        per = BATCH // world
        return global_batch(self.global_step)[rank * per : (rank + 1) * per].chunk(self.accumulate)[micro]

    def _loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self(ids[:, :-1])  # [b, T-1, V]
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def kl_probe_logits(self, max_tokens: int) -> torch.Tensor:
        """Logits ``[N, V]`` at the first ``max_tokens`` positions of the step's batch (KLStepControl's protocol)."""
        return self(self._probe_ids[:, :-1]).reshape(-1, VOCAB)[:max_tokens]

    def training_step(self, batch, batch_idx: int):
        self._probe_ids = global_batch(self.global_step)
        if self.automatic_optimization:
            return self._loss(self._rows(batch_idx % self.accumulate))
        opt = self.optimizers()
        self.manual_backward(self._loss(self._rows(0)))
        if self.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), self.clip)  # a user's own clipping call
            self.record.setdefault("clip_norms", []).append(float(norm))
        opt.step()
        opt.zero_grad()

    def on_fit_end(self) -> None:
        params, record = rank_record(self.trainer, self)
        out = Path(self.out_dir)
        torch.save(params, out / f"rank{self.global_rank}.pt")
        (out / f"rank{self.global_rank}.json").write_text(json.dumps({**self.record, **record}))


def rank_record(trainer: L.Trainer, module: L.LightningModule) -> tuple[dict, dict]:
    """Every weight (gathered from FSDP2 shards) and what the optimizer says about data parallelism."""
    params = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()
    }
    opt = trainer.optimizers[0]
    opt = getattr(opt, "optimizer", opt)
    record = dict(
        rank=trainer.global_rank,
        world=trainer.world_size,
        data_parallel_bytes=getattr(opt, "data_parallel_bytes", 0),
        modes=opt.setup_data_parallel() if isinstance(opt, LoGRA) else {},
        ddp_ignored=sorted(n for n, p in module.named_parameters() if getattr(p, "_ddp_ignored", False)),
        metrics={k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1},
    )
    return params, record


class WriteWeights(Callback):
    """At the end of fit, every rank writes ``rank<r>.pt`` (weights) and ``rank<r>.json`` (:func:`rank_record`)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params, record = rank_record(trainer, pl_module)
        torch.save(params, Path(self.out) / f"rank{trainer.global_rank}.pt")
        (Path(self.out) / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main(argv: list[str] | None = None) -> None:
    """Fit as the command line (``argv``, or ``sys.argv[1:]``) says; each rank writes its weights to ``--out``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--optimizer", default="logra", choices=["logra", "adamw"])
    ap.add_argument("--manual", action="store_true")
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--clip-algorithm", default="norm")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    strategy = args.strategy
    if strategy == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        world = args.devices * args.num_nodes
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    module = TinyLM(args.optimizer, args.manual, args.accumulate, args.clip if args.manual else None)
    module.out_dir = args.out
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_steps=args.steps,
        accumulate_grad_batches=1 if args.manual else args.accumulate,
        gradient_clip_val=None if args.manual else args.clip,
        gradient_clip_algorithm=None if args.manual or args.clip is None else args.clip_algorithm,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    loader = DataLoader(list(range(args.steps * args.accumulate)), batch_size=1)
    trainer.fit(module, loader)


if __name__ == "__main__":
    main()
