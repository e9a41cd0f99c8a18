"""Small helpers used across the package; a bottom-level module that imports nothing from it.

Example::

    >>> import torch
    >>> local(torch.ones(2)).shape, full(torch.ones(2)).shape  # a plain tensor is its own shard and whole
    (torch.Size([2]), torch.Size([2]))
    >>> warn = WarnOnce(warn=print)
    >>> warn("k", "said once"); warn("k", "said once")
    said once
    >>> mix_seed(1, 2) == mix_seed(1, 2) != mix_seed(1, 3)
    True
    >>> class Owner:
    ...     def hook(self, x):
    ...         return x + 1
    >>> owner = Owner(); call = weak_method(owner.hook)
    >>> call(1)
    2
    >>> del owner; call(1) is None  # the object is gone: a no-op
    True
    >>> import os
    >>> with environment({"LOGRA_DOC_A": "1"}, {"LOGRA_DOC_B": "2"}):
    ...     os.environ["LOGRA_DOC_A"], os.environ["LOGRA_DOC_B"]
    ('1', '2')
    >>> "LOGRA_DOC_A" in os.environ or "LOGRA_DOC_B" in os.environ  # put back as it was
    False
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, detached: all-gathered if ``t`` is a DTensor (FSDP2; a collective), else ``t`` itself."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """A bound ``method`` as a callable that does not keep its object alive; a no-op once the object is gone.

    For hooks on tensors: torch does not collect a reference cycle that runs through a tensor's hooks,
    so an optimizer whose bound method is a hook on a param it holds would live, and keep acting on
    that param's gradients, for the rest of the process.
    """
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call


class WarnOnce:
    """Issue each warning (by key) once per instance.

    Args:
        warn: called with the message; default ``warnings.warn`` pointing at the caller's caller
            (Lightning callbacks pass ``rank_zero_warn``).
    """

    def __init__(self, warn: Callable[[str], object] | None = None) -> None:
        self._warn = warn
        self.seen: set[str] = set()

    def __call__(self, key: str, msg: str) -> None:
        if key in self.seen:
            return
        self.seen.add(key)
        if self._warn is None:
            warnings.warn(msg, stacklevel=3)
        else:
            self._warn(msg)


_MASK63 = (1 << 63) - 1


def mix_seed(seed: int, step: int, salt: int = 0) -> int:
    """Combine integers into one 63-bit generator seed (SplitMix64-style)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9 + int(salt) * 0x94D049BB133111EB) & _MASK63
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & _MASK63
    return x ^ (x >> 29)


@contextmanager
def environment(overrides: dict[str, str], defaults: dict[str, str]) -> Iterator[None]:
    """``overrides`` set, and ``defaults`` where unset, in ``os.environ`` inside the block; put back after.

    For settings read when something starts (vLLM's engine processes inherit them) or is first imported
    (``datasets`` reads ``HF_DATASETS_OFFLINE``), without changing this process's environment for good.
    """
    values = {**{k: v for k, v in defaults.items() if k not in os.environ}, **overrides}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
