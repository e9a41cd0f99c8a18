"""Gradient clipping over what LoGRA holds, and the torch entry points that reach it.

After backward a LoGRA low-rank matrix has no ``.grad`` (its hook sketched and freed it), so
``torch.nn.utils.clip_grad_norm_`` on its own would clip the dense params only and leave the
matrices unclipped, without a word. Here the global norm covers, for the params passed:

* the sketch ``S`` of each low-rank matrix: ``||S|| = ||G Q||`` (right) or ``||P.T G||`` (left),
  the norm of the gradient's projection onto the basis, ``<= ||G||`` (equal at full rank);
* the ``.grad`` of every other param (and of a low-rank one whose full gradient is kept:
  ``sketch_in_backward=False``, or plain DDP).

Everything is scaled by ``min(1, max_norm / (norm + 1e-6))`` like torch does; the norm is the
global one under DDP (sketches are averaged across replicas first) and FSDP2 (row shards summed),
so every rank clips by the same factor.

Entry points: :meth:`LoGRA.clip_grad_norm_ <logra_lightning.optim.LoGRA.clip_grad_norm_>` and
this module's :func:`clip_grad_norm_` always, and ``torch.nn.utils.clip_grad_norm_`` itself while a
LoGRA exists. That last one is what Lightning's ``gradient_clip_val`` reaches
(``Precision.clip_grad_by_norm`` calls ``torch.nn.utils.clip_grad_norm_(params, clip_val)`` with the
params alone: no hook on the way sees the optimizer), what ``LightningModule.clip_gradients`` reaches
under manual optimization, and what a plain PyTorch loop calls; without it they would clip the dense
params only. So torch's function is routed here, for as long as it is needed and no longer:

* the first LoGRA built binds this module's :func:`clip_grad_norm_` and :func:`clip_grad_value_` in
  ``torch.nn.utils`` and ``torch.nn.utils.clip_grad``; when the last LoGRA is garbage collected the
  functions bound there before are put back (unless someone rebound them since). A LoGRA lives as
  long as the model it was built on: its backward hooks on the params hold it.
* While routed, a call whose params hold no LoGRA low-rank matrix goes to torch's function unchanged.
* ``torch.nn.utils.clip_grad_value_`` on sketched matrices raises: there is no gradient element
  left to clip (Lightning's ``gradient_clip_algorithm="value"``).
* A function imported by name before the first LoGRA was built (``from torch.nn.utils import
  clip_grad_norm_``) stays torch's; call ``opt.clip_grad_norm_(max_norm)`` or this module's
  :func:`clip_grad_norm_` there. :func:`routed` says whether torch's names lead here now.

Example::

    >>> import torch
    >>> from logra_lightning.optim import LoGRA, logra_param_groups
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8))
    >>> opt = LoGRA(logra_param_groups(model, rank=4), lr=1e-3)
    >>> model(torch.randn(8, 16)).pow(2).sum().backward()
    >>> norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # sketches included
    >>> bool(clip_grad_norm_(model.parameters(), float("inf")) <= 1.01e-3)
    True
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

_TORCH_NORM = torch.nn.utils.clip_grad.clip_grad_norm_
_TORCH_VALUE = torch.nn.utils.clip_grad.clip_grad_value_
_OWNERS: weakref.WeakSet = weakref.WeakSet()  # live LoGRA optimizers
_LOCK = threading.RLock()  # re-entrant: a garbage collection inside the lock may finalize a LoGRA
_DISPLACED: dict[tuple[ModuleType, str], Any] = {}  # (module, name) -> what was bound there before routing


def register(optimizer: Any) -> None:
    """Route clipping of ``optimizer``'s low-rank params here while it lives (called by ``LoGRA.__init__``)."""
    with _LOCK:
        if optimizer in _OWNERS:
            return
        _OWNERS.add(optimizer)
        weakref.finalize(optimizer, _sync)
        _sync()


def routed() -> bool:
    """Whether ``torch.nn.utils.clip_grad_norm_`` leads to this module now (while any LoGRA lives)."""
    return torch.nn.utils.clip_grad_norm_ is clip_grad_norm_


def _sync() -> None:
    """Route torch's clipping functions here if a LoGRA lives, else put back what was there."""
    with _LOCK:
        if any(True for _ in _OWNERS):  # iterating skips the optimizer being finalized
            _route()
        else:
            _unroute()


def _route() -> None:
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        for name, ours in (("clip_grad_norm_", clip_grad_norm_), ("clip_grad_value_", clip_grad_value_)):
            current = getattr(module, name)
            if current is not ours:
                _DISPLACED[(module, name)] = current
                setattr(module, name, ours)


def _unroute() -> None:
    for (module, name), previous in list(_DISPLACED.items()):
        if getattr(module, name) in (clip_grad_norm_, clip_grad_value_):  # not rebound by someone else since
            setattr(module, name, previous)
        del _DISPLACED[(module, name)]


def _owners(params: list[torch.Tensor]) -> list[Any]:
    ids = {id(p) for p in params}
    return [opt for opt in list(_OWNERS) if any(id(p) in ids for p in opt.lowrank_params())]


def _dense_norm_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    """Squared L2 norm of ``grads`` (plain tensors and DTensors), global over shards, fp32."""
    total = torch.zeros((), dtype=torch.float32)
    plain = [g for g in grads if not hasattr(g, "full_tensor")]
    if plain:
        total = total + torch.nn.utils.get_total_norm(plain, 2.0).float().cpu() ** 2
    dtensors = [g for g in grads if hasattr(g, "full_tensor")]
    if dtensors:
        norm = torch.nn.utils.get_total_norm(dtensors, 2.0)
        total = total + norm.full_tensor().float().cpu() ** 2
    return total


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` that also covers LoGRA's sketches (see the module docstring).

    Calls whose params hold no LoGRA low-rank matrix go to torch unchanged.

    Raises:
        ValueError: ``norm_type`` other than 2 with LoGRA matrices (a sketch has the L2 norm of the
            projected gradient; other norms are not preserved by the projection).
        RuntimeError: ``error_if_nonfinite`` and the norm is NaN or inf (as torch).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = _owners(params)
    if not owners:
        return _TORCH_NORM(params, max_norm, norm_type, error_if_nonfinite, foreach)
    for opt in owners:
        if opt.step_state.prepared:  # the update was computed from this step's gradients already
            if opt.step_state.clip_norm is None:
                raise RuntimeError(
                    "clip_grad_norm_ after LoGRA prepared its update (prepare_update(), e.g. by a step-control "
                    "callback) would not change the step: clip before prepare_update(). KLStepControl does that "
                    "itself when Trainer(gradient_clip_val=...) is set"
                )
            return opt.step_state.clip_norm  # clipped before the update was prepared (KLStepControl): done
    if float(norm_type) != 2.0:
        raise ValueError(
            f"clip_grad_norm_(norm_type={norm_type!r}) with LoGRA low-rank params: only norm_type=2 is supported "
            "(LoGRA holds each matrix's gradient as a sketch, which keeps the L2 norm of the projected gradient)"
        )
    sketches: list[torch.Tensor] = []
    sharded: dict[Any, list[torch.Tensor]] = {}  # shard group -> right sketches holding this rank's rows
    keyed: list[tuple[Any, int]] = []
    for opt in owners:
        opt.complete_gradients()  # DDP replicas: the averaged sketches (and full gradients); FSDP2: whole left ones
        for p in params:
            s = opt.step_state.sketches.get(id(p))
            if s is None or not opt.sketches_in_backward(p):
                continue
            mat = opt.lowrank_matrix(p)
            if mat.shard is not None and mat.side == "right":
                sharded.setdefault(mat.shard.group, []).append(s)
            else:
                sketches.append(s)
            keyed.append((opt, id(p)))
    grads = [p.grad for p in params if p.grad is not None]
    sq = _dense_norm_sq(grads)
    for s in sketches:
        sq = sq + s.float().square().sum().cpu()
    for group, members in sharded.items():
        part = torch.stack([s.float().square().sum() for s in members]).sum()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(part, group=group)
        sq = sq + part.cpu()
    total = sq.sqrt()
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(
            f"The total norm of order 2.0 for gradients and LoGRA sketches is non-finite ({float(total)}), so "
            "it cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )
    coef = min(1.0, float(max_norm) / (float(total) + 1e-6))
    for g in grads:
        g.mul_(coef)
    for s in [*sketches, *(s for members in sharded.values() for s in members)]:
        s.mul_(coef)
    for opt, key in keyed:  # FSDP2 factored second moment: column sums of S*S, completed with the sketch
        if key in opt.step_state.col_sums:
            opt.step_state.col_sums[key].mul_(coef * coef)
    for opt in owners:
        opt.step_state.clip_norm = total
    return total


@torch.no_grad()
def clip_grad_value_(
    parameters: torch.Tensor | Iterable[torch.Tensor], clip_value: float, foreach: bool | None = None
) -> None:
    """``torch.nn.utils.clip_grad_value_``, refused for LoGRA matrices whose gradients were sketched away.

    Raises:
        ValueError: a param is a LoGRA low-rank matrix sketched in backward (names the fix).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for opt in _owners(params):
        if any(opt.sketches_in_backward(p) for p in params):
            raise ValueError(
                f"clip_grad_value_(clip_value={clip_value}) (Lightning: gradient_clip_algorithm='value') cannot "
                "clip LoGRA's low-rank matrices: their gradients are sketched and freed in backward, so no gradient "
                "element is left to clip. Use norm clipping (gradient_clip_algorithm='norm', the default, or "
                "optimizer.clip_grad_norm_), or LoGRA(sketch_in_backward=False) to keep full gradients"
            )
    return _TORCH_VALUE(params, clip_value, foreach)
