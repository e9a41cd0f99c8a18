"""The package's module graph: no import cycles, and ``optim/`` stands alone (docs/design.md, issue 21).

The graph is read from the source with ``ast`` (nothing is imported): an edge ``a -> b`` for every
``import``/``from ... import`` of a ``logra_lightning`` module in ``a``; ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg``.

* Cycles are checked on *import-time* edges: statements at module level (also inside
  ``try``/``if``, but not under ``if TYPE_CHECKING:``). An import inside a function runs
  later and is the usual way to keep a heavy or upward dependency out of import time.
* ``optim/`` is checked on *every* edge, function-level imports included: it may import
  itself and the small neutral modules in :data:`OPTIM_MAY_IMPORT` only (which in turn import
  nothing else of the package), so the optimizer can be read, tested and reused without
  ``rollout/``, ``callbacks/`` or the Lightning module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "logra_lightning"
OPTIM_MAY_IMPORT = {"logra_lightning.sync_wire", "logra_lightning.errors", "logra_lightning._util"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The longest prefix of dotted ``name`` that is one of our modules."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")  # fmt: skip


def _imports(module: str, top_level_only: bool) -> set[str]:
    """Our modules that ``module`` imports (at import time only, or anywhere)."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and top_level_only:
                continue
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                if not top_level_only:
                    visit(child)
                continue
            if isinstance(child, ast.Import):
                found.update(filter(None, (_resolve(a.name) for a in child.names)))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from . import x / from ..a import b
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in child.names:
                    target = _resolve(f"{base}.{alias.name}") or _resolve(base)
                    if target:
                        found.add(target)
            visit(child)

    visit(tree)
    found.discard(module)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_graph_is_read_from_the_source():
    """The reader finds edges we know exist (a reader that finds nothing would pass every check)."""
    assert "logra_lightning.optim.logra" in MODULES and "logra_lightning.module" in MODULES
    assert "logra_lightning.sync_wire" in _imports("logra_lightning.optim.logra", top_level_only=True)
    assert "logra_lightning.grpo" in _imports("logra_lightning.module", top_level_only=True)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = {m: _imports(m, top_level_only=True) for m in MODULES}
    assert _cycles(graph) == [], "modules that import each other at import time"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("logra_lightning.optim")))
def test_optim_imports_only_itself_and_neutral_modules(module):
    upward = {m for m in _imports(module, top_level_only=False)
              if not m.startswith("logra_lightning.optim") and m not in OPTIM_MAY_IMPORT}  # fmt: skip
    assert not upward, f"{module} imports {sorted(upward)}: optim/ must not depend on the modules above it"


@pytest.mark.parametrize("module", sorted(OPTIM_MAY_IMPORT))
def test_what_optim_may_import_imports_nothing_above_optim(module):
    above = _imports(module, top_level_only=False) - OPTIM_MAY_IMPORT
    assert not above, f"{module} imports {sorted(above)}; optim/ imports it, so it must stay a leaf"


def test_code_cites_existing_sections_of_docs_design_md():
    """Code cites ``docs/design.md §N`` (in the repository), never a ``DESIGN.md`` outside it; every §N exists."""
    import re

    root = PKG.parent
    sections = set(re.findall(r"^## (\d+)\.", (root / "docs" / "design.md").read_text(), flags=re.M))
    assert sections, "docs/design.md has numbered sections '## N. ...'"
    sources = [p for d in ("logra_lightning", "scripts", "benchmarks", "configs", "tests") for p in (root / d).rglob("*")
               if p.suffix in (".py", ".sh", ".yaml") and p.name != "test_layout.py"]  # fmt: skip
    cited, wrong = set(), []
    for path in sources:
        text = path.read_text(errors="replace")
        wrong += [f"{path.relative_to(root)}: cites DESIGN.md" for _ in re.findall(r"\bDESIGN\.md", text)]
        cited |= {(str(path.relative_to(root)), n) for n in re.findall(r"docs/design\.md §(\d+)", text)}
    wrong += [f"{p}: §{n} is not a section of docs/design.md" for p, n in sorted(cited) if n not in sections]
    assert cited and not wrong, wrong
