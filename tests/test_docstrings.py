"""Every runnable example in the package's docstrings runs and prints what it says (``doctest``).

Examples that need a trainer run, a GPU or a vLLM engine are marked ``# doctest: +SKIP`` where they
stand; everything else runs here, so a docstring cannot drift from the code it documents.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import logra_lightning

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(logra_lightning.__path__, "logra_lightning.")
    if not m.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (output above)"
