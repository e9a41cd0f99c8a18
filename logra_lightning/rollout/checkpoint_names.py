"""The trainer's parameter names and layouts -> the checkpoint's, for syncing into an engine.

transformers 5 converts some checkpoints while loading: a Qwen3-MoE layer's experts
(``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``, 2-D each) become two 3-D
parameters (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
``[E, H, I]``), and ``save_pretrained`` converts back. vLLM loads the checkpoint
layout, so a sync must speak it too.

:class:`CheckpointNames` asks transformers itself how (``revert_weight_conversion``,
what ``save_pretrained`` runs), once, on *probe* tensors: each trainer parameter
viewed as a matrix ``[rows, n]`` (leading dims flattened) is replaced by two columns of
its row numbers ``[..., 2]`` (the second + 0.5, to see a transpose). Whatever comes out says, for each
checkpoint tensor, which trainer rows it is made of, so a dense value is a row gather and a low-rank
update ``c*W + L@R`` is ``c*W_k + L[rows_k] @ R`` per checkpoint tensor ``k``.
Conversions that mix the last dimension (a transpose) or merge several trainer
parameters into one checkpoint tensor cannot be expressed that way and are refused
at construction, naming the parameter.

Example::

    >>> import torch
    >>> names = CheckpointNames(torch.nn.Linear(4, 3))  # no conversion: names pass through
    >>> names.shapes([("weight", (3, 4))])
    [('weight', (3, 4))]
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from logra_lightning.errors import ConfigError
from logra_lightning.sync.wire import LowRankUpdate


@dataclass(frozen=True)
class Piece:
    """Checkpoint tensor ``name`` of shape ``shape`` = rows ``rows`` of the trainer matrix ``[R, n]``."""

    name: str
    rows: torch.Tensor  # [k] long
    shape: tuple[int, ...]


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return (math.prod(shape[:-1]), shape[-1]) if len(shape) >= 2 else (1, shape[0] if shape else 1)


class CheckpointNames:
    """How each trainer parameter of ``model`` is laid out in its checkpoint (see the module notes).

    Args:
        model: the policy (an HF ``PreTrainedModel``; other modules have no conversion).

    Raises:
        ConfigError: a conversion this sync cannot express (names the parameter).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.pieces: dict[str, list[Piece]] = {}  # only parameters whose checkpoint form differs
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # older transformers: no conversions
            return
        if not hasattr(model, "config"):
            return
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # DTensor: the global shape
        offsets, probes, starts = 0, {}, []
        for name, shape in shapes.items():
            rows, _ = _matrix_shape(shape)
            starts.append((offsets, name))
            if len(shape) >= 2:
                col = torch.arange(offsets, offsets + rows, dtype=torch.float64)
                probes[name] = torch.stack([col, col + 0.5], dim=-1).reshape(*shape[:-1], 2)  # [..., 2]
            else:
                probes[name] = torch.full(shape, float(offsets), dtype=torch.float64)
            offsets += rows
        out = revert_weight_conversion(model, probes)
        keys = [s for s, _ in starts]
        for ck_name, probe in out.items():
            values = (probe[..., 0] if probe.ndim >= 2 else probe).reshape(-1).long()
            sources = {starts[bisect.bisect_right(keys, int(v)) - 1] for v in values.unique()}
            if len(sources) != 1:
                raise ConfigError(
                    f"checkpoint tensor {ck_name!r} is made of several trainer parameters "
                    f"({sorted(n for _, n in sources)}); low-rank sync cannot express that conversion"
                )
            ((start, src),) = sources
            shape = shapes[src]
            if len(shape) >= 2:
                if probe.shape[-1] != 2 or not torch.equal(
                    probe[..., 1] - probe[..., 0], torch.full_like(probe[..., 0], 0.5)
                ):
                    raise ConfigError(
                        f"trainer parameter {src!r} {shape} is stored transposed or reshaped in the checkpoint "
                        f"(as {ck_name!r}); low-rank sync cannot express that conversion"
                    )
                ck_shape = (*probe.shape[:-1], shape[-1])
                rows = values - start
                if ck_name == src and ck_shape == shape:
                    continue  # identity
                self.pieces.setdefault(src, []).append(Piece(ck_name, rows, ck_shape))
            elif ck_name != src:
                self.pieces.setdefault(src, []).append(Piece(ck_name, torch.zeros(1, dtype=torch.long), shape))

    @property
    def identity(self) -> bool:
        return not self.pieces

    def shapes(self, named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
        """Checkpoint ``(name, shape)`` of the given trainer ``(name, shape)`` pairs."""
        out = []
        for name, shape in named_shapes:
            pieces = self.pieces.get(name)
            out += [(p.name, p.shape) for p in pieces] if pieces else [(name, tuple(shape))]
        return out

    def dense(self, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A trainer parameter's value as checkpoint tensors."""
        pieces = self.pieces.get(name)
        if not pieces:
            return [(name, value)]
        if value.ndim < 2:
            return [(p.name, value) for p in pieces]
        flat = value.reshape(-1, value.shape[-1])  # [R, n]
        return [(p.name, flat[p.rows.to(flat.device)].reshape(p.shape)) for p in pieces]

    def update(self, u: LowRankUpdate) -> list[LowRankUpdate]:
        """A low-rank update of a trainer matrix (``left`` ``[R, r]``) as updates of checkpoint tensors."""
        pieces = self.pieces.get(u.name)
        if not pieces:
            return [u]
        out = []
        for p in pieces:
            if len(p.shape) != 2:
                raise ConfigError(f"checkpoint tensor {p.name!r} of shape {p.shape} is not a matrix")
            left = None if u.left is None else u.left[p.rows.to(u.left.device)]
            # a right basis is shared by every piece (kept once by the engine); a left one is cut per piece
            key = u.basis_key if u.basis == "right" else p.name
            out.append(dataclasses.replace(u, name=p.name, left=left, key=key))
        return out
