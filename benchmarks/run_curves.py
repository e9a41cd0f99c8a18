"""A resumed run's curves: its sittings' TensorBoard logs read into one curve per tag, and the math on them.

A run resumed with ``logra fit --config C --ckpt_path last`` logs each sitting to a new ``version_N`` under
``<save_dir>/<name>/``; the step axis continues, and a sitting killed between checkpoints has logged steps the
next one repeats (docs/long_run.md). :func:`read_run` reads the versions in numeric order and :func:`stitch`
joins them, each later sitting winning from its first step. Used by ``benchmarks/long_real_run.py``.

Example::

    >>> curves, sittings = stitch([(0, {"reward/mean": [[0, 0.1], [1, 0.2], [2, 0.3]]}),
    ...                            (1, {"reward/mean": [[2, 0.5], [3, 0.6]]})])
    >>> curves["reward/mean"], sittings[1]["resumed_from_step"]
    ([[0, 0.1], [1, 0.2], [2, 0.5], [3, 0.6]], 2)
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from benchmarks.common import tb_scalars

TRAINED = "perf/step_seconds"  # logged by every batch, skipped ones included: the loggers' step axis
PHASES = ("rollout", "forward_backward", "optimizer", "weight_sync")  # MemoryMonitor's phases of an RL step


def read_run(run_dir: Path, tags: list[str] | None = None) -> tuple[dict[str, list], list[dict]]:
    """The scalars ``tags`` (``None``: all) of the run's ``version_*`` directories, in numeric order, stitched."""
    found = [(int(m[1]), p) for p in run_dir.glob("version_*") if (m := re.fullmatch(r"version_(\d+)", p.name))]
    return stitch([(v, tb_scalars(p, tags)) for v, p in sorted(found)])


def stitch(logs: list[tuple[int, dict[str, list]]]) -> tuple[dict[str, list], list[dict]]:
    """One curve per tag from the sittings' ``(version, {tag: [[step, value], ...]})`` in order, each later sitting
    winning from its first step; and the sittings. A step logged twice in one sitting keeps its later value.

    A sitting's first step is its first trained batch (:data:`TRAINED`) where it logged one, and its points before
    that are left out: logs written before ``logra_lightning.rl.evaluation.logged_step`` hold whole-set evaluations
    at the global step, which lags the batch axis by the batches skipped so far (they would land among an earlier
    sitting's steps)."""
    curves: dict[str, list] = {}
    sittings: list[dict] = []
    for version, scalars in logs:
        scalars = {t: pts for t, pts in scalars.items() if pts and t != "hp_metric"}  # hp_metric: step 0 every sitting
        steps = [int(s) for pts in scalars.values() for s, _ in pts]
        if not steps:
            none = dict.fromkeys(("first_step", "last_step", "resumed_from_step", "step_seconds_median"))
            sittings.append({"version": version, **none})
            continue
        trained = [int(s) for s, _ in scalars.get(TRAINED, [])]
        first, resumed = min(trained or steps), any(s["first_step"] is not None for s in sittings)
        seconds = [v for s, v in scalars.get(TRAINED, []) if s >= first]  # this sitting's, whatever its machine
        for tag in {*curves, *scalars}:
            own = {int(s): v for s, v in scalars.get(tag, []) if s >= first}
            curves[tag] = [p for p in curves.get(tag, []) if p[0] < first] + [[s, v] for s, v in sorted(own.items())]
        sittings.append(
            {
                "version": version,
                "first_step": first,
                "last_step": max(steps),
                "resumed_from_step": first if resumed else None,
                "step_seconds_median": statistics.median(seconds) if seconds else None,
            }
        )
    return {t: c for t, c in curves.items() if c}, sittings


def steps_reached(curves: dict[str, list]) -> int:
    """Optimizer steps done: the batches trained on less the batches skipped before scoring.

    A step's metrics are logged at the number of batches before it (docs/long_run.md), and a skipped batch
    (``health/skipped_batches``, cumulative) moves that axis without an optimizer step, which is what
    ``--trainer.max_steps`` counts.

    >>> steps_reached({"perf/step_seconds": [(0, 9.0), (11, 9.0)], "health/skipped_batches": [(0, 0.0), (11, 2.0)]})
    10
    """
    if not curves.get(TRAINED):
        return 0
    skipped = curves.get("health/skipped_batches")
    return 1 + int(curves[TRAINED][-1][0]) - (int(skipped[-1][1]) if skipped else 0)


def by_sitting(points: list, sittings: list[dict], from_step: float, warmup: int = 0) -> list[list]:
    """``points`` at steps >= ``from_step``, grouped by the sitting that logged them, leaving out each sitting's
    first ``warmup`` steps.

    >>> sittings = [{"first_step": 0}, {"first_step": 10}]
    >>> by_sitting([(s, 0.0) for s in range(0, 20, 2)], sittings, from_step=4, warmup=3)
    [[(4, 0.0), (6, 0.0), (8, 0.0)], [(14, 0.0), (16, 0.0), (18, 0.0)]]
    """
    starts = [s["first_step"] for s in sittings if s["first_step"] is not None]
    groups: dict[int, list] = {}
    for step, value in points:
        k = sum(start <= step for start in starts)  # the sitting that logged it (1-based)
        if step >= from_step and (k == 0 or step >= starts[k - 1] + warmup):
            groups.setdefault(k, []).append((step, value))
    return [groups[k] for k in sorted(groups)]


def slope_per_100(groups: list[list[tuple[float, float]]], scale: float = 1000.0) -> float | None:
    """Least-squares slope of ``(step, value)`` points with one intercept per group, times ``scale`` (GB -> MB) per
    100 steps; ``None`` with no spread of steps within a group.

    >>> round(slope_per_100([[(0, 1.000), (100, 1.001)], [(200, 0.900), (300, 0.901)]]), 6)  # 1 MB/100 in each
    1.0
    """
    num = den = 0.0
    for g in groups:
        mx, my = sum(x for x, _ in g) / len(g), sum(y for _, y in g) / len(g)
        num += sum((x - mx) * (y - my) for x, y in g)
        den += sum((x - mx) ** 2 for x, _ in g)
    return None if den == 0 else 100 * scale * num / den


def kl_within_2x(realized: list[float], target: float) -> tuple[float | None, float | None]:
    """The share of measured steps with ``target / 2 <= realized <= 2 * target``, and the realized KL's median."""
    if not realized:
        return None, None
    inside = sum(target / 2 <= v <= 2 * target for v in realized)
    return inside / len(realized), statistics.median(realized)


def rises(counter: list) -> list[int]:
    """The steps at which a cumulative counter rose, once per unit; a fall is a counter that started over."""
    out, prev = [], 0.0
    for step, value in counter:
        out += [int(step)] * round(value - prev if value >= prev else value)
        prev = value
    return out


def step_peaks(curves: dict[str, list]) -> dict[int, float]:
    """``{step: GB}``: the largest ``memory/<phase>/peak_gb`` of each step's phases (the trainer's peak RSS)."""
    peaks: dict[int, float] = {}
    for phase in PHASES:
        for step, gb in curves.get(f"memory/{phase}/peak_gb", []):
            peaks[step] = max(peaks.get(step, 0.0), gb)
    return peaks


def moving_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the up to ``window - 1`` before it.

    >>> moving_mean([1.0, 3.0, 5.0, 7.0], 2)
    [1.0, 2.0, 4.0, 6.0]
    """
    return [statistics.fmean(values[max(0, j - window + 1) : j + 1]) for j in range(len(values))]
