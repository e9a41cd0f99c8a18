"""Rollouts from a separate ``vllm serve`` process, kept in step through vLLM's weight-transfer API.

:class:`VLLMServerEngine` is a :class:`~logra_lightning.rollout.base.RolloutEngine` whose vLLM runs
in its own server (other GPUs, another node): start it with ``logra serve --model <model>``
(:mod:`logra_lightning.cli.serve`; docs/server_engine.md), point a config's engine at it::

    engine:
      class_path: logra_lightning.rollout.VLLMServerEngineSpec
      init_args: {url: "http://127.0.0.1:8000"}

and the rest of the run is unchanged: the same :class:`~logra_lightning.rollout.base.Rollout`
(prompt token ids in; completion token ids and the sampling logprob of each token out, from
``/inference/v1/generate``), and :class:`~logra_lightning.callbacks.LowRankWeightSync` sends its
full, low-rank and coefficient-only syncs the same way. Each sync is LoGRA's backend of vLLM's
weight-transfer API (:mod:`~logra_lightning.rollout.vllm.transfer`): control through the server's
routes, tensors by a gloo/NCCL broadcast, generation paused (``/pause?mode=wait``: running
requests finish on the old weights; caches cleared) and resumed around each update. Every sync
gets a weight version (``<session>:<n>``) that the server reports with each sampled token, so a
rollout knows which policy produced it (:attr:`Rollout.policy_version`; :meth:`policy_lag`).

Faults:

1. Nothing answers at ``url`` when the engine is built (within ``connect_timeout_s``): one
   :class:`~logra_lightning.rollout.vllm.client.ServerUnreachable` naming the URL and how to start a
   server. A server without the routes or the backend this needs: one error naming the flag.
2. The server stops answering, or comes back as a new process, mid-run (a failed rollout or
   sync, or a rollout whose tokens carry another weight version): the engine waits for it
   (``restart_timeout_s``, then an error naming the URL), re-initializes the transfer, sends the
   trainer's current weights (a full sync) and repeats the failed rollout; a failed low-rank sync
   is not resent, since the full sync already holds that step (no step lost or applied twice).
   :attr:`sync_epoch` changes, so the weight-sync callback resends bases; :attr:`recoveries` counts.
3. A refused update (a name or shape the server cannot place, a basis it does not hold) is an
   error, as for the in-process engine.

One training process per server: the engine refuses to start under a multi-process strategy.
Tests: ``tests/test_vllm_server.py``.

Example::

    >>> spec = VLLMServerEngineSpec(url="http://127.0.0.1:8000", restart_timeout_s=300)
    >>> spec.url
    'http://127.0.0.1:8000'
    >>> # engine = spec.build(model_path, policy, tokenizer)   # connects; then engine.generate(...)
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch

from logra_lightning.rollout.base import EngineSpec, LowRankUpdate, Rollout, SamplingConfig
from logra_lightning.rollout.checkpoint_names import CheckpointNames
from logra_lightning.rollout.vllm.client import ServerClient, ServerError, ServerUnreachable
from logra_lightning.rollout.vllm.options import VLLMServerOptions
from logra_lightning.rollout.vllm.plugin import BACKEND
from logra_lightning.rollout.vllm.sender import LowRankSender, ReadsBackWeights, TransferError, describe_unplaced
from logra_lightning.sync.channel import local_address

GENERATE_ROUTE = "/inference/v1/generate"


class StaleWeights(RuntimeError):
    """Tokens came from another weight version than the last one synced (the server lost our weights)."""


@dataclass
class PendingRollout:
    """A rollout submitted to the server (:meth:`VLLMServerEngine.submit`); :meth:`VLLMServerEngine.wait` ends it."""

    prompt_ids: list[list[int]]
    n: int
    sampling: SamplingConfig
    version: str
    epoch: int
    future: Future


class VLLMServerEngine(ReadsBackWeights):
    """Sample from a ``vllm serve`` process; keep it in step with full, low-rank and coefficient-only syncs.

    Args:
        tokenizer: the policy's tokenizer (EOS, decoding).
        policy: the trainer's model: its names are checked against what the server loads, and a
            recovery (fault 2) sends its current weights.
        model_path: the policy's directory; when the server serves the same path and no one has
            synced it, the first full sync is skipped.
        options: the engine's options (:class:`~logra_lightning.rollout.vllm.options.VLLMServerOptions`:
            ``url``, timeouts, transfer backend, ...); ``None``: the defaults.
        **overrides: options by name, over ``options`` (``VLLMServerEngine(tok, policy, url="http://host:8000")``).

    Raises:
        ServerUnreachable: no server at ``url`` within ``connect_timeout_s``.
        RuntimeError: the server lacks what this engine needs (named), the policy has parameters it
            would not load, or more than one training process shares it.
    """

    shares_weights = False
    caches_bases = True

    def __init__(
        self,
        tokenizer,
        policy: torch.nn.Module | None = None,
        *,
        model_path: str | None = None,
        options: VLLMServerOptions | None = None,
        **overrides: Any,
    ) -> None:
        opts = options or VLLMServerOptions()
        if overrides:
            opts = dataclasses.replace(opts, **overrides)  # validated again, with the overrides
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if torch.distributed.get_world_size() > 1:
                raise RuntimeError(
                    f"VLLMServerEngine serves one training process, but this run has "
                    f"{torch.distributed.get_world_size()}: use one process (devices=1) with the server engine"
                )
        self.url, self.tokenizer, self.policy = opts.url.rstrip("/"), tokenizer, policy
        self.restart_timeout_s = opts.restart_timeout_s
        self.client = ServerClient(self.url, opts.request_timeout_s)
        self.client.wait_until_up(opts.connect_timeout_s)
        config = self._check_server()
        self.max_model_len = config.get("max_model_len")
        self.names = CheckpointNames(policy) if policy is not None else CheckpointNames(torch.nn.Module())
        self.expected = (
            self.names.shapes((n, tuple(p.shape)) for n, p in policy.named_parameters()) if policy is not None else None
        )
        backend = opts.transfer_backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        host = urlparse(self.url).hostname or "127.0.0.1"
        self.sender = LowRankSender(
            self.client,
            workers=self.client.world_size(),
            backend=backend,
            address=opts.transfer_address or local_address(host),
            port=opts.transfer_port,
            chunk_bytes=int(opts.chunk_mb * (1 << 20)),
            timeout_s=opts.request_timeout_s,
        )
        self.sync_mode = opts.sync_mode
        self.session = secrets.token_hex(3)
        self.syncs = 0  # committed syncs: the server's weight version is f"{session}:{syncs}"
        self.sync_epoch = 0  # changes when the server lost what we sent (a restart): bases must be resent
        self.recoveries = 0
        self.last_sync: dict[str, float] = {}
        self._lock = threading.RLock()
        self._runner = ThreadPoolExecutor(1, thread_name_prefix="logra-rollout")
        self._requests = ThreadPoolExecutor(opts.max_concurrency, thread_name_prefix="logra-request")
        self.init_info = self._init_transfer()
        served = str(config.get("model", ""))
        if policy is not None and not (self.client.weight_version() == "default" and served == str(model_path)):
            self.load_weights(policy.named_parameters())  # the server may hold another run's weights
        else:  # the server holds the checkpoint the policy was loaded from: nothing to send
            self._mark_version()

    # ------------------------------------------------------------------ setup
    def _check_server(self) -> dict:
        """The server's model config; an error naming the fix when it lacks what this engine needs."""
        try:
            info = self.client.request("GET", "/server_info", params={"config_format": "json"}, timeout_s=120)
        except ServerError as e:
            raise RuntimeError(
                f"the vLLM server at {self.url} has no RL routes ({e}): start it with VLLM_SERVER_DEV_MODE=1 "
                "(`logra serve` sets it)"
            ) from None
        config = info.get("vllm_config", {}) if isinstance(info, dict) else {}
        model = config.get("model_config") or {}
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        fixes = []
        if backend != BACKEND:
            fixes.append(f'--weight-transfer-config \'{{"backend": "{BACKEND}"}}\' (it has {backend!r})')
        if model.get("logprobs_mode") != "processed_logprobs":
            fixes.append(f"--logprobs-mode processed_logprobs (it has {model.get('logprobs_mode')!r})")
        paths = self.client.request("GET", "/openapi.json", timeout_s=60).get("paths", {})
        if GENERATE_ROUTE not in paths:
            fixes.append(f"--enable-scale-out (for {GENERATE_ROUTE})")
        if fixes:
            raise RuntimeError(
                f"the vLLM server at {self.url} was started without what LoGRA's engine needs; restart it with "
                + ", ".join(fixes)
                + " (`logra serve` adds them all)"
            )
        return {"model": model.get("model"), "max_model_len": model.get("max_model_len")}

    def _init_transfer(self) -> dict:
        report = self.sender.init(self.sync_mode, self.expected)
        if report.get("unplaced"):
            raise RuntimeError(
                f"the vLLM server at {self.url} ({report.get('model_class')}) does not load "
                f"{describe_unplaced(report)}: is it serving the policy's model?"
            )
        return report

    def _version(self, syncs: int | None = None) -> str:
        return f"{self.session}:{self.syncs if syncs is None else syncs}"

    def _mark_version(self) -> None:
        self.client.request("POST", "/update_weight_version", json={"new_version": self._version()})

    # ------------------------------------------------------------------ rollouts
    def submit(self, prompt_ids: list[list[int]], n: int, sampling: SamplingConfig) -> PendingRollout:
        """Start a rollout on the server and return at once (it runs while the trainer trains); :meth:`wait` ends it."""
        prompts = [list(p) for p in prompt_ids]
        version = self._version()
        future = self._runner.submit(self._rollout, prompts, n, sampling, version)
        return PendingRollout(prompts, n, sampling, version, self.sync_epoch, future)

    def wait(self, pending: PendingRollout) -> Rollout:
        """The submitted rollout; after a server fault, recover (fault 2) and generate it again."""
        for attempt in range(3):
            try:
                return pending.future.result()
            except (ServerUnreachable, ServerError, StaleWeights) as e:
                if attempt == 2 or (isinstance(e, ServerError) and e.status < 500 and self.client.healthy()):
                    raise
                if pending.epoch == self.sync_epoch:  # not yet recovered since it was submitted (a sync may have)
                    self.recover(e)
                pending = self.submit(pending.prompt_ids, pending.n, pending.sampling)
        raise AssertionError("unreachable")

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingConfig) -> Rollout:
        return self.wait(self.submit(prompt_ids, n, sampling))

    def policy_lag(self, rollout: Rollout) -> int | None:
        """Syncs since the weights that produced ``rollout`` (0: on-policy); ``None`` if unknown."""
        session, _, count = (rollout.policy_version or "").partition(":")
        return self.syncs - int(count) if session == self.session and count.isdigit() else None

    def _rollout(self, prompt_ids: list[list[int]], n: int, sampling: SamplingConfig, version: str) -> Rollout:
        tok = self.tokenizer
        greedy = sampling.temperature <= 0
        per_request, copies = (1, n) if greedy else (n, 1)  # vLLM refuses n > 1 for greedy sampling
        calls = []
        for i, p in enumerate(prompt_ids):
            for _ in range(copies):
                params = {
                    "n": per_request,
                    "temperature": 0.0 if greedy else sampling.temperature,
                    "top_p": 1.0 if greedy else sampling.top_p,
                    "max_tokens": sampling.max_new_tokens,
                    "seed": None if sampling.seed is None else sampling.seed + i * n,  # children use seed + j
                    "logprobs": 0,
                    "stop_token_ids": [tok.eos_token_id],
                    "detokenize": False,
                    **sampling.extra,
                }
                calls.append(self._requests.submit(self.client.generate, p, params))
        completions, logprobs, texts, finished, versions = [], [], [], [], set()
        for call in calls:
            for c in sorted(call.result()["choices"], key=lambda c: c["index"]):
                ids = list(c["token_ids"])
                lps = [float(e["logprob"]) for e in (c.get("logprobs") or {}).get("content", [])]
                if len(lps) != len(ids):
                    raise ServerError(f"{self.url}: {len(lps)} logprobs for {len(ids)} tokens", 500)
                versions.update(v["version"] for v in c.get("weight_versions") or ())
                completions.append(ids)
                logprobs.append(lps)
                texts.append(tok.decode(ids, skip_special_tokens=True))
                finished.append(bool(ids) and ids[-1] == tok.eos_token_id)
        ours = sorted(int(c) for s, _, c in (v.partition(":") for v in versions) if s == self.session and c.isdigit())
        if len(ours) != len(versions):
            raise StaleWeights(
                f"the vLLM server at {self.url} sampled with weight version(s) {sorted(versions)}, none of which this "
                f"trainer sent (last: {version}): it restarted, or another client changed its weights"
            )
        # Requests that reached the server after a later sync ran on those newer weights: the oldest version counts.
        oldest = f"{self.session}:{ours[0]}" if ours else version
        return Rollout(
            [list(p) for p in prompt_ids], completions, logprobs, texts, finished, n=n, policy_version=oldest
        )

    # ------------------------------------------------------------- weight updates
    def load_weights(self, named_tensors) -> None:
        """A full sync: these values (HF names) replace the server's."""
        items = [(None, d) for name, value in named_tensors for d in self.names.dense(name, value)]
        self._sync(items, full=True)

    def apply_lowrank_updates(self, updates: list[LowRankUpdate], dense=()) -> None:
        """``W <- c*W + L@R`` per update, then the ``dense`` values (a coefficient alone needs the basis held)."""
        items = [(v, None) for u in updates for v in self.names.update(u)]
        items += [(None, d) for name, value in dense for d in self.names.dense(name, value)]
        self._sync(items, full=False)

    def _sync(self, items: list, full: bool) -> None:
        t0 = time.perf_counter()
        with self._lock:
            try:
                sent = self._send(items)
            except TransferError as e:
                if e.channel_ok and self.client.healthy():
                    raise RuntimeError(f"the vLLM server at {self.url} refused the update: {e}") from e
                self.recover(e)  # the full sync it sends holds this update: not sent again
                return
            except (ServerUnreachable, ServerError, RuntimeError) as e:
                if isinstance(e, ServerError) and e.status < 500 and self.client.healthy():
                    raise
                self.recover(e)
                return
        self.last_sync = {"bytes": float(sent), "seconds": time.perf_counter() - t0, "full": float(full)}

    def _send(self, items: list) -> int:
        """Pause (running rollouts finish on the old weights), update, resume."""
        if self.sender.channel is None:
            raise RuntimeError("the weight transfer is not initialized (a previous sync failed)")
        self.client.pause("wait")
        try:
            sent = self.sender.send(items, version=self._version(self.syncs + 1))
            self.syncs += 1
        finally:
            try:
                self.client.resume()
            except (ServerUnreachable, ServerError):
                pass  # a dead server: the caller recovers
        return sent

    def recover(self, cause: BaseException | None = None) -> None:
        """Wait for the server, re-initialize the transfer and send the policy's current weights (fault 2).

        Raises:
            ServerUnreachable: the server did not come back within ``restart_timeout_s``.
            RuntimeError: no policy to resend (the engine was built without one).
        """
        with self._lock:
            if self.policy is None:
                raise RuntimeError(f"the vLLM server at {self.url} failed ({cause}) and no policy is known to resend")
            t0 = time.perf_counter()
            self.sender.close()
            self.recoveries += 1
            self.sync_epoch += 1
            try:
                self.client.wait_until_up(self.restart_timeout_s)
            except ServerUnreachable as e:
                raise ServerUnreachable(
                    f"{e} It stopped answering mid-run ({type(cause).__name__}: {cause}); waited restart_timeout_s="
                    f"{self.restart_timeout_s:.0f} s (model.engine.init_args.restart_timeout_s)."
                ) from cause
            self.init_info = self._init_transfer()
            items = [
                (None, d) for name, p in self.policy.named_parameters() for d in self.names.dense(name, p.detach())
            ]
            sent = self._send(items)
            self.last_sync = {"bytes": float(sent), "seconds": time.perf_counter() - t0, "full": 1.0}
            warnings.warn(
                f"the vLLM server at {self.url} failed ({type(cause).__name__}: {cause}); recovered after "
                f"{time.perf_counter() - t0:.1f} s with a full sync (recovery {self.recoveries})",
                stacklevel=2,
            )

    def close(self) -> None:
        self._runner.shutdown(wait=True, cancel_futures=True)
        self._requests.shutdown(wait=False, cancel_futures=True)
        self.sender.close()


class VLLMServerEngineSpec(VLLMServerOptions, EngineSpec):
    """Build a :class:`VLLMServerEngine` from plain options (a config's ``engine:`` entry).

    Args: the fields of :class:`~logra_lightning.rollout.vllm.options.VLLMServerOptions` (``url``,
    ``restart_timeout_s``, ...), the keys of the config's ``init_args``.

    Raises:
        ValueError: an option out of range, at construction (before training starts).

    Example::

        >>> spec = VLLMServerEngineSpec(url="http://127.0.0.1:8000")
        >>> spec.options["max_model_len"] is None  # the server's own is read when the engine connects
        True
        >>> # In a config: engine: {class_path: logra_lightning.rollout.VLLMServerEngineSpec, init_args: {url: ...}}
    """

    def build(self, model_path: str, policy, tokenizer) -> VLLMServerEngine:
        return VLLMServerEngine(tokenizer, policy, model_path=model_path, options=self)
