"""The benchmark harness: a registry, the common flags, the results envelope and the one results schema.

A benchmark is a :class:`Benchmark` subclass in a module under ``benchmarks/``, registered with
:func:`bench` under the name of the results file it writes; ``run_all``, ``make_readme`` and
``plots`` walk :func:`registry` and nothing else. Every run writes one JSON file::

    {"envelope": {"command", "machine", "load_start", "load_end", "wall_seconds"},
     "settings": {...},                                  # what was run
     "rows": [{"name", "ok", "error", "metrics": {...}}],  # one measurement each
     "summary": {...}}                                   # derived from the rows (may be empty)

The harness gives every benchmark ``--quick`` (tiny sizes; results go to ``.cache/bench_quick/``,
never committed), ``--out`` and ``--timeout``, and the hidden ``--worker NAME --worker-out PATH``
re-entry that measures one row in a fresh process (``isolate = True``), so that one row's peak
memory or crash does not touch another's. Flags several benchmarks share (``--steps``, ``--seeds``,
``--jobs``, ``--rows``, ...) are spelled once in :data:`FLAGS`; a benchmark lists those it takes in
``flags`` with their defaults. A section that is the command, one sentence and one table is
:attr:`Benchmark.columns` and :meth:`Benchmark.describe`.

Example::

    >>> row("adamw", lambda: {"peak_bytes": 1})["metrics"]["peak_bytes"]
    1
    >>> row("bad", lambda: 1 / 0)["error"]
    'ZeroDivisionError: division by zero'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import import_module
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ROOT, load_average, machine_info, pythonpath
from benchmarks.report import command_head, table

QUICK_RESULTS = ROOT / ".cache" / "bench_quick"  # git-ignored: quick runs check that a benchmark works
# The benchmark modules; their registration order is the README's section order.
MODULES = """optimizer_memory kl_control sync_cost trl_grpo architectures reasoning_tasks archive
real_shapes_memory ddp_comm real_model_tasks step_speed long_real_run""".split()
ENVELOPE = ("command", "machine", "load_start", "load_end", "wall_seconds")
# Flags several benchmarks take, spelled once: a benchmark names those it takes in ``flags``, with their defaults.
FLAGS: dict[str, dict[str, Any]] = {
    "config": dict(help="the RL config the runs start from"),
    "lr": dict(type=float, help="learning rate of every row (default: from the configs)"),
    "steps": dict(type=int, help="steps per run"),
    "val_every": dict(type=int, help="steps between held-out evaluations"),
    "seeds": dict(type=int, nargs="*", help="seeds, one run per row each"),
    "jobs": dict(type=int, help="runs at once"),
    "rows": dict(nargs="*", help="subset of the rows"),
    "sizes": dict(nargs="*", help="subset of the model sizes (benchmarks/configs/qwen2-<size>.json)"),
    "work_dir": dict(help="logs of the runs (git-ignored)"),
}
ROW = ("name", "ok", "error", "metrics")


class Benchmark:
    """One benchmark: how it runs (settings, rows, summary) and how its results read (section, plot, headline).

    The default :meth:`run` measures each of :meth:`row_names` with :meth:`measure`, in this process
    or, with ``isolate = True``, each in a fresh one. Override :meth:`run` for other shapes of work.
    """

    isolate = False
    flags: dict[str, Any] = {}  # the :data:`FLAGS` it takes -> their defaults
    columns: list = []  # the default section's table (report.Col over the flat rows)

    def add_arguments(self, ap: argparse.ArgumentParser) -> None:
        """The benchmark's own flags (the common ones are added by the harness)."""

    def settings(self, args: argparse.Namespace) -> dict:
        return {}

    def row_names(self, args: argparse.Namespace, settings: dict) -> list[str]:
        return []

    def measure(self, name: str, settings: dict) -> dict:
        """The metrics of row ``name``; raising records the row as failed."""
        raise NotImplementedError

    def worker_env(self, name: str, settings: dict) -> dict[str, str]:
        """Environment variables of the fresh process that measures row ``name`` (``isolate``)."""
        return {}

    def run(self, args: argparse.Namespace, settings: dict) -> list[dict]:
        rows = []
        for name in self.row_names(args, settings):
            got = self.isolated(name, args) if self.isolate else row(name, lambda: self.measure(name, settings))
            print(json.dumps({k: got[k] for k in ("name", "ok", "error")}), flush=True)
            rows.append(got)
        return rows

    def isolated(self, name: str, args: argparse.Namespace) -> dict:
        """Row ``name`` measured by ``python -m benchmarks.MODULE ARGV --worker NAME`` in a fresh process."""
        out = ROOT / ".cache" / "bench_workers" / f"{self.module}_{name.replace('/', '_')}.json"
        env = self.worker_env(name, self.settings(args))
        return run_worker(self.module, [*args.argv, "--worker", name], out, env=env, timeout=args.timeout)

    def summarize(self, settings: dict, rows: list[dict]) -> dict:
        return {}

    def describe(self, res: dict) -> str:
        """The default section's first paragraph after the command: what was run."""
        return ""

    def section(self, res: dict) -> list[str]:
        """The README section's Markdown lines (under its title); by default the command, :meth:`describe`
        and a table of :attr:`columns` over the rows."""
        head = " ".join(x for x in (command_head(res), self.describe(res)) if x)
        return [head, "", *table([flat(r) for r in res["rows"]], self.columns), ""]

    def plot(self, res: dict, plt) -> Any:
        return None

    def headline(self, results: dict[str, dict]) -> list[str]:
        """Bullets of the README's headline numbers, from every loaded result (``{name: result}``)."""
        return []


class Entry:
    """A registered results name: the benchmark that writes it and how ``make bench`` runs it."""

    def __init__(self, name, title, impl, quick, full, variants):
        self.name, self.title, self.impl = name, title, impl
        self.quick = None if quick is None else list(quick)
        self.full, self.variants = None if full is None else list(full), tuple(variants)

    @property
    def module(self) -> str:
        return self.impl.module


_REGISTRY: dict[str, Entry] = {}


def bench(
    name: str,
    *,
    title: str,
    quick: list[str] | None = (),
    full: list[str] | None = None,
    variants: tuple[str, ...] = (),
) -> Callable[[type], type]:
    """Register a :class:`Benchmark` class as the writer of ``results/<name>.json``.

    ``quick``: the arguments of its smoke run (``--quick`` is added; ``make bench`` runs it; ``None``: none);
    ``full``: the arguments of the full run that recorded the committed results (``None``: the
    results come from a command of their own, given in the results' envelope); ``variants``: other
    committed results files of the same benchmark, rendered by the same report. Stack the decorator
    to register one benchmark under several results names.
    """

    def register(cls: type) -> type:
        impl = getattr(cls, "_instance", None) or cls()
        spec = getattr(sys.modules.get(cls.__module__), "__spec__", None)  # run with -m, __module__ is __main__
        impl.module = (spec.name if spec else cls.__module__).rsplit(".", 1)[-1]
        impl.name = getattr(impl, "name", name)
        cls._instance = impl
        _REGISTRY[name] = Entry(name, title, impl, quick, full, variants)
        return cls

    return register


def registry() -> dict[str, Entry]:
    """Every registered results name, in README order."""
    for module in MODULES:
        import_module(f"benchmarks.{module}")
    order = {m: i for i, m in enumerate(MODULES)}
    return dict(sorted(_REGISTRY.items(), key=lambda kv: order[kv[1].module]))


def row(name: str, measure: Callable[[], dict]) -> dict:
    """A row of the schema: ``measure()``'s metrics (with the load average before and after), or its error."""
    load_before = load_average()
    try:
        metrics = {"load_before": load_before, **measure()}
        return {"name": name, "ok": True, "error": None, "metrics": {"load_after": load_average(), **metrics}}
    except Exception as e:  # recorded, e.g. an optimizer without a CPU kernel; the other rows still run
        print(traceback.format_exc()[-2000:], file=sys.stderr)
        return {"name": name, "ok": False, "error": f"{type(e).__name__}: {e}", "metrics": {}}


def parallel(fn: Callable, items: list, jobs: int) -> list:
    """``[fn(item) ...]`` with ``jobs`` at once: for work that waits on a process of its own (``logra fit``)."""
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(fn, items))


def run_worker(module: str, args: list[str], out: Path, *, env=None, timeout: float | None = None) -> dict:
    """``python -m benchmarks.MODULE ARGS --worker-out OUT`` (ARGS name the row); the row it wrote."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", f"benchmarks.{module}", *args, "--worker-out", str(out)]
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": pythonpath(), **(env or {})},
        )
        why = f"worker exited {proc.returncode}: {proc.stderr[-2000:]}"
    except subprocess.TimeoutExpired:
        why = f"worker timed out after {timeout:.0f} s"
    name = args[args.index("--worker") + 1]
    if not out.exists():
        return {"name": name, "ok": False, "error": why, "metrics": {}}
    got = json.loads(out.read_text())
    out.unlink()
    return got


def parser(impl: Benchmark) -> argparse.ArgumentParser:
    doc = (sys.modules[type(impl).__module__].__doc__ or impl.module).split("\n")[0]
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{impl.module}", description=doc)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, minutes: checks that the benchmark runs")
    ap.add_argument("--out", default=None, help=f"results JSON (default results/{impl.name}.json)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per isolated row")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    for name, default in impl.flags.items():
        ap.add_argument(f"--{name.replace('_', '-')}", default=default, **FLAGS[name])
    impl.add_arguments(ap)
    return ap


def out_path(impl: Benchmark, args: argparse.Namespace) -> Path:
    if args.out:
        return Path(args.out)
    return (QUICK_RESULTS if args.quick else RESULTS) / f"{impl.name}.json"


def main(cls: type, argv: list[str] | None = None) -> dict:
    """Run benchmark ``cls`` from the command line: the rows, then the envelope; write the results file."""
    impl = cls._instance
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser(impl).parse_args(argv)
    args.argv = [a for a in argv if a != "--worker-out"]
    settings = impl.settings(args)
    if args.worker:  # re-entered by Benchmark.isolated: measure one row, hand it back in a file
        got = row(args.worker, lambda: impl.measure(args.worker, settings))
        Path(args.worker_out).write_text(json.dumps(got))
        return got
    started, load_start = time.time(), load_average()
    rows = impl.run(args, settings)
    result = {
        "envelope": {
            "command": " ".join([f"python -m benchmarks.{impl.module}", *argv]),
            "machine": machine_info(),
            "load_start": load_start,
            "load_end": load_average(),
            "wall_seconds": round(time.time() - started, 1),
        },
        "settings": settings,
        "rows": rows,
        "summary": impl.summarize(settings, rows),
    }
    write(out_path(impl, args), result)
    return result


def write(path: Path, result: dict) -> Path:
    check(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def check(result: dict) -> None:
    """Raise ``ValueError`` naming what breaks the results schema (see the module docstring)."""
    missing = [k for k in ("envelope", "settings", "rows") if k not in result]
    missing += [f"envelope.{k}" for k in ENVELOPE if k not in result.get("envelope", {})]
    for i, r in enumerate(result.get("rows", [])):
        missing += [f"rows[{i}].{k}" for k in ROW if k not in r]
    if missing:
        raise ValueError(f"results break the schema, missing: {', '.join(missing)}")
    extra = set(result) - {"envelope", "settings", "rows", "summary"}
    if extra:
        raise ValueError(
            f"results break the schema, unknown keys: {sorted(extra)} (allowed: envelope, settings, rows, summary)"
        )


def load(name: str, results: Path = RESULTS) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def flat(r: dict) -> dict:
    """A row as one dict: its metrics beside ``name``, ``ok`` and ``error`` (what column specs read)."""
    return {**r["metrics"], "name": r["name"], "ok": r["ok"], "error": r["error"]}
