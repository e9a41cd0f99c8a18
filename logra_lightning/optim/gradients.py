"""The gradient side of :class:`~logra_lightning.optim.LoGRA`: what backward leaves in place of ``p.grad``.

A post-accumulate-grad hook on each low-rank param adds the gradient's sketch (and, on refresh
steps, its range sketch) to the step's and frees the gradient (LoGRA choice 5). The sketches live
in :class:`~logra_lightning.optim.step_state.StepState` like gradients: from the step's first
hook to ``prepare_update``, dropped by ``zero_grad``. Under FSDP2 a left sketch is a partial sum
over the row shards until :meth:`SketchedGradients._complete_sketches` adds it up
(:func:`~logra_lightning.optim.sharding.complete_sketches`), once per step. A full gradient kept
through backward (``sketch_in_backward=False``, or plain DDP's mode ``"grad"``) is sketched at the
start of ``prepare_update`` instead.

Example::

    >>> import torch
    >>> from logra_lightning.optim import LoGRA
    >>> model = torch.nn.Linear(16, 16, bias=False)
    >>> opt = LoGRA(list(model.named_parameters()), rank=4)
    >>> model(torch.randn(2, 16)).sum().backward()
    >>> model.weight.grad is None, [tuple(s.shape) for s in opt.gradient_sketches()]
    (True, [(16, 4)])
"""

from __future__ import annotations

import torch

from logra_lightning.optim import rounding
from logra_lightning.optim import sharding as sh


class SketchedGradients:
    """The backward hooks, ``zero_grad`` and sketch completion of LoGRA (one of its bases).

    Reads the optimizer's ``lowrank_params()``, ``lowrank_matrix(p)``, ``param_group(p)``,
    ``data_parallel_mode(p)``, ``state``, ``step_state``, ``sketch_in_backward``,
    ``release_host_memory`` and ``trimmer``; ``super()`` is ``torch.optim.Optimizer``.
    """

    def _accumulate(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Add one gradient's sketch (and range sketch on refresh steps) to this step's."""
        mat, group, step = self.lowrank_matrix(p), self.param_group(p), self.step_state
        step.sketches[id(p)] = mat.accumulate(self.state[p], grad, step.sketches.get(id(p)), group)
        step.touched.add(id(p))

    @torch.no_grad()
    @rounding.outside_autocast
    def _sketch_hook(self, p: torch.Tensor) -> None:
        if p.grad is None or self.data_parallel_mode(p) == "grad":
            return  # mode "grad": DDP averages this gradient after the hook; the step sketches it
        if self.step_state.reduced or id(p) in self.step_state.completed:
            raise RuntimeError(
                "LoGRA: a backward after this step's gradients were completed (by clip_grad_norm_ or "
                "prepare_update); call optimizer.step() or zero_grad() before the next backward"
            )
        nbytes = p.grad.numel() * p.grad.element_size()
        self._accumulate(p, p.grad)
        p.grad = None
        if self.release_host_memory and p.device.type == "cpu":
            self.trimmer.freed(nbytes)  # choice 10: freed gradients and activations leave the RSS

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop grads and the accumulated sketches, like grads (pending candidate updates are kept)."""
        super().zero_grad(set_to_none=set_to_none)
        if self.sketch_in_backward:
            for p in self.lowrank_params():
                self.state[p].pop("range", None)
        self.step_state.reset("gradients")

    def gradient_sketches(self) -> list[torch.Tensor]:
        """The accumulated gradient sketches of this step (what backward left in place of ``p.grad``)."""
        return list(self.step_state.sketches.values())

    def sketches_in_backward(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is sketched and freed in backward (no ``.grad`` left to clip elementwise)."""
        return self.lowrank_matrix(p) is not None and self.sketch_in_backward and self.data_parallel_mode(p) != "grad"

    def _sketch_full_grads(self) -> None:
        """Sketch the full gradients kept through backward (GaLore-style): all of them with
        ``sketch_in_backward=False``, those DDP averaged (mode ``"grad"``, LoGRA choice 12) otherwise."""
        step = self.step_state
        for p in self.lowrank_params():
            if self.sketch_in_backward and self.data_parallel_mode(p) != "grad":
                continue
            if id(p) in step.completed:
                continue
            step.touched.discard(id(p))
            if p.grad is not None:
                step.sketches.pop(id(p), None)
                self.state[p].pop("range", None)
                self._accumulate(p, p.grad)

    def _complete_sketches(self) -> tuple[set[int], dict[int, torch.Tensor]]:
        """Complete FSDP2's partial sketches and find non-finite ones, once per sketch and step."""
        step = self.step_state
        todo = [
            (id(p), step.sketches[id(p)], mat.shard, mat.side == "left", mat.sums_col_sq)
            for p, mat in ((p, self.lowrank_matrix(p)) for p in self.lowrank_params())
            if id(p) in step.touched and id(p) not in step.completed
        ]
        nonfinite, col_sums = sh.complete_sketches(todo)
        step.completed.update(key for key, *_ in todo)
        step.nonfinite |= nonfinite
        step.col_sums.update(col_sums)
        return step.nonfinite, step.col_sums
