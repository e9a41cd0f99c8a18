"""What ``logra plan`` is asked: :class:`PlanSetup` (each field one ``logra plan`` flag), its errors, the rank rule.

Example::

    >>> PlanSetup(gpus=8, precision="bf16-mixed").compute_bytes
    2
    >>> PlanSetup(gpus=0)
    Traceback (most recent call last):
    ...
    logra_lightning.plan.setup.PlanError: gpus=0 must be an integer >= 1
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from logra_lightning.errors import ConfigError
from logra_lightning.models.shapes import Architecture
from logra_lightning.optim.groups import rank_limit

GiB = 1024**3
PRECISIONS = ("fp32", "bf16-mixed", "bf16-true")
ADAMW_IMPLS = ("foreach", "fused", "for-loop")
STATE_BYTES = {"bfloat16": 2, "float32": 4}  # LoGRA's basis_dtype / exp_avg_dtype
SECOND_MOMENTS = ("auto", "factored", "full")  # LoGRA's second_moment


class PlanError(ConfigError):
    """A planner input is missing or out of range; the message names the field and the value."""


# ------------------------------------------------------------------------------------------ setup
def _field(default: Any, help: str | None = None, *, choices: tuple[str, ...] | None = None, cli: bool = True) -> Any:
    """A :class:`PlanSetup` field; its metadata is what ``logra plan`` makes of it (one flag per field)."""
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


@dataclass(frozen=True)
class PlanSetup:
    """What is trained how. ``batch`` and ``rollout_batch`` are sequences per GPU.

    Each field is a ``logra plan`` flag (``seq_len`` -> ``--seq-len``) with the help text in its
    metadata (:mod:`logra_lightning.plan.cli`), except ``oversample``.

    Raises:
        PlanError: a field out of range (the message names it and the allowed values).
    """

    gpus: int = _field(1, "GPUs; FSDP2 shards over all of them")
    gpu_memory_gb: float = _field(80.0, "memory per GPU, GiB")
    rank: int = _field(256, "LoGRA rank (default 256, or the smallest matrix dim)")
    batch: int = _field(1, "sequences per GPU per micro-batch")
    seq_len: int = _field(2048, "tokens per sequence (prompt + completion)")
    micro_batch_tokens: int | None = _field(
        None,
        "tokens per micro-batch (the module's max_tokens_per_micro_batch, padding-free): whole sequences "
        "up to this many, at least one (default: batch x seq-len)",
    )
    lm_head_chunk: int = _field(
        512, "tokens per block through the LM head (the module's lm_head_chunk_size); 0: whole logits"
    )
    precision: str = _field("bf16-mixed", choices=PRECISIONS)
    activation_checkpointing: bool = _field(True)
    colocate_engine: bool = _field(False, "rollout engine on the training GPUs")
    engine_tp: int = _field(1, "tensor parallel size of the colocated engine")
    rollout_batch: int | None = _field(None, "sequences per GPU in the engine (default --batch)")
    oversample: int = _field(8, cli=False)  # LoGRA's range-sketch oversampling (its default); not a flag
    adamw_impl: str = _field("foreach", "AdamW step temporaries", choices=ADAMW_IMPLS)
    reserve_gb: float = _field(2.0, "CUDA context and NCCL buffers, GiB")
    allocator_slack: float = _field(
        0.0,
        "fraction the allocator holds on top of the live training tensors (cached free "
        "blocks, fragmentation); 0 = live bytes, as max_memory_allocated",
    )
    logra_second_moment: str = _field(
        "auto", "LoGRA's second_moment (auto: factored for embeddings and experts)", choices=SECOND_MOMENTS
    )
    logra_basis_dtype: str = _field("bfloat16", "LoGRA's basis_dtype", choices=tuple(STATE_BYTES))
    logra_exp_avg_dtype: str = _field("bfloat16", "LoGRA's exp_avg_dtype", choices=tuple(STATE_BYTES))

    def __post_init__(self) -> None:
        for key in ("gpus", "rank", "batch", "seq_len", "engine_tp"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{key}={value!r} must be an integer >= 1")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise PlanError(f"micro_batch_tokens={self.micro_batch_tokens!r} must be >= 1 (or None: batch x seq_len)")
        if isinstance(self.lm_head_chunk, bool) or not isinstance(self.lm_head_chunk, int) or self.lm_head_chunk < 0:
            raise PlanError(f"lm_head_chunk={self.lm_head_chunk!r} must be an integer >= 0 (0: whole logits)")
        if self.rollout_batch is not None and self.rollout_batch < 1:
            raise PlanError(f"rollout_batch={self.rollout_batch!r} must be >= 1 (or None: the training batch)")
        if self.oversample < 0:
            raise PlanError(f"oversample={self.oversample!r} must be >= 0")
        if not self.gpu_memory_gb > 0 or self.reserve_gb < 0:
            raise PlanError(f"gpu_memory_gb={self.gpu_memory_gb!r} must be > 0 and reserve_gb={self.reserve_gb!r} >= 0")
        if not 0 <= self.allocator_slack < 10:
            raise PlanError(f"allocator_slack={self.allocator_slack!r} must be a fraction in [0, 10) (0.1 = 10%)")
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.logra_second_moment not in SECOND_MOMENTS:
            allowed = ", ".join(SECOND_MOMENTS)
            raise PlanError(f"logra_second_moment={self.logra_second_moment!r} is not one of {allowed}")
        for key in ("logra_basis_dtype", "logra_exp_avg_dtype"):
            if getattr(self, key) not in STATE_BYTES:
                raise PlanError(f"{key}={getattr(self, key)!r} is not one of {', '.join(STATE_BYTES)}")
        if self.adamw_impl not in ADAMW_IMPLS:
            raise PlanError(f"adamw_impl={self.adamw_impl!r} is not one of {', '.join(ADAMW_IMPLS)}")
        if self.colocate_engine and self.gpus % self.engine_tp:
            raise PlanError(f"engine_tp={self.engine_tp} must divide gpus={self.gpus}")

    @property
    def param_bytes(self) -> int:
        return 2 if self.precision == "bf16-true" else 4

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch: ``batch`` sequences, or as many whole ones as ``micro_batch_tokens`` holds (>= 1)."""
        if self.micro_batch_tokens is None:
            return self.batch * self.seq_len
        return self.seq_len * max(1, min(self.batch, self.micro_batch_tokens // self.seq_len))

    @property
    def fsdp_buffers(self) -> bool:
        """FSDP2 all-gathers (N > 1) or casts (bf16-mixed) each unit into a separate buffer."""
        return self.gpus > 1 or self.compute_bytes != self.param_bytes


def check_rank(arch: Architecture, rank: int) -> None:
    """The optimizer's rule (:func:`~logra_lightning.optim.groups.rank_limit`): ``rank <= min(m, n)`` of every
    low-rank matrix."""
    bound = rank_limit((m.name, (m.rows, m.cols)) for m in arch.matrices())
    if bound is not None and rank > bound[2]:
        name, (rows, cols), limit = bound
        raise PlanError(
            f"rank={rank} is larger than min(m, n)={limit} of {name} with shape ({rows}, {cols}) "
            f"(allowed: 1 <= rank <= {limit})"
        )


def shard(rows: int, n: int) -> int:
    """Rows of a dim-0 shard on each of ``n`` ranks (FSDP2: ``ceil(rows / n)``)."""
    return math.ceil(rows / n)
