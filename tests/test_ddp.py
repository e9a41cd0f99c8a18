"""LoGRA under DDP: replicas bit-identical, equal to one process on the whole batch, sketches all-reduced.

Lightning runs (``tests/lightning_strategies.py`` as a subprocess: ``ddp`` re-runs ``sys.argv``)
compare every rank's weights after a few steps (basis refreshes on steps 0 and 2) with each
other (``torch.equal``) and with one process training on the concatenated batch (1e-5). The
pure-torch test checks the sketch all-reduce itself: a matrix that gets a gradient on one
replica only, the bytes reduced, and the start-up broadcast.

Run: ``.venv/bin/python -m pytest tests/test_ddp.py -q``
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_run  # tests/conftest.py
from ranks import init_gloo, spawn_ranks

from logra_lightning.optim import LoGRA, keep_out_of_ddp, logra_param_groups

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "lightning_strategies.py"
TIMEOUT = 300  # seconds per run: a deadlocked collective fails the test instead of hanging it

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


def run(out: Path, *args: str, env: dict[str, str] | None = None) -> list[tuple[dict, dict]]:
    """Run the script; ``[(params, record)]`` per rank."""
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    env.pop("LOCAL_RANK", None)
    cmd = [sys.executable, str(SCRIPT), *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return read(out)


def run_here(out: Path, *args: str) -> list[tuple[dict, dict]]:
    """The script's one-process run, in this process (no interpreter to start): ``[(params, record)]``."""
    import lightning_strategies

    out.mkdir(parents=True)
    lightning_strategies.main([*args, "--out", str(out)])
    return read(out)


def read(out: Path) -> list[tuple[dict, dict]]:
    ranks = sorted(out.glob("rank*.pt"))
    return [
        (torch.load(p, weights_only=True), json.loads(p.with_suffix(".json").read_text()))
        for p in sorted(ranks, key=lambda p: int(p.stem[4:]))
    ]


def assert_identical(ranks: list[tuple[dict, dict]]) -> None:
    first = ranks[0][0]
    for params, record in ranks[1:]:
        for name, value in params.items():
            assert torch.equal(value, first[name]), f"rank {record['rank']} differs from rank 0 in {name}"


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    """One process on the whole batch (the reference); the matrices must have moved."""
    ((params, _),) = run_here(tmp_path_factory.mktemp("single") / "out")
    return params


def test_logra_ddp_replicas_identical_and_equal_to_one_process(tmp_path, single):
    ranks = run(tmp_path / "out", "--strategy", "logra_ddp", "--devices", "2")
    assert len(ranks) == 2
    assert_identical(ranks)
    assert max_diff(ranks[0][0], single) <= 1e-5
    record = ranks[0][1]
    # every matrix is LoGRA's and out of DDP; DDP keeps the biases and the LayerNorm
    assert record["modes"] == {"local": 0, "sketch": 4, "grad": 0}
    assert record["ddp_ignored"] == ["net.down.weight", "net.embed.weight", "net.head.weight", "net.up.weight"]
    assert record["data_parallel_bytes"] > 0


def test_plain_ddp_is_correct_without_the_saving(tmp_path, single):
    """``Trainer(strategy="ddp")`` as a new user writes it: DDP averages full gradients, LoGRA sketches them."""
    ranks = run(tmp_path / "out", "--strategy", "ddp", "--devices", "2")
    assert_identical(ranks)
    assert max_diff(ranks[0][0], single) <= 1e-5
    assert ranks[0][1]["modes"] == {"local": 0, "sketch": 0, "grad": 4}
    assert ranks[0][1]["data_parallel_bytes"] == 0


@pytest.mark.slow
def test_logra_ddp_spawn_manual_optimization(tmp_path):
    """``ddp_spawn`` and manual optimization (``manual_backward``, the user's own clipping call)."""
    ((ref, ref_record),) = run_here(tmp_path / "one", "--manual", "--clip", "0.5")
    ranks = run(tmp_path / "two", "--strategy", "logra_ddp_spawn", "--devices", "2", "--manual", "--clip", "0.5")
    assert_identical(ranks)
    assert max_diff(ranks[0][0], ref) <= 1e-5
    assert ranks[0][1]["clip_norms"] == pytest.approx(ref_record["clip_norms"], rel=1e-5)


def test_accumulation_under_ddp_equals_one_batch(tmp_path, single):
    """``accumulate_grad_batches=2`` (DDP's ``no_sync`` on the first micro-batch): still the same step."""
    ranks = run(tmp_path / "out", "--strategy", "logra_ddp", "--devices", "2", "--accumulate", "2")
    assert_identical(ranks)
    assert max_diff(ranks[0][0], single) <= 1e-5


# ---------------------------------------------------------------- the all-reduce itself (no Lightning)
class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_b: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))  # [B, 16]
        if bool(use_b.any()):  # b (and its bias, which DDP reduces) gets no gradient on a replica without such rows
            h = h + use_b[:, None] * self.b(h)
        return self.c(h).pow(2).mean()


def _model() -> torch.nn.Module:
    return _Net()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 8, generator=g)
    return x, torch.tensor([1.0] * 4 + [0.0] * 4)  # [8, 8]; only the first half (rank 0's rows) uses b


def _optimizer(model) -> LoGRA:
    return LoGRA(
        logra_param_groups(model, rank=4, update_proj_gap=2),
        lr=1e-2,
        eps=1e-6,
        basis_dtype="float32",
        exp_avg_dtype="float32",
    )


def _train(model, opt, rows: slice, steps: int = 4) -> None:
    for step in range(steps):
        x, use_b = _data(step)
        model(x[rows], use_b[rows]).backward()
        opt.step()
        opt.zero_grad()


def _worker(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, 2, out)
    model = _model()
    if rank == 1:  # different start weights: LoGRA must broadcast what it keeps out of DDP
        with torch.no_grad():
            model.b.weight.add_(1.0)
    opt = _optimizer(model)
    names = keep_out_of_ddp(model, opt.lowrank_params())
    opt.setup_data_parallel()
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    assert ddp.parameters_to_ignore == set(names)
    _train(ddp, opt, slice(rank * 4, (rank + 1) * 4))
    # kept out of DDP but not told (no setup_data_parallel): refused at the step, not left to drift
    other = _model()
    stale = _optimizer(other)
    keep_out_of_ddp(other, stale.lowrank_params())
    other(*_data(0)).backward()
    try:
        stale.step()
        error = ""
    except RuntimeError as err:
        error = str(err)
    torch.save(
        {
            "params": {n: p.detach() for n, p in model.named_parameters()},
            "bytes": opt.data_parallel_bytes,
            "error": error,
        },
        f"{out}/rank{rank}.pt",
    )


def test_sketch_all_reduce_matches_one_process(tmp_path):
    spawn_ranks(_worker, (str(tmp_path),), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    model = _model()
    start = model.b.weight.detach().clone()
    opt = _optimizer(model)
    _train(model, opt, slice(None))
    for name, p in model.named_parameters():
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
        assert float((ranks[0]["params"][name] - p.detach()).abs().max()) <= 1e-5, name
    assert float((model.b.weight.detach() - start).abs().max()) > 1e-3  # b learned from rank 0's rows alone
    # fp32 numbers per step: 3 flags + sketches a [4, 8] (left), b [16, 4], c [4, 4] (right); on the
    # refresh steps 0 and 2 also range sketches [16, 4 + 8] each (oversample 8)
    assert ranks[0]["bytes"] == 4 * (4 * (3 + 32 + 64 + 16) + 2 * 3 * 16 * 12)
    assert "call opt.setup_data_parallel() after keep_out_of_ddp()" in ranks[0]["error"]


# ------------------------------------------------------------------------------- logra fit
def test_logra_fit_ddp_replicas_identical(tmp_path, tiny_policy_path):
    """``logra fit --trainer.strategy ddp`` (LoGRA: run as ``logra_ddp``) with clipping: identical policies."""
    out = tmp_path / "weights"
    out.mkdir()
    callbacks = [
        {
            "class_path": "logra_lightning.callbacks.KLStepControl",
            "init_args": {"target_kl": 1e-3, "sample_tokens": 32},
        },
        {"class_path": "lightning_strategies.WriteWeights", "init_args": {"out": str(out)}},
    ]
    script = Path(sys.executable).with_name("logra")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "logra_lightning"]
    cmd += ["fit", "--config", str(ROOT / "configs" / "arithmetic_tiny_logra.yaml")]
    cmd += ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    cmd += [*tiny_run(tmp_path, 3), "--trainer.callbacks", json.dumps(callbacks), "--model.gradient_clip_norm", "0.5"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "using 'logra_ddp'" in proc.stdout + proc.stderr
    ranks = read(out)
    assert len(ranks) == 2
    assert_identical(ranks)
    record = ranks[0][1]
    assert record["modes"]["sketch"] > 0 and record["modes"]["grad"] == 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (log_dir,) = (tmp_path / "arithmetic_tiny_logra").iterdir()
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    norms = [e.value for e in acc.Scalars("grad/norm")]
    assert len(norms) == 3 and max(norms) > 0 and all(math.isfinite(v) for v in norms)
