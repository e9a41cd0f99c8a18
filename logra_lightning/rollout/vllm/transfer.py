"""LoGRA's sync as a vLLM weight-transfer backend: ``--weight-transfer-config '{"backend": "logra"}'``.

vLLM (0.16+) has a pluggable API for RL weight updates: a backend registered by name with
``WeightTransferEngineFactory`` is built in every worker when the engine's
``weight_transfer_config`` names it, and the trainer drives it through four calls that exist on
``LLM`` and as ``vllm serve`` routes (with ``VLLM_SERVER_DEV_MODE=1``):
``init_weight_transfer_engine`` -> ``start_weight_update`` -> ``update_weights`` (per chunk) ->
``finish_weight_update``. :class:`LowRankTransferEngine` is that backend for LoGRA's sync. The
``vllm.general_plugins`` entry point :func:`logra_lightning.rollout.vllm.plugin.register` (in
``pyproject.toml``) registers it in every vLLM process, including a separately started
``vllm serve``.

* **init** (``LowRankInitInfo``): maps checkpoint tensors to vLLM parameters and builds the
  shadow (:class:`~logra_lightning.rollout.vllm.worker.LowRankApplier`), then joins the trainer's
  broadcast group (:class:`~logra_lightning.sync.channel.Channel`: gloo on CPU, NCCL on GPU) and
  sends the trainer its report (what it could not place, the sync mode) through that group:
  vLLM's init call returns nothing.
* **update** (``LowRankUpdateInfo``, the header of :mod:`~logra_lightning.sync.frames`): receives
  the message's byte buffer by broadcast *first* (the trainer is already sending), then checks
  and applies it: full values, updates with their basis, or coefficients alone (each worker keeps
  every basis); fp32 or bf16 factors.
* **finish**: reloads the modules whose shadow changed and re-packs their dependents.
* **probe** (a ``LowRankUpdateInfo`` with ``probe`` set, in a session of its own): the first worker
  sends back sampled entries of its fp32 copy of the named weights
  (:meth:`~logra_lightning.rollout.vllm.worker.LowRankApplier.sample`), so the trainer can measure
  how far the engine's copy has drifted from its own weights.

The trainer side is :class:`~logra_lightning.rollout.vllm.sender.LowRankSender`. This module
imports vLLM: only vLLM's factory imports it, inside vLLM processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from logra_lightning.optim.host_memory import trim
from logra_lightning.rollout.vllm.worker import LowRankApplier
from logra_lightning.sync.channel import Channel
from logra_lightning.sync.frames import decode, encode


@dataclass
class LowRankInitInfo(WeightTransferInitInfo):
    """What ``init_weight_transfer_engine`` carries (a JSON dict on the wire).

    ``master_address``/``master_port``: the trainer's store; ``world_size``: trainer + workers;
    ``rank_offset``: the first worker's rank (the trainer is 0); ``backend``: ``"gloo"`` or
    ``"nccl"``; ``mode``: the sync mode; ``expected``: the trainer's ``[name, shape]`` pairs in
    checkpoint form (checked, reported back); ``timeout_s``: rendezvous and collective timeout.
    """

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    backend: str = "gloo"
    mode: str = "auto"
    expected: list | None = None
    timeout_s: float = 120.0


@dataclass
class LowRankUpdateInfo(WeightTransferUpdateInfo):
    """One message's header (:func:`~logra_lightning.sync.frames.encode`); its bytes come by broadcast.

    ``probe`` (``{"names", "count", "seed"}``) turns it into a request: nothing is applied, and the
    first worker broadcasts sampled entries of those weights back to the trainer.
    """

    format: str
    updates: list
    dense: list
    tensors: list
    nbytes: int
    probe: dict | None = None

    def header(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("format", "updates", "dense", "tensors", "nbytes")}


def _worker_rank(parallel_config) -> int:
    """This worker's rank among all workers of all data-parallel replicas (as vLLM's NCCL backend counts)."""
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


class LowRankTransferEngine(WeightTransferEngine[LowRankInitInfo, LowRankUpdateInfo]):
    """vLLM weight-transfer backend ``"logra"``: full values, low-rank updates and coefficient-only syncs.

    Built by vLLM in each worker (never by hand): ``LLM(..., weight_transfer_config={"backend": "logra"})``
    or ``vllm serve ... --weight-transfer-config '{"backend": "logra"}'``.
    """

    init_info_cls = LowRankInitInfo
    update_info_cls = LowRankUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.channel: Channel | None = None
        self.applier: LowRankApplier | None = None
        self.src = 1  # the first worker's rank in the channel: the one that answers

    def init_transfer_engine(self, init_info: LowRankInitInfo) -> None:
        """Build the applier, join the trainer's group, send it this worker's report (first worker only)."""
        self.shutdown()  # a new trainer, or the same one after a fault: start from a clean group
        applier = LowRankApplier(self.model, self.vllm_config, init_info.mode, init_info.expected)
        rank = _worker_rank(self.parallel_config) + init_info.rank_offset
        channel = Channel.connect(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.backend,
            init_info.timeout_s,
        ).join()
        device = self.device if init_info.backend == "nccl" else torch.device("cpu")
        self.src = init_info.rank_offset
        channel.broadcast_message({**applier.report, "worker_rank": rank}, src=self.src, device=device)
        self.channel, self.applier = channel, applier

    def _ready(self) -> tuple[Channel, LowRankApplier]:
        if self.channel is None or self.applier is None:
            raise RuntimeError(
                "the 'logra' weight transfer is not initialized: the trainer calls init_weight_transfer_engine first "
                "(after an engine restart too)"
            )
        return self.channel, self.applier

    def start_weight_update(self) -> None:
        self._ready()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one message and apply it, or answer a probe (the base class's accelerator sync is skipped on CPU
        workers)."""
        info = self.parse_update_info(update_info)
        if info.probe is not None:
            self._answer_probe(info.probe)
            return
        self.receive_weights(info)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: LowRankUpdateInfo) -> None:
        channel, applier = self._ready()
        device = self.device if channel.backend == "nccl" else torch.device("cpu")
        buffer = torch.empty(update_info.nbytes, dtype=torch.uint8, device=device)
        channel.broadcast(buffer, src=0)  # before any check: the trainer is sending it now
        updates, dense = decode(update_info.header(), buffer)
        applier.apply(updates, dense)

    def _answer_probe(self, probe: dict[str, Any]) -> None:
        """The first worker sends ``(name#index, name)`` pairs of sampled entries; every worker joins the broadcast."""
        channel, applier = self._ready()
        device = self.device if channel.backend == "nccl" else torch.device("cpu")
        if channel.rank != self.src:
            channel.broadcast_message(src=self.src, device=device)
            return
        samples = applier.sample(probe["names"], int(probe["count"]), int(probe["seed"]))
        pairs = [t for name, idx, values in samples for t in ((f"{name}#index", idx), (name, values))]
        header, buffer = encode((), pairs, device)
        channel.broadcast_message(header, buffer, src=self.src, device=device)

    def finish_weight_update(self) -> None:
        self._ready()[1].commit()
        if self.device.type == "cpu":  # the sync's buffers are freed: hand their pages back (engine.py choice 5)
            trim()

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.channel = None
