"""Write ``benchmarks/README.md`` from the results JSON files: every number in it comes from them.

Run after the benchmarks (``benchmarks/run_all.py`` does):

    .venv/bin/python -m benchmarks.make_readme             # results/*.json -> benchmarks/README.md
    .venv/bin/python -m benchmarks.make_readme --quick     # results/*_quick.json -> results/README_quick.md

Each section (and headline bullet) is written by the benchmark script that owns the result:
its ``REPORTS`` (see ``benchmarks/report.py``); this file only orders them and adds the frame
(headline, how to reproduce, machine, GPU check). A benchmark without a results file gets a
"not measured yet" line with its command, never a number. Hand edits to the README are
overwritten: change the benchmark's ``section`` (or this frame) instead.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks.common import RESULTS, ROOT
from benchmarks.report import num, report_of
from benchmarks.run_all import FULL_ARGS, SCRIPTS

COMMANDS = {  # exactly what `make bench` (run_all.py) runs for each result
    name: " ".join(
        [
            ".venv/bin/python",
            "-m",
            f"benchmarks.{FULL_ARGS.get(name, (name, []))[0]}",
            *FULL_ARGS.get(name, (name, []))[1],
        ]
    )
    for name in SCRIPTS
}
# The README's section order (run_all.SCRIPTS is the run order); a result not listed here comes last.
ORDER = (
    "optimizer_memory",
    "optimizer_step_time",
    "plan_vs_measured",
    "quality",
    "kl_control",
    "sync_cost",
    "trl_grpo",
    "architectures",
)
# Recorded by their own commands, not by `make bench`: each section follows the others when its full
# results file exists (their scripts expose REPORTS too; never in --quick).
EXTRA = (
    "memory_breakdown",
    "direction_error",
    "real_shapes_memory",
    "ddp_comm",
    "soak",
    "server_engine",
    "real_model_tasks",
)


def sections() -> list[str]:
    """The result names of ``run_all.SCRIPTS`` in README order."""
    return [n for n in ORDER if n in SCRIPTS] + [n for n in SCRIPTS if n not in ORDER]


def _missing(name: str, quick: bool) -> list[str]:
    command = (
        f".venv/bin/python -m benchmarks.{FULL_ARGS.get(name, (name, []))[0]} --quick" if quick else COMMANDS[name]
    )
    return [f"_Not measured yet._ Run `{command}`.", ""]


def _plot(name: str, quick: bool, results: Path, readme_dir: Path) -> list[str]:
    png = results / f"{name}{'_quick' if quick else ''}.png"
    if not png.is_file():
        return []
    return [f"![{name}]({png.relative_to(readme_dir) if png.is_relative_to(readme_dir) else png})", ""]


def _headline(found: dict) -> list[str]:
    out = ["## Headline numbers", ""]
    for name in [*sections(), *(n for n in EXTRA if n in found)]:
        headline = report_of(name).headline
        out += headline(found) if headline else []
    return out + (["- _No full results yet._"] if len(out) == 2 else []) + [""]


def gpu_check_section(results: Path) -> list[str]:
    """The GPU check's paragraph; says whether ``gpu_check.json`` (written only on a GPU machine) exists."""
    ran = (results / "gpu_check.json").is_file()
    out = [
        f"## GPU check ({'results in `results/gpu_check.json`' if ran else 'not yet run on a GPU'})",
        "",
        "`scripts/gpu_check.sh` is the one-command check of the CUDA path (≤ 10 min including installs, nothing",
        "from a hub): random-init Qwen2.5-0.5B / 1.5B / 4-layer 7B shapes, a few GRPO steps each with dense",
        "AdamW and with LoGRA, vLLM colocated on the same GPU; peak memory per phase vs `logra plan`, s/step,",
        "sync bytes and seconds, engine drift, predicted vs realized KL, written to",
        "`benchmarks/results/gpu_check.json` (see `scripts/gpu_check.py`). `scripts/gpu_check.sh --dry-run`",
        "rehearses the same path on this CPU machine.",
    ]
    if not ran:
        out.append("No GPU has been lent yet, so there is no such file.")
    return out + [""]


def build(quick: bool, results: Path, readme: Path) -> str:
    body, found, machine, walls = [], {}, None, {}
    for name in sections():
        report = report_of(name)
        body += [f"## {report.title}", ""]
        path = results / f"{name}{'_quick' if quick else ''}.json"
        if not path.is_file():
            body += _missing(name, quick)
            continue
        res = json.loads(path.read_text())
        walls[name] = res.get("wall_seconds")
        machine = machine or (res["machine"] if "versions" in res.get("machine", {}) else None)
        lines, found[name] = report.section(res)
        body += lines + _plot(name, quick, results, readme.parent)
    for name in EXTRA:
        path = results / f"{name}.json"
        if not quick and path.is_file():
            report = report_of(name)
            lines, found[name] = report.section(json.loads(path.read_text()))
            body += [f"## {report.title}", ""] + lines + _plot(name, quick, results, readme.parent)
    head = [
        "# Benchmarks",
        "",
        f"_Generated by `benchmarks/make_readme.py` from "
        f"`{results.relative_to(ROOT) if results.is_relative_to(ROOT) else results}/"
        f"*{'_quick' if quick else ''}.json`; do not edit by hand._"
        + (" **Quick smoke results: tiny sizes, not measurements.**" if quick else ""),
        "",
    ]
    head += _headline(found)
    head += [
        "## How to reproduce",
        "",
        "```",
        "make bench                                  # installs the `bench` extra, runs everything",
        ".venv/bin/python -m benchmarks.run_all      # the same without the install",
        ".venv/bin/python -m benchmarks.run_all --quick   # every script's --quick mode (CI smoke)",
        *COMMANDS.values(),
        ".venv/bin/python -m benchmarks.plots && .venv/bin/python -m benchmarks.make_readme",
        "```",
        "",
    ]
    if walls and all(walls.values()):
        head += [
            "Wall time of the runs behind these results (one after another, as `make bench` runs them): "
            + ", ".join(f"{name} {w / 60:.1f} min" for name, w in walls.items())
            + f"; **{sum(walls.values()) / 60:.0f} min** in all.",
            "",
        ]
    if machine:
        v = machine.get("versions", {})
        head += [
            "## Machine",
            "",
            f"{machine['cpu']}, {machine['cores']} cores, "
            f"{num((machine.get('mem_total_bytes') or 0) / 2**30, '.0f')} GiB, no GPU; Python {machine['python']}; "
            + ", ".join(f"{k} {val}" for k, val in v.items() if val)
            + ". The machine is shared: every table gives the "
            "load average (1/5/15 min, runnable processes on 2 cores) when it was measured; memory numbers are robust "
            "to load, wall-clock times are not (CPU-time ratios are given beside them).",
            "",
        ]
    text = "\n".join(head + body + ([] if quick else gpu_check_section(results))) + "\n"
    # Results recorded when the scripts were run by path keep that command; the same run is now a module.
    return re.sub(r"python (?:\./)?benchmarks/(\w+)\.py", r"python -m benchmarks.\1", text)


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="from *_quick.json into results/README_quick.md")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = Path(args.results)
    out = (
        Path(args.out)
        if args.out
        else (results / "README_quick.md" if args.quick else ROOT / "benchmarks" / "README.md")
    )
    out.write_text(build(args.quick, results, out))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
