"""Spawned gloo ranks for the multi-process tests, bounded in time.

A rank that hangs (a peer gone before a collective, a stuck teardown) must fail its test in minutes with
its stack on stderr, not hold the suite until CI's limit: `spawn_ranks` joins with a deadline and kills
what is left, each rank dumps its Python stacks (faulthandler) and exits before that deadline, and
`init_gloo` gives every collective a timeout far below gloo's 30-minute default.

The group is torn down here, after the worker has returned, never inside it: a worker that destroyed it
itself left its locals alive, and when DDP's reducer was freed at return it held the gloo group's last
reference; `~ProcessGroupGloo` then joined gloo's worker thread with the GIL held while that thread waited
for the GIL to free a finished all-reduce's tensors — a deadlock the suite hit. Here the worker's objects
are gone and collected while the group is still registered, a barrier leaves it idle, and only then is it
destroyed.
"""

from __future__ import annotations

import faulthandler
import gc
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

RANK_TIMEOUT_S = 300  # the slowest spawned test here takes ~40 s on 2 cores


def init_gloo(rank: int, world_size: int, store_dir: str, timeout_s: float = 120) -> None:
    """Join a file-store gloo group whose collectives raise after `timeout_s` instead of waiting 30 min.

    Call it in a worker run by :func:`spawn_ranks`, which destroys the group once the worker has returned.
    """
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_dir}/store",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def _bounded(rank: int, fn: Callable, args: tuple, timeout_s: float) -> None:
    # exit=True: a hung rank prints every thread's stack and exits 1, so the parent's join sees a failure
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    fn(rank, *args)
    if dist.is_initialized():  # see the module docstring for why the teardown is here
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def spawn_ranks(fn: Callable, args: tuple, nprocs: int = 2, timeout_s: float = RANK_TIMEOUT_S) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)`, but raise TimeoutError instead of waiting forever."""
    ctx = mp.start_processes(_bounded, args=(fn, args, timeout_s), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s + 30  # the ranks' own dumps come first
    while not ctx.join(timeout=5):  # raises ProcessRaisedException / ProcessExitedException on a failed rank
        if time.monotonic() > deadline:
            alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"ranks {alive} of {nprocs} still running after {timeout_s + 30:.0f} s; killed")
