"""The spawned-rank helper turns a hung rank into a failed test within its deadline."""

from __future__ import annotations

import time

import pytest
import torch.multiprocessing as mp
from ranks import spawn_ranks


def _rank_one_hangs(rank: int) -> None:
    if rank == 1:
        time.sleep(3600)


def test_a_hung_rank_fails_fast_with_its_stack(capfd):
    start = time.monotonic()
    with pytest.raises(mp.ProcessExitedException):
        spawn_ranks(_rank_one_hangs, (), nprocs=2, timeout_s=3)
    assert time.monotonic() - start < 30
    assert "_rank_one_hangs" in capfd.readouterr().err  # faulthandler's dump names the hung frame
