"""Host (CPU) memory: give freed memory back to the OS during backward and after a step (docs/design.md §2),
and read the process's resident size and its resettable peak.

glibc's malloc keeps freed heap chunks resident: once an mmapped chunk of up to 32 MiB has
been freed, its dynamic mmap threshold rises to that size, and from then on every tensor
smaller than it (activations, gradients, sketches, Adam temporaries) comes from the heap,
whose freed pages stay in the process's RSS, so the peak RSS sits above the live tensor bytes
by what the allocator kept (``benchmarks/results/plan_vs_measured.json`` has both).
``malloc_trim(0)`` returns the free pages of every arena to the OS;
:class:`~logra_lightning.optim.LoGRA` (``release_host_memory=True``, the default) calls it from its
sketch hooks through a :class:`Trimmer`, once every 64 MiB of freed gradients, so what backward
freed so far is gone before the tied embedding's gradients peak, and at the end of ``step()``,
when the step's sketches, candidate updates and refresh buffers are gone. A trim walks every arena
(milliseconds): one per hook, ~1,700 a step on SmolLM2-135M with 8 micro-batches, cost a fifth of
the training phase, for no lower peak than one per 64 MiB (docs/speed.md).

Elsewhere (musl, macOS, Windows) :func:`trim` does nothing and returns ``False``. Tensors on a
GPU are untouched (the CUDA caching allocator keeps its own pool; this only trims host memory).

The CPU's bf16 matmuls (under autocast) keep every matmul primitive they build, one per shape, in two
process-wide caches of 1,024 entries by default (oneDNN's, and PyTorch's ideep layer's in front of it), each entry
holding buffers about the size of its weight. Packed RL micro-batches have a new token count almost every time,
so the caches never hit and only grow: SmolLM2-135M's trainer gained ~4.7 MB of RSS per step over its first 200
steps of the long run (bf16-mixed), ~0.67 MB per step over the next 150 with oneDNN's cache alone capped, and
nothing with both capped. A microbenchmark (three bf16 linears of SmolLM2's widths, forward and backward, 300
steps with token counts drawn from 800 values):
1,263 MB of RSS uncapped, 602 MB with oneDNN's cache at 64, 318 MB with both, 260 MB with one token count.
:func:`bound_kernel_caches` caps both at 64 (the vLLM engine's processes too:
:mod:`logra_lightning.rollout.vllm.engine` choice 5); each cache reads its capacity at its first primitive, so
:class:`~logra_lightning.rl.PolicyGradientModule` calls it when built, and the environment is left as it was.

The peak is the kernel's high-water mark ``VmHWM``, which Linux (>= 4.0) resets when ``5`` is written
to ``/proc/self/clear_refs``; psutil reads the resident size but has no resettable peak.

Example::

    >>> isinstance(trim(), bool)
    True
    >>> reset_peak_rss(); peak_rss() >= rss() * 0.5 > 0
    True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re

import psutil
import torch


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim``, or ``None`` where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim() -> bool:
    """Return free heap pages to the OS (``malloc_trim(0)``); ``True`` if any memory was released."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


class Trimmer:
    """Calls :func:`trim` once at least ``every`` bytes were reported freed since the last trim.

    Example::

        >>> t = Trimmer(every=100)
        >>> t.freed(60), t.freed(60), t.pending  # the second call trims
        (False, True, 0)
    """

    def __init__(self, every: int = 64 << 20) -> None:
        self.every = every
        self.pending = 0  # bytes freed since the last trim

    def freed(self, nbytes: int) -> bool:
        """Count ``nbytes`` freed; trim when the budget is reached. Returns whether it trimmed."""
        self.pending += nbytes
        if self.pending < self.every:
            return False
        self.pending = 0
        trim()
        return True

    def flush(self) -> None:
        """Trim now (end of a step) and start counting again."""
        self.pending = 0
        trim()


def rss() -> int:
    """This process's resident set size, in bytes."""
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    """This process's peak resident set size since the last :func:`reset_peak_rss` (``VmHWM``), in bytes.

    Raises:
        OSError: not on Linux (no ``/proc/self/status`` with ``VmHWM``).
    """
    with open("/proc/self/status") as f:
        match = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
    if match is None:
        raise OSError("VmHWM not found in /proc/self/status")
    return int(match.group(1)) * 1024


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS counter to the current RSS (Linux >= 4.0; raises ``OSError`` elsewhere)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # 5: reset the peak RSS only (no page-table side effects)


# The matmul-primitive caches a CPU process keeps, each 1,024 entries by default: oneDNN's own, and the one PyTorch's
# ideep layer keeps in front of it (``LRU_CACHE_CAPACITY``); bounding one leaves the other growing.
CPU_KERNEL_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def bound_kernel_caches() -> list[str]:
    """Cap this process's CPU matmul-primitive caches (:data:`CPU_KERNEL_CACHES`), each unless set; returns those it
    capped.

    Each cache reads its capacity from the environment once, when the process (ideep's: the thread) builds its
    first primitive. So the values are put in ``os.environ`` only while one bf16 linear's forward and backward
    builds those primitives here, then the environment is left as it was. Call it before any other bf16 matmul
    on CPU; for processes started later (vLLM's) pass :data:`CPU_KERNEL_CACHES` in their environment.

    Example::

        >>> import os
        >>> before = dict(os.environ); _ = bound_kernel_caches(); dict(os.environ) == before
        True
    """
    unset = [k for k in CPU_KERNEL_CACHES if k not in os.environ]
    if not unset:
        return unset
    try:
        os.environ.update({k: CPU_KERNEL_CACHES[k] for k in unset})
        # backward builds its own primitives; a caller's no_grad or inference_mode would skip them
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.ones(64, 64, requires_grad=True)  # small matmuls skip oneDNN
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = torch.nn.functional.linear(x, x)
            y.float().sum().backward()
    finally:
        for k in unset:
            os.environ.pop(k, None)
    return unset
