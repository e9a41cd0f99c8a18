"""PNG plots of the benchmark results (matplotlib, no display needed).

Run after the benchmarks (``benchmarks/run_all.py`` does):

    .venv/bin/python -m benchmarks.plots            # benchmarks/results/*.json -> *.png
    .venv/bin/python -m benchmarks.plots --quick    # *_quick.json -> *_quick.png (CI smoke)

One figure per results file whose script's ``Report`` has a ``plot`` (see ``benchmarks/report.py``);
a missing results file skips its figure (and says so).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.report import report_of
from benchmarks.run_all import SCRIPTS


def _load(name: str, quick: bool, results: Path) -> dict | None:
    path = results / f"{name}{'_quick' if quick else ''}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _save(fig, name: str, quick: bool, results: Path) -> Path:
    path = results / f"{name}{'_quick' if quick else ''}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return path


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="plot the *_quick.json results")
    ap.add_argument("--results", default=str(RESULTS), help="folder of the results JSON files")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results, written = Path(args.results), []
    for name in SCRIPTS:
        plot = report_of(name).plot
        if plot is None:
            continue
        res = _load(name, args.quick, results)
        if res is None:
            print(f"skip {name}: no results file")
            continue
        fig = plot(res, plt)
        written.append(_save(fig, name, args.quick, results))
        plt.close(fig)
    return written


if __name__ == "__main__":
    main()
