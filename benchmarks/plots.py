"""PNG plots of the benchmark results (matplotlib, no display needed).

    .venv/bin/python -m benchmarks.plots            # benchmarks/results/*.json -> *.png
    .venv/bin/python -m benchmarks.plots --quick    # .cache/bench_quick/*.json -> *.png
    .venv/bin/python -m benchmarks.plots --only long_real_run   # one benchmark's figures (its variants too)

One figure per results file (variants included) whose benchmark has a ``plot``; a missing results
file skips its figure.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.harness import QUICK_RESULTS, load, registry


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"plot the quick results in {QUICK_RESULTS}")
    ap.add_argument("--results", default=None, help="folder of the results JSON files")
    ap.add_argument("--only", nargs="*", default=None, help="results names (default: all registered)")
    args = ap.parse_args(argv)
    unknown = set(args.only or ()) - set(registry())
    if unknown:
        raise SystemExit(f"unknown --only {sorted(unknown)} (allowed: {', '.join(registry())})")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Path(args.results or (QUICK_RESULTS if args.quick else RESULTS))
    written = []
    for name, e in registry().items():
        if args.only and name not in args.only:
            continue
        for file in (name, *e.variants):
            res = load(file, results)
            fig = res and e.impl.plot(res, plt)
            if not fig:
                continue
            fig.tight_layout()
            fig.savefig(results / f"{file}.png", dpi=110)
            plt.close(fig)
            written.append(results / f"{file}.png")
            print(f"wrote {written[-1]}")
    return written


if __name__ == "__main__":
    main()
