"""How results read: cell formatters, tables from column specs, targets with their verdicts.

A benchmark's ``section`` builds its README lines from these, so every number in the README is a
field of a results file passed through a formatter declared here or in a :class:`Col`.

Example::

    >>> rows = [{"name": "adamw", "ok": True, "peak_bytes": 2.0e9}, {"name": "x", "ok": False, "error": "OOM"}]
    >>> table(rows, [Col("row", "name"), Col("peak MB", "peak_bytes", "mb0")])
    ['| row | peak MB |', '|---|---|', '| adamw | 2000 |', '| x | failed: OOM |']
    >>> Target("state ≤ 10% of AdamW's", lambda s: s["ratio"], "<=", 0.10, "pct").verdict({"ratio": 0.048})
    "state ≤ 10% of AdamW's → 4.8% (met)"
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MB = 1e6
GB = 1e9


def pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def num(x, fmt: str = ".2f") -> str:
    return "–" if x is None or isinstance(x, str) else format(x, fmt)


def load_text(load: dict | None) -> str:
    return "–" if not load else f"{load['1m']:.1f}/{load['5m']:.1f}/{load['15m']:.1f}"


FORMATS: dict[str, Callable[[Any], str]] = {
    "": str,
    "pct": pct,
    "pct0": lambda x: pct(x, 0),
    "pct2": lambda x: pct(x, 2),
    "mb0": lambda x: num(None if x is None else x / MB, ".0f"),
    "mb1": lambda x: num(None if x is None else x / MB, ".1f"),
    "mb2": lambda x: num(None if x is None else x / MB, ".2f"),
    "gb2": lambda x: num(None if x is None else x / GB, ".2f"),
    "gb3": lambda x: num(None if x is None else x / GB, ".3f"),
    "load": load_text,
    "g": lambda x: "–" if x is None else f"{x:g}",
    "x2": lambda x: num(x, ".2f") + ("×" if x is not None else ""),
}


def fmt(x: Any, spec: str | Callable[[Any], str]) -> str:
    """``x`` through a named format (:data:`FORMATS`), a format spec (``".2f"``) or a function."""
    if callable(spec):
        return spec(x)
    return FORMATS[spec](x) if spec in FORMATS else num(x, spec)


@dataclass(frozen=True)
class Col:
    """A table column: a header, the row key (or a function of the row) and the cell format."""

    header: str
    value: str | Callable[[dict], Any]
    format: str | Callable[[Any], str] = ""

    def cell(self, r: dict) -> str:
        x = self.value(r) if callable(self.value) else r.get(self.value)
        return fmt(x, self.format)


def rows_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def table(rows: list[dict], cols: list[Col], failed: Callable[[dict], bool] = lambda r: not r.get("ok", True)) -> list:
    """A Markdown table, one line per row; a failed row shows its error after the first cell."""
    cells = []
    for r in rows:
        if failed(r):
            cells.append([cols[0].cell(r), "failed: " + clip(r.get("error") or "", 160)] + [""] * (len(cols) - 2))
        else:
            cells.append([c.cell(r) for c in cols])
    return rows_table([c.header for c in cols], cells)


def bars(ax, groups: list[str], series: list[str], get: Callable, err: Callable | None = None, title: str = "") -> None:
    """Grouped bars on a matplotlib ``ax``: per group, one bar per series, ``get(group, series)`` high (``None``: 0),
    with ``err(group, series)`` error bars."""
    width = 0.8 / max(len(series), 1)
    for i, s in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))]
        yerr = [err(g, s) or 0 for g in groups] if err else None
        ax.bar(xs, [get(g, s) or 0 for g in groups], width, yerr=yerr, label=s, color=f"C{i}", capsize=3)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


OPS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq}


@dataclass(frozen=True)
class Target:
    """A declared target: ``label → value (met / missed)``, the value a key of a result or a function of it."""

    label: str
    value: str | Callable[[Any], float | None]
    op: str
    bound: float
    format: str | Callable[[Any], str] = ".2f"

    def get(self, res: Any) -> float | None:
        return res.get(self.value) if isinstance(self.value, str) else self.value(res)

    def met(self, res: Any) -> bool | None:
        x = self.get(res)
        return None if x is None else OPS[self.op](x, self.bound)

    def verdict(self, res: Any) -> str:
        ok = self.met(res)
        verdict = "not measured" if ok is None else met(ok)
        return f"{self.label} → {fmt(self.get(res), self.format)} ({verdict})"


def command_head(res: dict, end: bool = True, loads: str = "load") -> str:
    """The start of a section: ``Command: `...` — N s, load at start A, at end B.``

    A result merged by hand from several runs names them all and gives no single wall time or load.
    """
    e = res["envelope"]
    text = f"Command: `{e.get('command') or '`; `'.join(e.get('commands') or [])}`"
    if not isinstance(e.get("wall_seconds"), (int, float)) or not isinstance(e.get("load_start"), dict):
        return text + (f" ({e['note']})." if e.get("note") else ".")
    text += f" — {e['wall_seconds']:.0f} s, {loads} at start {load_text(e['load_start'])}"
    return text + (f", at end {load_text(e['load_end'])}." if end else ".")


def clip(text: str, n: int) -> str:
    """An error message cut to ``n`` characters, safe inside a table cell."""
    return text[:n].replace("|", "/").replace("\n", " ")


def met(ok: bool) -> str:
    return "met" if ok else "**missed**"
