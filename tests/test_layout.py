"""The package's shape: folders by job, no import cycle, and a layer order no import runs against.

The graph is read from the source with ``ast`` (nothing is imported): an edge ``a -> b`` for every
``import``/``from ... import`` of a ``logra_lightning`` module in ``a``, *including imports inside
functions* (a function-level import is still a dependency, only a later one); ``from pkg import
name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``. Imports under
``if TYPE_CHECKING:`` are type names only and are left out.

* No module takes part in an import cycle.
* Every package sits in one layer of :data:`LAYERS` and imports only its own layer and the ones
  below: the optimizer can be read, tested and reused without the RL loop, the engines or the
  callbacks; the RL step without the command line.
* The top level holds packages and a few leaves (:data:`TOP_LEVEL`).
* No module is longer than :data:`MAX_LINES`: past that a module holds more than one job.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "logra_lightning"

# Lowest first. A package may import its own layer and every layer below it, never one above.
LAYERS: list[tuple[str, set[str]]] = [
    ("leaves", {"errors", "_util"}),
    ("sync wire", {"sync"}),  # LoGRA records its updates in the wire's type
    ("optimizer", {"optim"}),
    ("models, data, rewards, plan", {"models", "data", "rewards", "plan"}),
    ("rollout engines", {"rollout"}),
    ("built-in policies", {"builtin"}),
    ("config checks", {"config"}),
    ("checkpoints and export", {"io"}),
    ("KL math and probe", {"kl"}),
    ("RL step", {"rl"}),
    ("callbacks", {"callbacks"}),
    # the command line, and two modules kept at paths that saved files name (their docstrings say which)
    ("entry points", {"cli", "__main__", "__init__", "adapters", "checkpoint_io"}),
]
TOP_LEVEL = {"__init__.py", "__main__.py", "errors.py", "_util.py", "adapters.py", "checkpoint_io.py"}
MAX_LINES = 450


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
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(module: str) -> set[str]:
    """Our modules that ``module`` imports, at module level or inside functions."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
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


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One list per strongly connected component with more than one module (Tarjan)."""
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


def package_of(module: str) -> str:
    """``logra_lightning.optim.logra`` -> ``optim``; the root package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(package: str) -> int:
    for i, (_, members) in enumerate(LAYERS):
        if package in members:
            return i
    raise AssertionError(f"package {package!r} is in no layer of tests/test_layout.py: LAYERS; add it")


GRAPH = {m: imports(m) for m in MODULES}


def test_the_graph_is_read_from_the_source():
    """The reader finds edges we know exist, at module level and inside functions."""
    assert "logra_lightning.sync.wire" in imports("logra_lightning.optim.logra")
    assert "logra_lightning.rl.loss" in imports("logra_lightning.rl.module")
    assert "logra_lightning.plan" in imports("logra_lightning.cli.main")  # a function-level import
    assert "logra_lightning.rl.trajectory" not in imports("logra_lightning.kl.probe")  # under TYPE_CHECKING
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_even_through_function_level_imports():
    assert cycles(GRAPH) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_runs_against_the_layers(module):
    mine = layer_of(package_of(module))
    upward = sorted(d for d in GRAPH[module] if layer_of(package_of(d)) > mine)
    assert not upward, (
        f"{module} (layer {LAYERS[mine][0]!r}) imports {upward} from a layer above it; move the shared piece down"
    )


def test_the_top_level_holds_packages_and_a_few_leaves():
    files = {p.name for p in PKG.glob("*.py")}
    assert files == TOP_LEVEL, f"top-level modules {sorted(files - TOP_LEVEL)}: put them in the package of their job"
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    assert packages == {pkg for _, members in LAYERS for pkg in members} - {p[:-3] for p in TOP_LEVEL}


def test_no_module_is_longer_than_the_limit():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}; split each by job"


def test_code_cites_existing_sections_of_docs_design_md():
    """Code cites ``docs/design.md §N`` (in the repository), never a ``DESIGN.md`` outside it; every §N exists."""
    sections = set(re.findall(r"^## (\d+)\.", (ROOT / "docs" / "design.md").read_text(), flags=re.M))
    assert sections, "docs/design.md has numbered sections '## N. ...'"
    sources = [
        p
        for d in ("logra_lightning", "scripts", "benchmarks", "configs", "tests")
        for p in (ROOT / d).rglob("*")
        if p.suffix in (".py", ".sh", ".yaml") and p.name != "test_layout.py"
    ]
    cited, wrong = set(), []
    for path in sources:
        text = path.read_text(errors="replace")
        wrong += [f"{path.relative_to(ROOT)}: cites DESIGN.md" for _ in re.findall(r"\bDESIGN\.md", text)]
        cited |= {(str(path.relative_to(ROOT)), n) for n in re.findall(r"docs/design\.md §(\d+)", text)}
    wrong += [f"{p}: §{n} is not a section of docs/design.md" for p, n in sorted(cited) if n not in sections]
    assert cited and not wrong, wrong
