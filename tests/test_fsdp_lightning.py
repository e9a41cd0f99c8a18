"""FSDP2 under Lightning: ``configs/arithmetic_fsdp.yaml`` end to end, sharded checkpoints, factor gathering.

``ModelParallelStrategy`` on CPU starts the second process by re-running ``sys.argv``, so
every Lightning run here is a subprocess: the config through the ``logra`` command, and the
resume test through this file run as a script (it needs seeded rollouts, see
:class:`SeededRollouts`). The factor-gathering test spawns two gloo processes itself.

Run: ``.venv/bin/python -m pytest tests/test_fsdp_lightning.py -q -s`` (``-s`` prints the
per-rank optimizer-state bytes of the Lightning run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from ranks import init_gloo, spawn_ranks

from logra_lightning.rl.module import PolicyGradientModule

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "arithmetic_fsdp.yaml"
WORLD = 2
TIMEOUT = 300  # seconds per Lightning run; a deadlocked collective fails the test instead of hanging it

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


def tiny_budget(tmp_path: Path, steps: int) -> list[str]:
    return [
        "--trainer.max_steps",
        str(steps),
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--data.batch_size",
        "4",
        "--model.group_size",
        "4",
        "--data.val.init_args.test_size",
        "8",
        "--data.val_batch_size",
        "8",  # held-out eval runs on every rank
    ]


def run_lightning(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # PYTHONPATH: the processes import this checkout, whichever one pytest runs from
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, (
        f"{' '.join(command)}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
    )
    return proc


def logra_command() -> list[str]:
    script = Path(sys.executable).with_name("logra")  # the console script `make venv` installs
    return [str(script)] if script.exists() else [sys.executable, "-m", "logra_lightning"]


def scalars(log_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def single_process_state_bytes(model_path: str, optimizer_args: dict) -> int:
    """LoGRA's state on one process, after one step (dense AdamW moments exist), for the same policy."""
    from logra_lightning.models import load_policy
    from logra_lightning.optim import LoGRA, optimizer_state_bytes

    policy, tok = load_policy(model_path)
    opt = LoGRA(list(policy.named_parameters()), **optimizer_args)
    ids = torch.tensor([tok.encode("12+34=46")])  # [1, T]
    policy(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return optimizer_state_bytes(opt)


# ------------------------------------------------------------------ (a) the config
def test_fsdp_config_runs_and_halves_optimizer_state(tmp_path, tiny_policy_path):
    import yaml

    run_lightning([*logra_command(), "fit", "--config", str(CONFIG), *tiny_budget(tmp_path, 3)])
    (log_dir,) = (tmp_path / "arithmetic_fsdp").iterdir()
    logged = scalars(log_dir)
    assert len(logged["reward/mean"]) == 3
    summary = json.loads((log_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and 0.0 <= summary["accuracy_after"] <= 1.0
    ckpt = log_dir / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == WORLD  # a distributed checkpoint, one file per rank

    optimizer_args = yaml.safe_load(CONFIG.read_text())["model"]["optimizer"]["init_args"]
    single = single_process_state_bytes(tiny_policy_path, optimizer_args)
    per_rank = [logged[f"memory/rank{r}/optimizer_state_gb"][-1] * 1e9 for r in range(WORLD)]
    print(
        f"\nLoGRA optimizer state: single process {single} B; FSDP2 per rank {[round(b) for b in per_rank]} B "
        f"({', '.join(f'{b / single:.3f}' for b in per_rank)} of single)"
    )
    assert max(per_rank) < 0.56 * single  # every state tensor is sharded: about half per rank


# --------------------------------------------------------- (b) save and resume
class SeededRollouts(PolicyGradientModule):
    """Seeds each step's sampling with ``(global_step, rank)``: a resumed run then samples what the
    uninterrupted run sampled, where the global RNG (not in Lightning checkpoints) would differ."""

    def training_step(self, batch, batch_idx):
        self.sampling = dataclasses.replace(self.sampling, seed=1000 * self.global_step + self.global_rank)
        return super().training_step(batch, batch_idx)


class Recorder(L.Callback):
    """Writes this rank's optimizer state at fit start and at step ``save_at`` (after a checkpoint
    saved there), and the gathered parameters at the end of fit, under ``out``."""

    def __init__(self, out: Path, save_at: int) -> None:
        self.out, self.save_at = out, save_at

    def _dump_optimizer(self, trainer: L.Trainer, tag: str) -> None:
        opt = trainer.optimizers[0]
        names = {id(p): n for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}
        state = {
            names[id(p)]: {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in st.items()}
            for p, st in opt.state.items()
        }
        torch.save(state, self.out / f"{tag}_rank{trainer.global_rank}.pt")

    def on_train_start(self, trainer, pl_module):
        self._dump_optimizer(trainer, "start")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.save_at:
            trainer.save_checkpoint(self.out / f"step{self.save_at}.ckpt")  # what ModelCheckpoint does here
            self._dump_optimizer(trainer, "saved")

    def on_train_end(self, trainer, pl_module):
        params = {n: p.detach().full_tensor() for n, p in pl_module.policy.named_parameters()}  # collective
        if trainer.is_global_zero:
            torch.save(params, self.out / "params.pt")


def resume_driver(argv: list[str]) -> None:
    """``python tests/test_fsdp_lightning.py --config ... [overrides]``: the config's fit with
    :class:`SeededRollouts` and a :class:`Recorder`; ``LOGRA_TEST_OUT``, ``LOGRA_TEST_SAVE_AT`` and
    ``LOGRA_TEST_CKPT`` (resume from) come from the environment, which rank 1 inherits."""
    from lightning.pytorch.cli import LightningCLI

    from logra_lightning.cli.lightning_cli import TRAINER_DEFAULTS
    from logra_lightning.data import PromptDataModule

    cli = LightningCLI(
        SeededRollouts,
        PromptDataModule,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        trainer_defaults=TRAINER_DEFAULTS,
        args=argv,
        run=False,
    )
    cli.trainer.callbacks.append(Recorder(Path(os.environ["LOGRA_TEST_OUT"]), int(os.environ["LOGRA_TEST_SAVE_AT"])))
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=os.environ.get("LOGRA_TEST_CKPT") or None)


@pytest.mark.slow  # two 2-process Lightning runs: ~50-60 s on the shared 2 cores
def test_sharded_checkpoint_resume_equals_uninterrupted_run(tmp_path, tiny_policy_path):
    k, j = 2, 2
    # one epoch = k steps: the checkpoint sits at an epoch boundary, where Lightning resumes a plain
    # (non-stateful) dataloader exactly; update_proj_gap=3 puts a basis refresh after the resume
    args = [
        sys.executable,
        __file__,
        "--config",
        str(CONFIG),
        *tiny_budget(tmp_path, k + j),
        "--trainer.limit_train_batches",
        str(k),
        "--trainer.limit_val_batches",
        "0",
        "--model.optimizer.init_args.lr",
        "1e-3",
        "--model.optimizer.init_args.update_proj_gap",
        "3",
    ]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    full.mkdir(), resumed.mkdir()
    run_lightning(args, {"LOGRA_TEST_OUT": str(full), "LOGRA_TEST_SAVE_AT": str(k)})
    ckpt = full / f"step{k}.ckpt"
    run_lightning(args, {"LOGRA_TEST_OUT": str(resumed), "LOGRA_TEST_SAVE_AT": "-1", "LOGRA_TEST_CKPT": str(ckpt)})

    for rank in range(WORLD):  # every rank gets back its own shard of the state, not rank 0's
        saved = torch.load(full / f"saved_rank{rank}.pt", weights_only=True)
        loaded = torch.load(resumed / f"start_rank{rank}.pt", weights_only=True)
        assert saved.keys() == loaded.keys()
        for name, st in saved.items():
            assert st.keys() == loaded[name].keys(), name
            for key, value in st.items():
                assert torch.equal(value, loaded[name][key]), f"rank {rank}: {name}[{key!r}] changed in save/load"

    start = torch.load(full / "start_rank0.pt", weights_only=True)
    assert any(int(st["step"]) == 0 for st in start.values())  # the uninterrupted run started fresh
    a = torch.load(full / "params.pt", weights_only=True)
    b = torch.load(resumed / "params.pt", weights_only=True)
    from logra_lightning.models import load_policy

    initial = dict(load_policy(tiny_policy_path)[0].named_parameters())
    moved = max(float((a[n] - initial[n].detach()).abs().max()) for n in a)
    worst = max(float((a[n] - b[n]).abs().max()) for n in a)
    print(f"\nresume after {k} of {k + j} steps: max |param diff| {worst:.2e} (params moved up to {moved:.2e})")
    assert moved > 1e-4  # the runs really trained, so equality means something
    assert worst <= 1e-5


# ------------------------------------- (c) factors and DCP on two raw processes
OPT_ARGS = dict(lr=1e-2, weight_decay=0.1, rank=4, update_proj_gap=1)


def _sharded_worker(rank: int, model_dir: str, out_dir: str) -> None:
    """Two LoGRA steps on a sharded tiny Qwen2, then: gather the last step's factors; save the optimizer
    with DCP as ``ModelParallelStrategy`` does and load it into a fresh sharded optimizer."""
    torch.set_num_threads(1)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    from logra_lightning.models import load_policy
    from logra_lightning.models.fsdp import shard_policy
    from logra_lightning.optim import LoGRA
    from logra_lightning.sync.gather import gather_update_factors

    init_gloo(rank, WORLD, out_dir)
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model = shard_policy(load_policy(model_dir)[0], mesh)
    opt = LoGRA(list(model.named_parameters()), **OPT_ARGS)
    opt.record_updates = True
    for step in range(2):  # step 2 uses a basis fitted to the gradients (and a rotated state)
        before = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
        ids = torch.randint(3, 98, (2, 12), generator=torch.Generator().manual_seed(10 * step + rank))  # [B, T]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        (updates,) = opt.pop_applied_updates()
    gathered = gather_update_factors(opt, updates)
    after = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    # a bf16 wire with match_rounding: each rank adds round(L) @ round(R) - L @ R to its own rows
    from logra_lightning.callbacks.weight_sync import _apply_wire_rounding

    _apply_wire_rounding(opt, updates, torch.bfloat16)
    rounded = {n: p.detach().full_tensor() for n, p in model.named_parameters()}

    # the calls of Lightning's ModelParallelStrategy.save_checkpoint / load_checkpoint
    dcp.save(
        {"optimizer_0": get_optimizer_state_dict(model, opt, options=StateDictOptions(cpu_offload=True))},
        checkpoint_id=f"{out_dir}/ckpt",
    )
    model2 = shard_policy(load_policy(model_dir)[0], mesh)
    opt2 = LoGRA(list(model2.named_parameters()), **OPT_ARGS)
    template = {"optimizer_0": get_optimizer_state_dict(model2, opt2)}
    dcp.load(template, checkpoint_id=f"{out_dir}/ckpt")
    set_optimizer_state_dict(model2, opt2, template["optimizer_0"], options=StateDictOptions(cpu_offload=True))
    names = {id(p): n for g in opt2.param_groups for n, p in zip(g["param_names"], g["params"])}
    restored = {names[id(p)]: st for p, st in opt2.state.items()}
    original = {n: opt.state[p] for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}
    record = {
        "restored": {n: {k: v.clone() for k, v in st.items()} for n, st in restored.items()},
        "original": {n: {k: v.clone() for k, v in st.items()} for n, st in original.items()},
    }
    if rank == 0:
        record.update(
            updates=[(u.name, u.c, u.left, u.right) for u in gathered],
            local_rows=[u.left.shape[0] for u in updates],
            before=before,
            after=after,
            rounded=rounded,
        )
    torch.save(record, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> list[dict]:
    """Each rank's record from :func:`_sharded_worker` (one spawn shared by the tests below)."""
    from logra_lightning.models import TinyModelConfig, build_tiny_model

    tmp = tmp_path_factory.mktemp("sharded")
    # intermediate 351: gate/up_proj [351, 128] take left sketches over uneven row shards (176 + 175)
    model_dir = build_tiny_model(tmp / "model", TinyModelConfig(num_layers=1, intermediate_size=351))
    out = tmp / "out"
    out.mkdir()
    spawn_ranks(_sharded_worker, (model_dir, str(out)), nprocs=WORLD)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def test_gather_update_factors_rebuilds_the_sharded_step(sharded_run):
    from logra_lightning.optim.logra import resolve_side

    rec = sharded_run[0]
    before, after = rec["before"], rec["after"]
    sides = set()
    for (name, c, left, right), local_rows in zip(rec["updates"], rec["local_rows"]):
        m, n = before[name].shape
        assert left.shape == (m, right.shape[0]) and right.shape[1] == n, name  # full-shape thin factors
        assert local_rows < m, name  # rank 0 really held only part of the rows
        rebuilt = c * before[name] + left @ right  # W <- c*W + L@R, as the engine applies it
        diff = float((rebuilt - after[name]).abs().max())
        assert diff <= 1e-6, f"{name}: gathered factors miss the sharded step by {diff:.2e}"
        sides.add(resolve_side("auto", (m, n)))
    assert sides == {"left", "right"}  # both factor layouts were gathered
    for name, c, left, right in rec["updates"]:  # what the engine gets from a bf16 wire, and the trainer now holds
        on_wire = c * before[name] + left.bfloat16().float() @ right.bfloat16().float()
        assert float((on_wire - rec["rounded"][name]).abs().max()) <= 1e-6, name
        assert not torch.equal(rec["rounded"][name], after[name]), name
    assert len(rec["updates"]) == sum(len(before[n].shape) == 2 for n in before)  # every matrix


def test_dcp_round_trip_restores_each_rank_its_own_shard(sharded_run):
    for rank, rec in enumerate(sharded_run):
        assert rec["restored"].keys() == rec["original"].keys()
        for name, st in rec["original"].items():
            assert rec["restored"][name].keys() == st.keys(), name
            for key, value in st.items():
                assert torch.equal(rec["restored"][name][key], value), f"rank {rank}: {name}[{key!r}] not restored"
    # the ranks' pieces differ, so a replicated save (one rank's copy for all) would have failed above
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sharded_run[0]["original"][q]["exp_avg"], sharded_run[1]["original"][q]["exp_avg"])


def test_gather_update_factors_is_a_no_op_on_whole_matrices():
    from logra_lightning.optim import LoGRA
    from logra_lightning.sync.gather import gather_update_factors

    model = torch.nn.Linear(8, 6)
    opt = LoGRA(list(model.named_parameters()), lr=1e-2, rank=2)
    opt.record_updates = True
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    (updates,) = opt.pop_applied_updates()
    assert gather_update_factors(opt, updates) == updates
    with pytest.raises(KeyError, match="nope.weight"):
        gather_update_factors(opt, [dataclasses.replace(updates[0], name="nope.weight")])


# ------------------------------------------------ (d) the format, one process
def test_state_dict_lists_every_param_and_loads_by_name():
    from logra_lightning.optim import LoGRA, optimizer_state_bytes

    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))  # weights low-rank, biases dense
    opt = LoGRA(list(model.named_parameters()), lr=1e-2, rank=2)
    fresh = opt.state_dict()
    assert sorted(fresh["state"]) == [0, 1, 2, 3]  # dense biases too, before their first step (DCP needs a slot)
    opt2 = LoGRA(list(model.named_parameters()), lr=1e-2, rank=2)
    opt2.load_state_dict(fresh)
    assert optimizer_state_bytes(opt2) == optimizer_state_bytes(opt)  # the placeholders are dropped again

    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    by_name = {  # keyed by parameter name, as DCP's set_optimizer_state_dict hands it over
        "state": {
            name: sd["state"][i] for i, name in enumerate(n for g in sd["param_groups"] for n in g["param_names"])
        },
        "param_groups": [{**g, "params": list(g["param_names"])} for g in sd["param_groups"]],
    }
    opt2.load_state_dict(by_name)
    for p in model.parameters():
        assert opt2.state[p].keys() == opt.state[p].keys()
        assert all(torch.equal(opt2.state[p][k], v) for k, v in opt.state[p].items())

    other_rank = LoGRA(list(model.named_parameters()), lr=1e-2, rank=3)
    with pytest.raises(ValueError, match=r"'0.weight' has basis of shape \(8, 2\) in the checkpoint but \(8, 3\)"):
        other_rank.load_state_dict(sd)


if __name__ == "__main__":  # the resume test runs this file (and Lightning re-runs it for rank 1)
    resume_driver(sys.argv[1:])
