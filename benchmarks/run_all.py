"""Run every registered benchmark, then the plots and the README (``make bench``, ``make bench-full``).

    .venv/bin/python -m benchmarks.run_all --quick              # every benchmark's smoke run (minutes each)
    .venv/bin/python -m benchmarks.run_all                      # the full runs behind the README (hours)
    .venv/bin/python -m benchmarks.run_all --only kl_control sync_cost

The list is :func:`benchmarks.harness.registry`. A quick run checks that each benchmark still works
(results under ``.cache/bench_quick/``, never committed); the full runs are those of the committed
results whose entry declares ``full`` arguments (the others were recorded by their own commands,
kept in each result's envelope). A failing benchmark is reported and the rest still run; the exit
code is non-zero if any failed. Run the full suite on a quiet machine: timings are only as good as
the load allows.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from benchmarks.common import ROOT, load_average
from benchmarks.harness import registry


def commands(quick: bool, only: list[str] | None = None) -> dict[str, list[str]]:
    """``{results name: argv}`` of the runs, in README order (quick: one run per benchmark module)."""
    out, seen = {}, set()
    for name, e in registry().items():
        if (only and name not in only) or (not quick and e.full is None):
            continue
        if quick and (e.quick is None or e.module in seen):
            continue
        seen.add(e.module)
        out[name] = [sys.executable, "-m", f"benchmarks.{e.module}", *(["--quick", *e.quick] if quick else e.full)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="each benchmark's smoke run")
    ap.add_argument("--only", nargs="*", default=None, help="results names (default: all registered)")
    args = ap.parse_args(argv)
    unknown = set(args.only or ()) - set(registry())
    if unknown:
        raise SystemExit(f"unknown --only {sorted(unknown)} (allowed: {', '.join(registry())})")
    status = {}
    for name, cmd in commands(args.quick, args.only).items():
        print(f"== {' '.join(cmd[1:])}  (load {load_average()})", flush=True)
        t0 = time.perf_counter()
        status[name] = (subprocess.run(cmd, cwd=ROOT).returncode, time.perf_counter() - t0)
    for tail in ("plots", "make_readme"):
        cmd = [sys.executable, "-m", f"benchmarks.{tail}", *(["--quick"] if args.quick else [])]
        status[tail] = (subprocess.run(cmd, cwd=ROOT).returncode, 0.0)
    for name, (rc, seconds) in status.items():
        print(f"{name:20s} {'ok' if rc == 0 else f'FAILED (exit {rc})':18s} {seconds:7.0f} s")
    return int(any(rc != 0 for rc, _ in status.values()))


if __name__ == "__main__":
    sys.exit(main())
