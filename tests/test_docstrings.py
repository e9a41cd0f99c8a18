"""Every runnable example in the package's docstrings runs and prints what it says (``doctest``).

Examples that need a trainer run, a GPU or a vLLM engine are marked ``# doctest: +SKIP`` where they
stand; everything else runs here, so a docstring cannot drift from the code it documents. A module whose
source shows an example (a ``>>>`` line that is not only a comment) must have doctest find at least one, so
examples that doctest cannot see (in a comment, or a string it does not collect) fail here instead of going
unchecked; the task and reward modules below must keep running examples. This is the only place the package's
doctests run.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil
import re

import pytest

import logra_lightning

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(logra_lightning.__path__, "logra_lightning.")
    if not m.name.endswith("__main__")
)


# Modules whose examples are their documentation (a task's problems, a reward's scores): they must run some.
RUNS_EXAMPLES = {
    "logra_lightning.builtin.reasoning",
    "logra_lightning.data.chain_arithmetic",
    "logra_lightning.data.countdown",
    "logra_lightning.data.reasoning_gym",
    "logra_lightning.data.sorting",
    "logra_lightning.data.splits",
    "logra_lightning.rewards.answer",
    "logra_lightning.rewards.countdown",
    "logra_lightning.rewards.reasoning_gym",
}


def test_the_modules_that_must_run_examples_exist():
    assert RUNS_EXAMPLES <= set(MODULES), RUNS_EXAMPLES - set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (output above)"
    if re.search(r"^\s*>>> (?!#)", inspect.getsource(module), flags=re.M):  # found includes skipped examples
        found = sum(len(test.examples) for test in doctest.DocTestFinder().find(module, name))
        assert found > 0, f"{name} shows examples (>>>) that doctest does not find"
    assert name not in RUNS_EXAMPLES or result.attempted > 0, f"{name} runs no examples"
