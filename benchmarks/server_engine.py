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

Result: ``benchmarks/results/server_engine.json`` with ``summary`` = ``{"syncs", "drift_max",
"bytes_per_sync_lowrank", "bytes_per_sync_full", "restart_recovered"}``.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning as L

from benchmarks.common import (
    CONFIGS,
    ROOT,
    WORK_DIR,
    config_callbacks,
    logra_fit,
)
from benchmarks.harness import Benchmark, bench, flat, main
from benchmarks.report import Col, command_head, num, table

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
    """``logra serve`` in its own session (so :func:`kill_group` also stops vLLM's engine processes)."""
    cmd = [sys.executable, "-m", "logra_lightning", "serve", "--model", MODEL, "--port", str(port), *SERVER_ARGS]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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


@bench("server_engine", title="Engine in a separate vLLM server", quick=[])
class ServerEngine(Benchmark):
    flags = {"steps": None, "work_dir": str(WORK_DIR / "server_engine")}

    def add_arguments(self, ap) -> None:
        ap.add_argument("--restart-at", type=int, default=None)
        ap.add_argument("--throughput-steps", type=int, default=None, help="0: skip the throughput runs")

    def settings(self, args) -> dict:
        budget = QUICK if args.quick else FULL
        return {
            "config": str(CONFIG.relative_to(ROOT)),
            "steps": args.steps or budget["steps"],
            "restart_at": args.restart_at if args.restart_at is not None else budget["restart_at"],
            "throughput_steps": args.throughput_steps
            if args.throughput_steps is not None
            else budget["throughput_steps"],
            "drift_target": DRIFT_TARGET,
        }

    def run(self, args, st: dict) -> list[dict]:
        steps, restart_at, tp_steps = st["steps"], st["restart_at"], st["throughput_steps"]
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        pid_file, server_log = str(work / "server.pid"), str(work / "server.log")
        Path(server_log).unlink(missing_ok=True)

        from logra_lightning.rollout.vllm.client import ServerClient

        start_server(port, pid_file, server_log)
        st["server_start_seconds"] = round(ServerClient(url).wait_until_up(600), 1)
        restart = {"pid_file": pid_file, "port": port, "at_step": restart_at, "log_path": server_log}
        callbacks = config_callbacks(CONFIG) + [
            {"class_path": "benchmarks.server_engine.RestartServer", "init_args": restart}
        ]
        common = ["--model.engine.init_args.url", url, "--trainer.max_steps"]
        try:
            budget = [*common, str(steps), "--trainer.val_check_interval", str(steps)]
            runs = {"demo_restart": logra_fit("demo_restart", CONFIG, budget, callbacks=callbacks, work_dir=work)}
            clock = config_callbacks(CONFIG) + [{"class_path": "benchmarks.server_engine.BatchClock"}]
            off = ["--model.off_policy_steps", "1", "--model.tis_cap", "2.0"]
            for name, extra in (("on_policy", []), ("off_policy", off)) if tp_steps else ():
                budget = [*common, str(tp_steps), "--trainer.val_check_interval", str(tp_steps), *extra]
                runs[name] = logra_fit(name, CONFIG, budget, callbacks=clock, work_dir=work)
        finally:
            kill_group(int(Path(pid_file).read_text()))
        rows = []
        for name, run in runs.items():
            m = {k: v for k, v in run.items() if k not in ("scalars", "ok", "error")}
            if run.get("ok"):
                m["sync"] = sync_summary(run)
                if name != "demo_restart":
                    lags = _values(run["scalars"], "rollout/policy_lag")
                    m["policy_lag"] = {"mean": statistics.mean(lags), "max": max(lags)} if lags else None
                    walls = _values(run["scalars"], "bench/batch_wall")[1:]  # from the second step on
                    m["batch_wall_median"] = statistics.median(walls) if walls else None
            if name == "demo_restart":
                scalars = run.get("scalars", {}).get("sync/logprob_abs_diff_max", [])
                m["drift_after_restart"] = [v for s, v in scalars if s > restart_at]
            rows.append({"name": name, "ok": run.get("ok", False), "error": run.get("error"), "metrics": m})
        return rows

    def summarize(self, st: dict, rows: list[dict]) -> dict:
        demo = rows[0]
        sync, after = demo["metrics"].get("sync", {}), demo["metrics"].get("drift_after_restart")
        recovered = bool(
            demo["ok"]
            and sync.get("recoveries", 0) >= 1
            and sync.get("syncs") == st["steps"]
            and after
            and max(after) <= DRIFT_TARGET
        )
        keys = ("syncs", "drift_max", "bytes_per_sync_lowrank", "bytes_per_sync_full")
        return {**{k: sync.get(k) for k in keys}, "restart_recovered": recovered}

    def section(self, res: dict) -> list[str]:
        s, st, runs = res["summary"], res["settings"], {r["name"]: flat(r) for r in res["rows"]}
        demo = runs["demo_restart"]
        acc = (demo.get("summary") or {}) if demo["ok"] else {}
        out = [
            command_head(res) + f" The demo config (`{st['config']}`) with its engine in a `logra serve` process on "
            f"the same machine (server start {st['server_start_seconds']:.0f} s); the server was killed and "
            f"restarted after step {st['restart_at']}.",
            "",
            *table(
                [{**acc, **s}],
                [
                    Col("low-rank syncs", "syncs"),
                    Col(
                        "bytes per low-rank sync",
                        lambda s: f"{num((s['bytes_per_sync_lowrank'] or 0) / 1e3, '.1f')} kB",
                    ),
                    Col("full sync", lambda s: f"{num((s['bytes_per_sync_full'] or 0) / 1e6, '.2f')} MB"),
                    Col("drift max", "drift_max", ".1e"),
                    Col("restart recovered", lambda s: "yes" if s["restart_recovered"] else "**no**"),
                    Col(
                        "accuracy",
                        lambda a: f"{num(a.get('accuracy_before'), '.3f')} -> {num(a.get('accuracy_after'), '.3f')}",
                    ),
                ],
            ),
            "",
        ]
        tp = [runs[n] for n in ("on_policy", "off_policy") if n in runs and runs[n]["ok"]]
        if not tp:
            return out
        cols = [
            Col("rollouts", lambda r: r["name"].replace("_", "-")),
            Col("wall s/step", "batch_wall_median", ".3f"),
            Col("training_step s", lambda r: r["sync"]["step_seconds_median"], ".3f"),
            Col("sync s", lambda r: r["sync"]["sync_seconds_median"], ".3f"),
            Col("policy lag (syncs)", lambda r: (r.get("policy_lag") or {}).get("mean"), ".2f"),
        ]
        return out + [
            "Throughput: wall seconds per step (batch end to batch end: rollout, training and sync, with whatever "
            "overlaps), the training step alone, and the sync (off-policy: it also waits for the rollout running "
            "ahead). Trainer and server share the same 2 cores here, so overlapping them has little to gain.",
            "",
            *table(tp, cols),
            "",
        ]


if __name__ == "__main__":
    main(ServerEngine)
