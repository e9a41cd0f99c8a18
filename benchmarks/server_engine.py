"""The demo with its vLLM engine in a separate ``vllm serve`` process: syncs, drift, a restart, off-policy throughput.

Run (about 10 min on 2 cores):

    .venv/bin/python -m benchmarks.server_engine
    .venv/bin/python -m benchmarks.server_engine --quick      # 8 steps, restart at 4, 6-step throughput runs

1. ``logra serve --model builtin:arithmetic-tiny`` starts the server (its own process group).
2. ``logra fit --config configs/arithmetic_tiny_server.yaml`` trains ``--steps`` steps against it
   (the demo: LoGRA, KL control, one full sync then a low-rank sync per step). After step
   ``--restart-at`` the benchmark's :class:`RestartServer` callback kills the server's process group
   and starts a new server on the same port: the next rollout meets a dead server, the trainer waits,
   re-syncs and goes on. Recorded from TensorBoard: bytes of every sync, the engine's drift
   (``sync/logprob_abs_diff_max``: engine vs trainer logprob of the sampled tokens, every step),
   recoveries, held-out accuracy before and after.
3. Throughput: ``--throughput-steps`` steps on-policy, then the same with ``model.off_policy_steps=1``
   (the next batch sampled while this one trains; ``tis_cap`` 2): median ``perf/step_seconds`` of each.
   Trainer and server share the same 2 cores here, so overlap can hardly pay; on separate devices it can.

Result: ``benchmarks/results/server_engine[_quick].json`` with ``summary`` = ``{"syncs", "drift_max",
"bytes_per_sync_lowrank", "bytes_per_sync_full", "restart_recovered"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import time
from pathlib import Path

import lightning as L

from benchmarks.common import (
    CONFIGS,
    RESULTS,
    ROOT,
    WORK_DIR,
    config_callbacks,
    load_average,
    logra_fit,
    machine_info,
    write_result,
)
from benchmarks.report import Report, command_head, num, table

CONFIG = CONFIGS / "arithmetic_tiny_server.yaml"
MODEL = "builtin:arithmetic-tiny"
SERVER_ARGS = ("--max-model-len", "64", "--seed", "0")
FULL = dict(steps=60, restart_at=30, throughput_steps=30)
QUICK = dict(steps=8, restart_at=4, throughput_steps=6)
DRIFT_TARGET = 1e-4


class RestartServer(L.Callback):
    """After optimizer step ``at_step``, kill the server whose pid is in ``pid_file`` (its process group) and start
    a new one on ``port``; the trainer meets the dead server at its next rollout. Logs nothing."""

    def __init__(self, pid_file: str, port: int, at_step: int, log_path: str) -> None:
        self.pid_file, self.port, self.at_step, self.log_path = pid_file, port, at_step, log_path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.at_step or getattr(self, "_done", False):
            return
        self._done = True
        kill_group(int(Path(self.pid_file).read_text()))
        start_server(self.port, self.pid_file, self.log_path)


class BatchClock(L.Callback):
    """Logs ``bench/batch_wall``: wall seconds from one batch's end to the next's (the rollout, the step and the
    sync, with whatever overlaps), the honest cost of a step whichever way rollouts are scheduled."""

    def __init__(self) -> None:
        self.last = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self.last is not None:
            for logger in trainer.loggers:
                logger.log_metrics({"bench/batch_wall": now - self.last}, step=trainer.global_step)
        self.last = now


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_server(port: int, pid_file: str, log_path: str):
    from logra_lightning.cli import serve

    proc = serve.spawn(MODEL, port, *SERVER_ARGS, log_path=log_path)
    Path(pid_file).write_text(str(proc.pid))
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _values(scalars: dict, tag: str) -> list[float]:
    return [v for _, v in scalars.get(tag, [])]


def sync_summary(run: dict) -> dict:
    """Syncs by kind, bytes, drift and recoveries from one run's TensorBoard scalars."""
    sc = run["scalars"]
    dense = max(_values(sc, "sync/dense_bytes"))
    sizes = _values(sc, "sync/bytes")
    lowrank = [b for b in sizes if b < dense]
    drift = _values(sc, "sync/logprob_abs_diff_max")
    recoveries = _values(sc, "sync/engine_recoveries")
    return {
        "syncs": len(lowrank),
        "full_syncs": len(sizes) - len(lowrank),
        "bytes_per_sync_lowrank": statistics.mean(lowrank) if lowrank else None,
        "bytes_per_sync_lowrank_median": statistics.median(lowrank) if lowrank else None,
        "bytes_per_sync_full": dense,
        "drift_max": max(drift) if drift else None,
        "drift_mean_max": max(_values(sc, "sync/logprob_abs_diff_mean") or [0.0]),
        "recoveries": int(max(recoveries)) if recoveries else 0,
        "step_seconds_median": statistics.median(_values(sc, "perf/step_seconds")),
        "sync_seconds_median": statistics.median(_values(sc, "sync/seconds")),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--restart-at", type=int, default=None)
    ap.add_argument("--throughput-steps", type=int, default=None, help="0: skip the throughput runs")
    ap.add_argument("--out", default=None)
    ap.add_argument("--work-dir", default=str(WORK_DIR / "server_engine"))
    args = ap.parse_args(argv)
    budget = QUICK if args.quick else FULL
    steps = args.steps or budget["steps"]
    restart_at = args.restart_at if args.restart_at is not None else budget["restart_at"]
    tp_steps = args.throughput_steps if args.throughput_steps is not None else budget["throughput_steps"]
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pid_file, server_log = str(work / "server.pid"), str(work / "server.log")
    Path(server_log).unlink(missing_ok=True)
    t0, load_start = time.perf_counter(), load_average()

    from logra_lightning.rollout.vllm.client import ServerClient

    start_server(port, pid_file, server_log)
    server_start = ServerClient(url).wait_until_up(600)
    callbacks = config_callbacks(CONFIG) + [
        {
            "class_path": "benchmarks.server_engine.RestartServer",
            "init_args": {"pid_file": pid_file, "port": port, "at_step": restart_at, "log_path": server_log},
        }
    ]
    common = ["--model.engine.init_args.url", url, "--trainer.max_steps"]
    try:
        main_run = logra_fit(
            "demo_restart",
            CONFIG,
            [*common, str(steps), "--trainer.val_check_interval", str(steps)],
            callbacks=callbacks,
            work_dir=work,
        )
        runs = {"demo_restart": main_run}
        if tp_steps:
            for name, extra in (
                ("on_policy", []),
                ("off_policy", ["--model.off_policy_steps", "1", "--model.tis_cap", "2.0"]),
            ):
                runs[name] = logra_fit(
                    name,
                    CONFIG,
                    [*common, str(tp_steps), "--trainer.val_check_interval", str(tp_steps), *extra],
                    callbacks=config_callbacks(CONFIG) + [{"class_path": "benchmarks.server_engine.BatchClock"}],
                    work_dir=work,
                )
    finally:
        kill_group(int(Path(pid_file).read_text()))
    rows = {}
    for name, run in runs.items():
        rows[name] = {k: v for k, v in run.items() if k != "scalars"}
        if run.get("ok"):
            rows[name]["sync"] = sync_summary(run)
            if name != "demo_restart":
                lags = _values(run["scalars"], "rollout/policy_lag")
                rows[name]["policy_lag"] = {"mean": statistics.mean(lags), "max": max(lags)} if lags else None
                walls = _values(run["scalars"], "bench/batch_wall")[1:]  # from the second step on
                rows[name]["batch_wall_median"] = statistics.median(walls) if walls else None
    main_sync = rows["demo_restart"].get("sync", {})
    drift_after = [v for s, v in main_run.get("scalars", {}).get("sync/logprob_abs_diff_max", []) if s > restart_at]
    recovered = bool(
        main_run.get("ok")
        and main_sync.get("recoveries", 0) >= 1
        and main_sync.get("syncs") == steps
        and drift_after
        and max(drift_after) <= DRIFT_TARGET
    )
    res = {
        "command": "python -m benchmarks.server_engine" + (" " + " ".join(argv) if argv else ""),
        "wall_seconds": round(time.perf_counter() - t0, 1),
        "load_start": load_start,
        "load_end": load_average(),
        "machine": machine_info(),
        "config": str(CONFIG.relative_to(ROOT)),
        "steps": steps,
        "restart_at": restart_at,
        "server_start_seconds": round(server_start, 1),
        "drift_target": DRIFT_TARGET,
        "summary": {
            "syncs": main_sync.get("syncs"),
            "drift_max": main_sync.get("drift_max"),
            "bytes_per_sync_lowrank": main_sync.get("bytes_per_sync_lowrank"),
            "bytes_per_sync_full": main_sync.get("bytes_per_sync_full"),
            "restart_recovered": recovered,
        },
        "runs": rows,
    }
    out = Path(args.out) if args.out else RESULTS / f"server_engine{'_quick' if args.quick else ''}.json"
    write_result(out, res)
    print(json.dumps(res["summary"], indent=2))
    return res


# ------------------------------------------------------------------ report
def section(res: dict) -> tuple[list[str], dict]:
    s, runs = res["summary"], res["runs"]
    demo = runs["demo_restart"]
    acc = (demo.get("summary") or {}) if demo.get("ok") else {}
    out = [
        command_head(res) + f" The demo config (`{res['config']}`) with its engine in a `logra serve` process on the "
        f"same machine (server start {res['server_start_seconds']:.0f} s); the server was killed and restarted after "
        f"step {res['restart_at']}.",
        "",
        *table(
            ["low-rank syncs", "bytes per low-rank sync", "full sync", "drift max", "restart recovered", "accuracy"],
            [
                [
                    str(s["syncs"]),
                    f"{num((s['bytes_per_sync_lowrank'] or 0) / 1e3, '.1f')} kB",
                    f"{num((s['bytes_per_sync_full'] or 0) / 1e6, '.2f')} MB",
                    num(s["drift_max"], ".1e"),
                    "yes" if s["restart_recovered"] else "**no**",
                    f"{num(acc.get('accuracy_before'), '.3f')} -> {num(acc.get('accuracy_after'), '.3f')}",
                ]
            ],
        ),
        "",
    ]
    tp = [(n, runs[n]) for n in ("on_policy", "off_policy") if n in runs and runs[n].get("ok")]
    if tp:
        rows = [
            [
                name.replace("_", "-"),
                num(r.get("batch_wall_median"), ".3f"),
                num(r["sync"]["step_seconds_median"], ".3f"),
                num(r["sync"]["sync_seconds_median"], ".3f"),
                num((r.get("policy_lag") or {}).get("mean"), ".2f"),
            ]
            for name, r in tp
        ]
        out += [
            "Throughput: wall seconds per step (batch end to batch end: rollout, training and sync, with whatever "
            "overlaps), the training step alone, and the sync (off-policy: it also waits for the rollout running "
            "ahead). Trainer and server share the same 2 cores here, so overlapping them has little to gain.",
            "",
            *table(["rollouts", "wall s/step", "training_step s", "sync s", "policy lag (syncs)"], rows),
            "",
        ]
    return out, {"server_engine": s}


REPORTS = {"server_engine": Report("Engine in a separate vLLM server", section)}

if __name__ == "__main__":
    main(sys.argv[1:])
