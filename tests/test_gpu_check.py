"""scripts/gpu_check.sh without a GPU: it must fail fast, and its summary must read TensorBoard logs right."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
BASH = shutil.which("bash") or "/bin/bash"


def run_script(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": path if path is not None else os.environ["PATH"]}
    return subprocess.run([BASH, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_fails_fast_without_nvidia_smi(tmp_path):
    # a PATH holding only the tools the script needs before its GPU check, and no nvidia-smi
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "env"):
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    start = time.monotonic()
    result = run_script(path=str(bin_dir))
    assert time.monotonic() - start < 5
    assert result.returncode == 1
    assert "no NVIDIA GPU on this machine (nvidia-smi not found)" in result.stderr


def test_summarize_reads_memory_step_time_and_reward(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "gpu_check" / "version_0"))
    for step in range(20):
        writer.add_scalar("memory/optimizer/peak_gb", 0.5 + 0.01 * step, step)
        writer.add_scalar("memory/total/peak_gb", 3.0 + (0.2 if step == 7 else 0.0), step)
        writer.add_scalar("perf/step_seconds", 9.0 if step == 0 else 1.5, step)
        writer.add_scalar("reward/mean", step / 20, step)
    writer.close()
    result = run_script("--summarize", str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "memory/total/peak_gb" in out and "3.20" in out and "0.69" in out
    assert "median 1.50, mean 1.50 over 19 steps (first step 9.00 s, excluded)" in out
    assert "reward/mean: first 0.000, last 0.950, mean of last 5 0.850 (20 steps logged)" in out


def test_summarize_reports_missing_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    writer.add_scalar("reward/mean", 0.5, 0)
    writer.close()
    result = run_script("--summarize", str(tmp_path))
    assert result.returncode == 2
    assert "missing metrics: memory/*/peak_gb" in result.stderr and "perf/step_seconds" in result.stderr


def test_summarize_without_a_directory_says_how_to_call_it():
    result = run_script("--summarize")
    assert result.returncode == 1 and "usage:" in result.stderr
