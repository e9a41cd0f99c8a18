"""The sync wire: what the trainer sends an engine, used by the callback, the engines and the vLLM worker.

* :class:`LowRankUpdate` — one matrix update ``W <- c * W + left @ right``, named by the
  parameter's HF name. :class:`~logra_lightning.optim.LoGRA` records the factors it applied
  in this type, with which factor is the matrix's *basis* (fixed between refreshes) and a
  version id of that basis; :class:`~logra_lightning.callbacks.LowRankWeightSync` sends them.
* :class:`BasisVersions` — the version ids LoGRA hands out: a new id whenever a basis tensor
  is replaced (a refresh, a ``load_state_dict``) or changed in place.
* :class:`BasisCache` — what an engine keeps between syncs: the last basis of each matrix
  with its version, so that between refreshes the wire carries only the coefficient
  (``r*m`` or ``r*n`` numbers). A coefficient whose basis version the engine does not hold
  is refused, naming the parameter (docs/design.md §5).
* how a sync is laid out for the engine's workers (a header and one byte buffer):
  :mod:`~logra_lightning.sync.frames`.

Example::

    >>> import torch
    >>> u = LowRankUpdate("w", 0.9, torch.ones(4, 2), torch.ones(2, 3), basis="right", version="a.1")
    >>> u.nbytes, u.without_basis().nbytes, tensor_nbytes(torch.zeros(5))
    (56, 32, 20)
    >>> cache = BasisCache()
    >>> cache.keep([u])  # after applying an update that carried its basis
    >>> [tuple(t.shape) for _, _, _, t in cache.resolve([u.without_basis()])]  # next step: the coefficient alone
    [(2, 3)]
"""

from __future__ import annotations

import dataclasses
import secrets
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

_SIDES = ("left", "right")


def tensor_nbytes(t: torch.Tensor | None) -> int:
    """Bytes of ``t``'s elements (for a DTensor: of the global tensor; ``None``: 0)."""
    return 0 if t is None else t.numel() * t.element_size()


@dataclass
class LowRankUpdate:
    """One matrix update ``W <- c * W + left @ right`` named by its HF parameter name.

    ``left`` is ``[m, r]`` and ``right`` is ``[r, n]`` for a weight of shape ``[m, n]``
    (a 3-D expert weight ``[E, m', n]`` is its ``[E*m', n]`` matrix).

    ``basis`` (``"left"``, ``"right"`` or ``None``) names the factor that stays fixed between
    basis refreshes (``right = Q.T`` for a right sketch, ``left = P`` for a left one) and
    ``version`` identifies it. That factor may be ``None`` on the wire: the engine then uses
    the one it holds under ``key`` (default: ``name``) and refuses if its version differs.
    """

    name: str
    c: float
    left: torch.Tensor | None
    right: torch.Tensor | None
    basis: str | None = None
    version: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if self.basis is not None and (self.basis not in _SIDES or self.version is None):
            raise ValueError(f"{self.name}: basis={self.basis!r} needs 'left' or 'right' and a version")
        if self.left is None and self.right is None or (self.basis is None and None in (self.left, self.right)):
            raise ValueError(f"{self.name}: an update without a basis version needs both factors")

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.left) + tensor_nbytes(self.right)

    @property
    def basis_key(self) -> str:
        return self.key or self.name

    @property
    def basis_factor(self) -> torch.Tensor | None:
        return None if self.basis is None else getattr(self, self.basis)

    @property
    def basis_nbytes(self) -> int:
        return tensor_nbytes(self.basis_factor)

    def without_basis(self) -> LowRankUpdate:
        """The same update with only the coefficient: for an engine that holds this basis version."""
        if self.basis is None:
            raise ValueError(f"{self.name}: an update without a basis version cannot drop a factor")
        return dataclasses.replace(self, **{self.basis: None})


class BasisVersions:
    """Version ids of bases, as :class:`~logra_lightning.optim.LoGRA` records them with each update.

    ``of(key, basis)`` returns the same id as long as ``basis`` is the same tensor object,
    unchanged in place; any other tensor (a refreshed basis, one loaded from a checkpoint)
    gets a new id. Ids are ``"<salt>.<serial>"`` with a random salt per instance, so two
    optimizers never share one. Only a weak reference to the basis is kept.
    """

    def __init__(self) -> None:
        self.salt = secrets.token_hex(4)
        self.serial = 0
        self._seen: dict[object, tuple[weakref.ref, int, str]] = {}

    def of(self, key: object, basis: torch.Tensor) -> str:
        ref, counter, version = self._seen.get(key, (None, -1, ""))
        if ref is None or ref() is not basis or counter != basis._version:
            self.serial += 1
            version = f"{self.salt}.{self.serial}"
            self._seen[key] = (weakref.ref(basis), basis._version, version)
        return version


class BasisCache:
    """An engine's bases, by key, each with its version (docs/design.md §5).

    An engine calls :meth:`resolve` (checks only) before it changes any weight and
    :meth:`keep` once the updates are applied.
    """

    def __init__(self) -> None:
        self.bases: dict[str, tuple[str, torch.Tensor]] = {}

    def resolve(self, updates: Iterable[LowRankUpdate]) -> list[tuple[str, float, torch.Tensor, torch.Tensor]]:
        """Full factors ``(name, c, left, right)`` of each update, in order; the cache does not change.

        A basis carried by an update serves the later updates of the same call too.

        Raises:
            ValueError: an update carries only its coefficient and the engine holds no basis
                under its key, or holds another version (the message names the parameter).
        """
        held = dict(self.bases)
        out = []
        for u in updates:
            if u.basis is None:
                out.append((u.name, u.c, u.left, u.right))
                continue
            factor = u.basis_factor
            if factor is not None:
                held[u.basis_key] = (u.version, factor)
            else:
                have = held.get(u.basis_key)
                if have is None:
                    raise ValueError(
                        f"{u.name}: the engine holds no basis for {u.basis_key!r} and the update carries only its "
                        f"coefficient (needs basis version {u.version}); the sender must resend the basis"
                    )
                if have[0] != u.version:
                    raise ValueError(
                        f"{u.name}: the engine holds basis version {have[0]} for {u.basis_key!r} but the update "
                        f"needs version {u.version}; refusing to apply it to the wrong basis"
                    )
                factor = have[1]
            left, right = (factor, u.right) if u.basis == "left" else (u.left, factor)
            out.append((u.name, u.c, left, right))
        return out

    def keep(self, updates: Iterable[LowRankUpdate]) -> None:
        """Store (a copy of) every basis the updates carry, replacing the one held under its key."""
        for u in updates:
            if u.basis_factor is not None:
                have = self.bases.get(u.basis_key)
                if have is None or have[0] != u.version:
                    self.bases[u.basis_key] = (u.version, u.basis_factor.detach().clone())

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(t) for _, t in self.bases.values())


def wire_updates(
    updates: Iterable[LowRankUpdate], held: dict[str, str], dtype: torch.dtype = torch.float32, keep_bases: bool = True
) -> tuple[list[LowRankUpdate], dict[str, str]]:
    """What to send an engine: each update with its factors in ``dtype``, without its basis where ``held``
    (name -> basis version the engine holds) has that version.

    Returns the updates and the new ``held`` (adopt it once the engine has applied them). With
    ``keep_bases=False`` (an engine that keeps no bases) every update carries both factors.
    """
    held = dict(held)
    out = []
    for u in updates:
        cast = {s: t.to(dtype) for s in _SIDES if (t := getattr(u, s)) is not None and t.dtype != dtype}
        u = dataclasses.replace(u, **cast) if cast else u
        if keep_bases and u.basis is not None:
            if held.get(u.name) == u.version:
                u = u.without_basis()
            held[u.name] = u.version
        out.append(u)
    return out, held


@torch.no_grad()
def match_wire_rounding_(weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, dtype: torch.dtype) -> None:
    """``weight += round(L) @ round(R) - L @ R`` (rounding to ``dtype``): the sender's weights then change by
    exactly the update the engine receives in ``dtype``.

    One rank-``2r`` product ``[round(L) - L, L] @ [round(R); round(R) - R]``, so ``weight`` is rounded once.

    Args:
        weight: ``[m, n]`` (changed in place).
        left: ``[m, r]``; right: ``[r, n]``, as applied to ``weight`` (in fp32).
    """
    left, right = left.float(), right.float()
    left_r, right_r = left.to(dtype).float(), right.to(dtype).float()
    a = torch.cat([left_r - left, left], dim=1)  # [m, 2r]
    b = torch.cat([right_r, right_r - right], dim=0)  # [2r, n]
    if weight.dtype == torch.float32:
        weight.addmm_(a, b)
    else:
        weight.add_((a @ b).to(weight.dtype))
