"""One small Lightning fit of a tiny LM under a given strategy; every rank writes its final weights.

A helper of ``tests/test_ddp.py`` and ``tests/test_multinode.py``, run as a script because
Lightning's ``ddp`` and ``ModelParallelStrategy`` start the other processes by re-running
``sys.argv`` (and a multi-node run is two processes the test launches itself).

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


class TinyLM(L.LightningModule):
    """Embedding -> residual MLP -> LayerNorm -> head; next-token cross-entropy."""

    def __init__(self, optimizer: str, manual: bool, accumulate: int, clip: float | None) -> None:
        super().__init__()
        self.optimizer_name, self.accumulate, self.clip = optimizer, accumulate, clip
        self.automatic_optimization = not manual
        torch.manual_seed(0)
        self.net = nn.ModuleDict(
            dict(
                embed=nn.Embedding(VOCAB, WIDTH),
                up=nn.Linear(WIDTH, 2 * WIDTH),
                down=nn.Linear(2 * WIDTH, WIDTH),
                norm=nn.LayerNorm(WIDTH),
                head=nn.Linear(WIDTH, VOCAB),
            )
        )
        self.record: dict = {}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.net["embed"](ids)  # [B, T, D]
        h = h + self.net["down"](torch.nn.functional.gelu(self.net["up"](h)))
        return self.net["head"](self.net["norm"](h))  # [B, T, V]

    def configure_model(self) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy

        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for name in ("up", "down", "head"):
                fully_shard(self.net[name], mesh=mesh)
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

    def training_step(self, batch, batch_idx: int):
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
        params = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in self.named_parameters()
        }
        opt = self.optimizers()
        opt = getattr(opt, "optimizer", opt)
        self.record.update(
            rank=self.global_rank,
            world=self.trainer.world_size,
            data_parallel_bytes=getattr(opt, "data_parallel_bytes", 0),
            modes=opt.setup_data_parallel() if isinstance(opt, LoGRA) else {},
            ddp_ignored=sorted(n for n, p in self.named_parameters() if getattr(p, "_ddp_ignored", False)),
        )
        out = Path(self.out_dir)
        torch.save(params, out / f"rank{self.global_rank}.pt")
        (out / f"rank{self.global_rank}.json").write_text(json.dumps(self.record))


def main() -> None:
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
    args = ap.parse_args()
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
