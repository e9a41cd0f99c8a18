"""Run the whole benchmark suite, then the plots and the README (``make bench``).

    .venv/bin/python -m benchmarks.run_all                      # full sizes (see benchmarks/README.md for times)
    .venv/bin/python -m benchmarks.run_all --quick              # every script's --quick mode (CI smoke, minutes)
    .venv/bin/python -m benchmarks.run_all --only quality --rl-args --lr 3e-5 --steps 300

Scripts run one after another (each already isolates its own rows in subprocesses); a failing
script is reported and the rest still run; the exit code is non-zero if any failed. Run the
full suite on a quiet machine: the timing columns are only as good as the load allows.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from benchmarks.common import ROOT, load_average

SCRIPTS = [
    "optimizer_memory",
    "optimizer_step_time",
    "plan_vs_measured",
    "sync_cost",
    "quality",
    "kl_control",
    "trl_grpo",
    "architectures",
    "reasoning_tasks",
]
# name -> (script, arguments of the full run); a name missing from QUICK_SCRIPTS has no --quick mode of its own
FULL_ARGS = {
    "optimizer_step_time": (
        "optimizer_memory",
        [
            "--sizes",
            "100m",
            "--rows",
            "adamw",
            "logra",
            "--repeat",
            "3",
            "--out",
            "benchmarks/results/optimizer_step_time.json",
        ],
    ),
    # the RL benchmarks at 100 steps (the configs' max_steps is 200): 3 seeds each within the budget
    **{name: (name, ["--steps", "100"]) for name in ("quality", "kl_control", "trl_grpo")},
}
QUICK_SKIP = ("optimizer_step_time",)
RL_SCRIPTS = ("quality", "kl_control", "trl_grpo")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="run each script's --quick mode")
    ap.add_argument("--only", nargs="*", default=None, help=f"subset of {SCRIPTS}")
    ap.add_argument(
        "--rl-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="extra arguments for the RL benchmarks (quality, kl_control, trl_grpo), e.g. --lr 3e-5 --steps 300",
    )
    args = ap.parse_args(argv)
    scripts = args.only or SCRIPTS
    unknown = set(scripts) - set(SCRIPTS)
    if unknown:
        raise SystemExit(f"unknown --only {sorted(unknown)} (allowed: {', '.join(SCRIPTS)})")
    status = {}
    for name in scripts:
        if args.quick and name in QUICK_SKIP:
            continue
        script, extra = FULL_ARGS.get(name, (name, []))
        cmd = [sys.executable, "-m", f"benchmarks.{script}"] + (["--quick"] if args.quick else extra)
        cmd += args.rl_args if name in RL_SCRIPTS else []
        print(f"== {' '.join(cmd[1:])}  (load {load_average()})", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        status[name] = (rc, time.perf_counter() - t0)
    for tail in ("plots", "make_readme"):
        cmd = [sys.executable, "-m", f"benchmarks.{tail}"] + (["--quick"] if args.quick else [])
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        status[tail] = (rc, 0.0)
    for name, (rc, seconds) in status.items():
        print(f"{name:18s} {'ok' if rc == 0 else f'FAILED (exit {rc})':18s} {seconds:7.0f} s")
    return int(any(rc != 0 for rc, _ in status.values()))


if __name__ == "__main__":
    sys.exit(main())
