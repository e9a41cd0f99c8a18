"""Two nodes x one process on localhost: DDP (``logra_ddp``) and FSDP2 (``ModelParallelStrategy``) with LoGRA.

Each "node" is a process this test launches the way a cluster launcher would start one per node
(``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``, ``NODE_RANK=0/1``, ``LOCAL_RANK=0``) running
``tests/lightning_strategies.py`` with ``num_nodes=2, devices=1``. After a few LoGRA steps (basis
refreshes included) the weights must equal one process on the whole batch within 1e-5, and the
two DDP replicas must be bit-identical. The FSDP2 run also clips (``gradient_clip_val``), so the
clipping norm over row-sharded sketches and DTensor gradients is checked against one process.

Run: ``.venv/bin/python -m pytest tests/test_multinode.py -q``
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from test_ddp import ROOT, SCRIPT, TIMEOUT, assert_identical, max_diff, read, run_here

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(out: Path, *args: str) -> list[tuple[dict, dict]]:
    """Launch node 0 and node 1 (one process each) and wait for both."""
    out.mkdir(parents=True)
    port = str(free_port())
    procs = []
    for node in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "NODE_RANK": str(node),
            "LOCAL_RANK": "0",
        }
        cmd = [sys.executable, str(SCRIPT), *args, "--num-nodes", "2", "--devices", "1", "--out", str(out)]
        log = open(out / f"node{node}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [p.wait(timeout=TIMEOUT) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            log.close()
    logs = "\n".join((out / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
    assert codes == [0, 0], logs
    return read(out)


def test_two_nodes_ddp_equals_one_process(tmp_path):
    ((single, _),) = run_here(tmp_path / "single")
    ranks = two_nodes(tmp_path / "nodes", "--strategy", "logra_ddp")
    assert [r["rank"] for _, r in ranks] == [0, 1] and ranks[0][1]["world"] == 2
    assert_identical(ranks)
    assert max_diff(ranks[0][0], single) <= 1e-5
    assert ranks[0][1]["modes"]["sketch"] == 4


def test_two_nodes_fsdp2_with_clipping_equals_one_process(tmp_path):
    ((single, _),) = run_here(tmp_path / "single", "--clip", "0.5")
    ranks = two_nodes(tmp_path / "nodes", "--strategy", "fsdp", "--clip", "0.5")
    assert ranks[0][1]["world"] == 2
    assert ranks[0][1]["modes"]["local"] == 4  # row-sharded: FSDP2 reduce-scatters, LoGRA reduces nothing itself
    assert_identical(ranks)  # gathered weights
    assert max_diff(ranks[0][0], single) <= 1e-5
