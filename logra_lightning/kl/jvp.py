"""The logit change along an update as a forward-mode derivative: ``δz = J·Δ`` exactly, one pass, any precision.

The finite-difference probe (:func:`~logra_lightning.kl.estimates.finite_difference_epsilon`) takes
``(z(W + εΔ) - z(W)) / ε`` from two forward passes. The difference of two nearly equal logits needs
fp32: a whole step moves a logit by ~1e-2, below bf16's resolution at logits of ~10. A forward-mode
derivative carries ``δz`` as a tangent of its own, so nothing cancels and the pass can run in bf16
where the hardware is fast (its relative error is bf16's, ~1e-2 on ``δz``, and the predicted KL is
quadratic in it). It also needs no ``ε`` and so no pass over every weight to size one.

:func:`weight_tangents` gives each parameter its tangent only while its own module runs (a forward
pre-hook puts a dual tensor in the module's parameter slot, the forward hook puts the parameter
back), so the tangents of a model never exist at once: the extra memory is one module's ``Δ``.

Example::

    >>> import torch
    >>> import torch.autograd.forward_ad as fwAD
    >>> lin = torch.nn.Linear(3, 2)
    >>> delta = {lin.weight: torch.ones(2, 3)}
    >>> x = torch.tensor([[1.0, 2.0, 3.0]])
    >>> with torch.no_grad(), fwAD.dual_level(), weight_tangents(lin, delta.get):
    ...     dz = fwAD.unpack_dual(lin(x)).tangent
    >>> dz.tolist()  # d/dt of (W + t * ones) x = sum(x)
    [[6.0, 6.0]]
    >>> lin.weight is next(lin.parameters())  # the parameter is back in its slot
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.autograd.forward_ad as fwAD

# the parameter -> its tangent (the update Δ, shaped like the parameter) or None (it does not move)
Tangent = Callable[[torch.nn.Parameter], "torch.Tensor | None"]


@contextlib.contextmanager
def weight_tangents(model: torch.nn.Module, tangent: Tangent) -> Iterator[None]:
    """While open (inside ``fwAD.dual_level()``), every module's forward sees its parameters as duals.

    Each module's own parameters (``recurse=False``) that have a tangent are swapped for
    ``fwAD.make_dual(p, tangent(p))`` just before that module's forward and swapped back just after,
    so a parameter shared by two modules (tied embeddings) is dual in both. On exit every slot holds
    its parameter again, also after an exception. Code that reads a parameter outside its module's
    forward (``model.lm_head.weight`` in a custom head) sees the primal.
    """
    swapped: dict[int, tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]] = {}

    def before(mod: torch.nn.Module, args) -> None:
        saved = {}
        for name, p in list(mod._parameters.items()):
            t = tangent(p) if p is not None else None
            if t is not None:
                saved[name] = p
                mod._parameters[name] = fwAD.make_dual(p.detach(), t.to(p.dtype).view_as(p))
        if saved:
            swapped[id(mod)] = (mod, saved)

    def after(mod: torch.nn.Module, args, out) -> None:
        restore(*swapped.pop(id(mod), (mod, {})))

    def restore(mod: torch.nn.Module, saved: dict[str, torch.nn.Parameter]) -> None:
        for name, p in saved.items():
            mod._parameters[name] = p

    handles = []
    try:
        for mod in model.modules():
            if any(p is not None for p in mod._parameters.values()):
                handles.append(mod.register_forward_pre_hook(before))
                handles.append(mod.register_forward_hook(after))
        yield
    finally:
        for h in handles:
            h.remove()
        for mod, saved in swapped.values():
            restore(mod, saved)


@contextlib.contextmanager
def eager_attention(model: torch.nn.Module) -> Iterator[None]:
    """Hugging Face models attend with their ``eager`` implementation while open (their choice is read per forward).

    PyTorch's fused attention kernels (``sdpa`` on CPU) have no forward-mode derivative; eager attention is
    plain matmuls and a softmax.
    """
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    before = {i: c._attn_implementation for i, c in configs.items() if getattr(c, "_attn_implementation", None)}
    try:
        for i in before:
            configs[i]._attn_implementation = "eager"
        yield
    finally:
        for i, impl in before.items():
            configs[i]._attn_implementation = impl


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Every submodule in eval mode while open, each back in its own mode after.

    Hugging Face's activation checkpointing (on in training mode only) wraps layers in a checkpoint
    function, which has no forward-mode derivative; the probe is deterministic anyway (no dropout).
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for m, training in modes:
            m.training = training


def logits_and_tangent(
    run: Callable[[], torch.Tensor], model: torch.nn.Module, tangent: Tangent
) -> tuple[torch.Tensor, torch.Tensor]:
    """``run()``'s output ``z`` and its derivative ``δz`` along the parameters' tangents, both fp32.

    ``run`` calls ``model`` (under whatever autocast the caller set). Compiled submodules, fused attention
    and activation checkpointing are off here (:func:`eager_attention`, :func:`eval_mode`): forward-mode AD
    goes through plain PyTorch ops.
    """
    with torch.no_grad(), torch.compiler.set_stance("force_eager"), eager_attention(model), eval_mode(model):
        with fwAD.dual_level():
            with weight_tangents(model, tangent):
                out = run()
            primal, dz = fwAD.unpack_dual(out)
    if dz is None:  # no parameter with a tangent reached the output
        dz = torch.zeros_like(primal)
    return primal.float(), dz.float()
