"""Shipped configs and callback snippets by name (``logra configs``, ``logra fit --config NAME``); the model cache."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import console, tiny_run  # tests/conftest.py

from logra_lightning.builtin.registry import cache_dir
from logra_lightning.cli import run
from logra_lightning.cli.shipped import purpose, shipped

ROOT = Path(__file__).resolve().parents[1]


def test_every_repository_config_and_snippet_is_shipped_with_its_purpose(capsys):
    assert set(shipped("configs")) == {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert set(shipped("callbacks")) == {p.stem for p in (ROOT / "callbacks").glob("*.yaml")}
    assert run(["configs"]) == 0
    out = capsys.readouterr().out
    for kind in ("configs", "callbacks"):
        for name, path in shipped(kind).items():
            assert purpose(path), f"{path} opens without a comment saying what it is for"
            assert re.search(rf"^  {re.escape(name)} +\S", out, flags=re.M), name


def test_configs_cp_copies_a_config_and_a_snippet(tmp_path, capsys):
    assert run(["configs", "cp", "arithmetic_tiny_adamw", str(tmp_path / "mine.yaml")]) == 0
    assert (tmp_path / "mine.yaml").read_text() == (ROOT / "configs/arithmetic_tiny_adamw.yaml").read_text()
    assert run(["configs", "cp", "memory_monitor", str(tmp_path)]) == 0  # into a folder, under its own name
    assert (tmp_path / "memory_monitor.yaml").read_text() == (ROOT / "callbacks/memory_monitor.yaml").read_text()
    assert "logra fit --config" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["fit", "--config", "arithmetic_tiny_adamww"],
            r"--config arithmetic_tiny_adamww: no such file, and no "
            r"shipped config of that name; shipped configs close to it: arithmetic_tiny_adamw",
        ),
        (["fit", "--config", "configs/smollm2_chain_summ.yaml"], "close to it: smollm2_chain_sum"),
        (["configs", "cp", "arithmetic_tiny_adamw", "EXISTING"], "exists; remove it or choose another name"),
        (
            ["configs", "cp", "memory_monitr", "x.yaml"],
            "no shipped config or callback snippet of that name; shipped callback snippets close to it: memory_monitor",
        ),
    ],
)
def test_unknown_names_fail_with_one_line_naming_close_ones(argv, match, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "EXISTING").write_text("")
    assert re.search(match, console(argv, capsys))


def test_fit_by_name_outside_a_clone(tmp_path, monkeypatch, tiny_policy_path):
    """From a directory without configs/: a config by name, a snippet by name, and the documented configs/ path."""
    monkeypatch.chdir(tmp_path)
    cli = run(
        [
            "fit",
            "--config",
            "configs/arithmetic_tiny_adamw.yaml",  # as the docs write it: the shipped copy
            "--config",
            "arithmetic_tiny_adamw",
            "--trainer.callbacks+=memory_monitor",
            *tiny_run(tmp_path),
        ]
    )
    assert cli.trainer.global_step == 2
    assert any(type(cb).__name__ == "MemoryMonitor" for cb in cli.trainer.callbacks)


def test_cache_defaults_to_the_users_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("LOGRA_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "logra"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "logra"
    monkeypatch.setenv("LOGRA_CACHE_DIR", str(tmp_path / "mine"))  # still wins
    assert cache_dir() == tmp_path / "mine"
