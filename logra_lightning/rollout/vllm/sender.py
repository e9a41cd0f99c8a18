"""Trainer side of LoGRA's vLLM weight-transfer backend: drives the four calls and broadcasts the bytes.

:class:`LowRankSender` talks to the engine through a *client* with vLLM's control-plane methods
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``; vLLM's ``VLLMWeightSyncClient`` protocol): :class:`LLMClient` for an
in-process ``vllm.LLM``, :class:`~logra_lightning.rollout.vllm.client.ServerClient` for a
``vllm serve`` process. The tensors go through a :class:`~logra_lightning.sync.channel.Channel`
the sender hosts (rank 0); the workers block inside ``init``/``update_weights`` until the matching
rendezvous/broadcast, so each control call runs on a side thread while this thread does its half
(:func:`together`). The worker side is :mod:`~logra_lightning.rollout.vllm.transfer`.

Example::

    >>> # llm = vllm.LLM(model=path, weight_transfer_config={"backend": "logra"}, ...)
    >>> # sender = LowRankSender(LLMClient(llm), workers=1)
    >>> # report = sender.init(expected=[("model.embed_tokens.weight", (100, 64))])
    >>> # sender.send([(update, None), (None, ("model.norm.weight", value))], version="3")
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from logra_lightning.rollout.checkpoint_names import CheckpointNames
from logra_lightning.sync.channel import Channel
from logra_lightning.sync.frames import FORMAT, Item, chunks, decode, encode


def describe_unplaced(report: dict) -> str:
    """``N of the policy's parameters (name shape, ...)`` that an engine's init report says it could not place."""
    unplaced = report.get("unplaced") or []
    shown = ", ".join(f"{n} {tuple(s)}" for n, s in unplaced[:5])
    return f"{len(unplaced)} of the policy's parameters ({shown}{', ...' if len(unplaced) > 5 else ''})"


class LLMClient:
    """vLLM's weight-sync client protocol over an in-process ``vllm.LLM`` (its ``RLOfflineMixin`` methods)."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


class _Call(threading.Thread):
    """A daemon thread that keeps ``fn``'s result or exception (a stuck peer must not block interpreter exit)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e


LOCAL_GRACE_S = 5.0  # together(): how long a finished broadcast may take to be seen after the engine failed


class TransferError(RuntimeError):
    """A failed transfer call; ``channel_ok`` says whether this side's collective completed (the group is usable)."""

    def __init__(self, message: str, channel_ok: bool) -> None:
        super().__init__(message)
        self.channel_ok = channel_ok


def together(remote: Callable[[], Any], local: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``remote`` (a control call that blocks in the engine) and ``local`` (this side's collective) at once.

    Returns ``remote``'s result. Raises as soon as either fails (the other may be left blocked)
    or after ``timeout_s``: a :class:`TransferError` naming the error, whose ``channel_ok`` is true
    only when ``local`` had completed (a refused update, not a broken group).
    """
    remote_call, local_call = _Call(remote), _Call(local)
    remote_call.start()
    local_call.start()
    deadline = time.monotonic() + timeout_s
    while remote_call.is_alive() or local_call.is_alive():
        if remote_call.error is not None or local_call.error is not None:
            break
        if time.monotonic() > deadline:
            raise TransferError(f"the weight transfer did not complete within {timeout_s:.0f} s", False)
        (remote_call if remote_call.is_alive() else local_call).join(0.005)
    if remote_call.error is not None and local_call.is_alive():
        # An engine that refuses after receiving has let the broadcast finish: give this side's thread the
        # moment it needs to see that (under load it may not have run yet), so a refused update is not
        # taken for a broken group. One that failed before receiving leaves it blocked: not ok.
        local_call.join(min(LOCAL_GRACE_S, max(0.0, deadline - time.monotonic())))
    local_ok = not local_call.is_alive() and local_call.error is None
    for c in (remote_call, local_call):
        if c.error is not None:
            raise TransferError(f"{type(c.error).__name__}: {c.error}", local_ok) from c.error
    return remote_call.result


class LowRankSender:
    """Sends syncs to the ``"logra"`` backend of one vLLM engine (see the module notes).

    Args:
        client: the engine's control plane (:class:`LLMClient`, or the server's HTTP client).
        workers: how many vLLM workers receive (tensor x pipeline x data parallel size).
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (GPU tensors, this process's current device).
        address: where the workers reach this process (an address of this host).
        port: the store's port; 0: any free one.
        chunk_bytes: largest message (tensor bytes) per ``update_weights`` call.
        timeout_s: how long one rendezvous or one message may take.

    Raises:
        ValueError: an unknown backend, or ``"nccl"`` without a GPU.
    """

    def __init__(
        self,
        client,
        workers: int = 1,
        backend: str = "gloo",
        address: str = "127.0.0.1",
        port: int = 0,
        chunk_bytes: int = 256 << 20,
        timeout_s: float = 120.0,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"Invalid backend: {backend!r} (allowed: 'gloo', 'nccl')")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError(
                "transfer_backend='nccl' sends GPU tensors, but this process has no GPU: set "
                "model.engine.init_args.transfer_backend to 'gloo' (or 'auto')"
            )
        self.client, self.workers, self.backend = client, workers, backend
        self.address, self.port, self.chunk_bytes, self.timeout_s = address, port, chunk_bytes, timeout_s
        self.channel: Channel | None = None
        self.report: dict = {}

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def init(self, mode: str = "auto", expected: list[tuple[str, tuple[int, ...]]] | None = None) -> dict:
        """(Re)initialize the transfer: a new group with the workers; returns the first worker's report.

        The report (:class:`~logra_lightning.rollout.vllm.worker.LowRankApplier`'s) names under
        ``"unplaced"`` the ``expected`` tensors vLLM would not load.
        """
        self.close()
        channel = Channel.host(self.workers + 1, self.address, self.port, self.backend, self.timeout_s)
        info = {
            "master_address": self.address,
            "master_port": channel.port,
            "world_size": self.workers + 1,
            "rank_offset": 1,
            "backend": self.backend,
            "mode": mode,
            "expected": [[n, list(s)] for n, s in expected] if expected is not None else None,
            "timeout_s": self.timeout_s,
        }

        def receive_report() -> dict:
            return channel.join().broadcast_message(src=1, device=self.device)[0]

        box: dict = {}
        try:
            together(
                lambda: self.client.init_weight_transfer_engine(info),
                lambda: box.setdefault("report", receive_report()),
                self.timeout_s + 600,  # the workers map the checkpoint and build the shadow before they join
            )
        except BaseException:
            channel.close()
            raise
        self.channel, self.report = channel, box["report"]
        return self.report

    def send(self, items: Iterable[Item], version: str | None = None) -> int:
        """One weight update (``start`` -> one ``update_weights`` per chunk -> ``finish``); returns the bytes sent.

        ``items``: ``(LowRankUpdate, None)`` or ``(None, (name, value))``, checkpoint names, in the
        order to apply. ``version`` becomes the engine's weight version (reported with each sample).

        Raises:
            RuntimeError: the transfer is not initialized.
            TransferError: the engine refused or failed the update (its message). Unless
                ``channel_ok``, the channel is closed and :meth:`init` must run again.
        """
        sent = 0
        with self._session("send", version) as channel:
            for ups, dense in chunks(items, self.chunk_bytes):
                header, buffer = encode(ups, dense, self.device)
                together(
                    lambda header=header: self.client.update_weights(header),
                    lambda buffer=buffer: channel.broadcast(buffer, src=0),
                    self.timeout_s,
                )
                sent += header["nbytes"]
        return sent

    def probe(self, names: list[str], count: int = 256, seed: int = 0) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Sampled entries of the engine's fp32 copy of the named weights (checkpoint names), in a session of its own.

        Returns ``(name, flat indices, fp32 values)`` per weight the first worker holds in fp32
        (:meth:`~logra_lightning.rollout.vllm.worker.LowRankApplier.sample`); nothing is applied and the
        engine's weight version does not change.

        Raises:
            RuntimeError: the transfer is not initialized.
            TransferError: the engine failed the request; the channel is closed unless ``channel_ok``.
        """
        request = {"format": FORMAT, "updates": [], "dense": [], "tensors": [], "nbytes": 0}
        request["probe"] = {"names": list(names), "count": int(count), "seed": int(seed)}
        box: dict = {}
        with self._session("probe") as channel:
            together(
                lambda: self.client.update_weights(request),
                lambda: box.setdefault("reply", channel.broadcast_message(src=1, device=self.device)),
                self.timeout_s,
            )
        _, pairs = decode(*box["reply"])
        values = dict(pairs)
        return [(n, values[f"{n}#index"], values[n]) for n, _ in pairs if not n.endswith("#index")]

    @contextmanager
    def _session(self, what: str, version: str | None = None) -> Iterator[Channel]:
        """``start_weight_update`` -> the body -> ``finish_weight_update(version)``; a failure closes the channel
        unless this side's collective completed (``TransferError.channel_ok``)."""
        if self.channel is None:
            raise RuntimeError(f"LowRankSender.{what} before init() (or after a failed sync: init() again)")
        try:
            self.client.start_weight_update()
            yield self.channel
            self.client.finish_weight_update(version)
        except TransferError as e:
            if not e.channel_ok:
                self.close()
            raise
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.channel = None


class ReadsBackWeights:
    """Gives an engine that syncs through ``self.sender`` (a :class:`LowRankSender`), converting names with
    ``self.names`` (:class:`~logra_lightning.rollout.checkpoint_names.CheckpointNames`), its ``weight_drift``."""

    sender: LowRankSender
    names: CheckpointNames

    def weight_drift(self, named: Iterable[tuple[str, torch.Tensor]], count: int = 256, seed: int = 0) -> dict:
        """How far the engine's copy of the weights is from ``named`` (HF names, the trainer's current values).

        Returns ``max_abs``: the largest ``|engine - trainer|`` over ``count`` entries drawn from each weight of
        the engine's fp32 copy (:meth:`LowRankSender.probe`; NaN if either side holds one), and how many
        ``entries`` and ``weights`` were compared; weights the engine keeps in no fp32 copy are not compared.
        """
        mine = {n: t for name, value in named for n, t in self.names.dense(name, value)}  # checkpoint names
        diffs = [
            values - mine[name].detach().reshape(-1)[idx.to(mine[name].device)].float().cpu()
            for name, idx, values in self.sender.probe(list(mine), count, seed)
        ]
        flat = torch.cat(diffs) if diffs else torch.zeros(0)
        return {
            "max_abs": float(flat.abs().max()) if flat.numel() else 0.0,
            "entries": float(flat.numel()),
            "weights": float(len(diffs)),
        }
