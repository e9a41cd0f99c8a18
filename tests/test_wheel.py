"""The user's path from a pip install, outside the repository (slow: builds the wheel and a fresh venv).

A fresh venv gets the built wheel with the real-model extra (``pip install --no-index 'WHEEL[real]'``): pip
resolves every requirement against this interpreter's site-packages, seen through a folder of links without
this repository's own (editable) install, so nothing is downloaded, a missing or conflicting requirement fails
the install, and the repository is not importable. Then, in
an empty working directory: ``logra configs``, ``logra configs cp``, and 2 steps of ``logra fit`` on the
copied config with a reward from a file there and a Parquet dataset with extra columns the reward reads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: int = 600) -> str:
    env = env or {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the repository's
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of the sources (the build writes build/ and *.egg-info where it runs)."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "configs", "callbacks", "logra_lightning"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        kwargs = {"symlinks": True, "ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}
        copy(ROOT / name, src / name, **kwargs)
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"), "."],
        src,
    )
    (wheel,) = (tmp / "dist").glob("logra_lightning-*.whl")
    return wheel


def fresh_venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp)
    deps = tmp / "deps"  # this interpreter's packages, less this repository's own install
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("logra_lightning", "__editable__")) and entry.suffix != ".pth":
            (deps / entry.name).symlink_to(entry)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "deps.pth").write_text(f"{deps}\n")
    # The venv's own setuptools (65.5, from Python 3.11's ensurepip) comes before the linked packages and is older
    # than torch 2.13's setuptools>=77.0.3: kept, the resolver reports "Cannot install tensorboard==2.21.0 and
    # torch==2.13.0+cpu" (both depend on setuptools) and --no-index offers no newer one. Removed, the linked one counts
    run([str(venv / "bin/python"), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], tmp)
    run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "--no-index", f"{wheel}[real]"], tmp)
    return venv


REWARD = '''
def by_level(completions, answers, level, topic):
    """Exact match, counted only where the record's level (a Parquet column) allows it."""
    assert set(topic) == {"addition"}
    return [float(c.strip() == a) * (1.0 if lv <= 2 else 0.5) for c, a, lv in zip(completions, answers, level)]
'''


def test_pip_installed_wheel_runs_the_users_own_task(tmp_path):
    venv = fresh_venv(tmp_path, build_wheel(tmp_path))
    work = tmp_path / "work"  # no configs/, no callbacks/, no .cache: only what the user writes
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    where = run([str(venv / "bin/python"), "-c", "import logra_lightning; print(logra_lightning.__file__)"], work, env)
    assert where.startswith(str(venv)), where  # the wheel's package, not the repository's

    extra = run(
        [str(venv / "bin/python"), "-c", "import importlib.metadata as m; print(m.requires('logra-lightning'))"],
        work,
        env,
    )
    assert "gguf" in extra and "reasoning-gym" in extra and "datasets" in extra  # the extras the wheel declares
    run([str(venv / "bin/python"), "-c", "import gguf, reasoning_gym, pyarrow"], work, env)  # [real] resolved

    listing = run(["logra", "configs"], work, env)
    assert "smollm2_chain_sum" in listing and "memory_monitor" in listing
    run(["logra", "configs", "cp", "arithmetic_tiny_adamw", "my_task.yaml"], work, env)

    (work / "my_reward.py").write_text(textwrap.dedent(REWARD))
    rows = [
        {"q": f"{a}+{b}=", "sum": str(a + b), "level": 1 + (a + b) % 3, "topic": "addition"}
        for a in range(10)
        for b in range(10)
    ]
    pq.write_table(pa.Table.from_pylist(rows), work / "train.parquet")
    source = {
        "class_path": "logra_lightning.data.TableSource",
        "init_args": {"path": "train.parquet", "prompt_key": "q", "answer_key": "sum", "limit": 16},
    }
    (work / "overrides.yaml").write_text(
        json.dumps(
            {
                "trainer": {"max_steps": 2, "val_check_interval": 2, "limit_val_batches": 1},
                "model": {"reward": "my_reward.py:by_level", "group_size": 4},
                "data": {"train": source, "val": source, "batch_size": 4, "val_batch_size": 16},
            }
        )
    )
    out = run(["logra", "fit", "--config", "my_task.yaml", "--config", "overrides.yaml"], work, env)
    assert "held-out greedy accuracy" in out and "TensorBoard logs" in out
    (run_dir,) = (work / "runs" / "arithmetic_tiny_adamw").glob("version_*")
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    samples = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert samples and samples[0]["prompt"].endswith("=")
