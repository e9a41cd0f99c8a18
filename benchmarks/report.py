"""What every benchmark's report is made of: the cell formatters and the ``Report`` each script exposes.

Each benchmark script owns its result schema, so it also owns how a result reads: it exposes
``REPORTS = {result name: Report(title, section, plot, headline)}`` (``optimizer_memory.py``
writes two results, ``optimizer_memory`` and ``optimizer_step_time``). ``make_readme.py`` and
``plots.py`` only walk the names of ``run_all.SCRIPTS`` and call these:

* ``section(res) -> (lines, found)``: the README section's Markdown lines under its title, and
  what the headline may quote (``found[name]``);
* ``plot(res, plt) -> figure`` (or ``None``: no plot for that result);
* ``headline(found) -> lines`` (or ``None``): bullet lines of the README's "Headline numbers".

Example::

    >>> table(["a", "b"], [["1", pct(0.25)]])
    ['| a | b |', '|---|---|', '| 1 | 25.0% |']
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any, NamedTuple

MB = 1e6
GB = 1e9


class Report(NamedTuple):
    """How one result file reads: its README title and section, its plot, its headline bullets."""

    title: str
    section: Callable[[dict], tuple[list[str], Any]]
    plot: Callable[[dict, Any], Any] | None = None
    headline: Callable[[dict], list[str]] | None = None


def script_of(name: str) -> str:
    """The script (module under ``benchmarks/``) that writes result ``name``."""
    from benchmarks.run_all import FULL_ARGS

    return FULL_ARGS.get(name, (name, []))[0]


def report_of(name: str) -> Report:
    """The :class:`Report` that script ``script_of(name)`` exposes for result ``name``."""
    return import_module(f"benchmarks.{script_of(name)}").REPORTS[name]


def pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def num(x, fmt: str = ".2f") -> str:
    return "–" if x is None or isinstance(x, str) else format(x, fmt)


def load_text(load: dict | None) -> str:
    return "–" if not load else f"{load['1m']:.1f}/{load['5m']:.1f}/{load['15m']:.1f}"


def command_head(res: dict, end: bool = True) -> str:
    """The start of a section: ``Command: `...` — N s, load at start A, at end B.`` (``end=False``: no end load)."""
    text = f"Command: `{res['command']}` — {res['wall_seconds']:.0f} s, load at start {load_text(res['load_start'])}"
    return text + (f", at end {load_text(res['load_end'])}." if end else ".")


def clip(text: str, n: int) -> str:
    """An error message cut to ``n`` characters, safe inside a table cell."""
    return text[:n].replace("|", "/").replace("\n", " ")


def met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]
