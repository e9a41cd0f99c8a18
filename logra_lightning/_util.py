"""Small helpers used across the package; a bottom-level module that imports nothing from it.

Example::

    >>> import torch
    >>> local(torch.ones(2)).shape  # a plain tensor is its own local shard
    torch.Size([2])
    >>> warn = WarnOnce(warn=print)
    >>> warn("k", "said once"); warn("k", "said once")
    said once
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


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
