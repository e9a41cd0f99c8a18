"""The tensor path of a weight sync: a broadcast group of the trainer (rank 0) and the engine's workers.

A plain torch process group (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on GPU) built from
its own ``TCPStore``, outside ``torch.distributed``'s default group, so it lives beside whatever
group the trainer's strategy (DDP, FSDP2) has, and can be rebuilt when the engine restarts. The
trainer hosts the store (:meth:`Channel.host`, port 0 = any free port) and tells the workers its
address and port through vLLM's ``init_weight_transfer_engine``; each worker joins with
:meth:`Channel.connect`. Both sides then call :meth:`Channel.join` (it returns once every rank is
in) and :meth:`Channel.broadcast`. The byte layout of what goes through it is
:mod:`~logra_lightning.sync.frames`.

Example (two processes; the second runs ``Channel.connect("10.0.0.1", port, rank=1, world_size=2)``)::

    >>> ch = Channel.host(world_size=2, bind="10.0.0.1")           # doctest: +SKIP
    >>> ch.join(); ch.broadcast(torch.arange(4, dtype=torch.uint8))  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import json
import socket

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


def local_address(peer: str) -> str:
    """This host's address on the route to ``peer`` (no packet is sent): what a remote rank can reach us at."""
    if peer in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((peer, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


class Channel:
    """A broadcast group of ``world_size`` ranks over a private store (see the module notes).

    Use :meth:`host` (rank 0, the trainer) or :meth:`connect` (a worker); then :meth:`join`.

    Args:
        store: the rendezvous store (the trainer's ``TCPStore``, or a client of it).
        address: this rank's own address (gloo binds its sockets there).
        rank, world_size: this rank and the group's size.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors, this process's current device).
        timeout_s: how long a rendezvous or a collective may wait for the other ranks.
    """

    def __init__(
        self, store, address: str, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 120.0
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"Invalid backend: {backend!r} (allowed: {', '.join(map(repr, BACKENDS))})")
        self.store, self.address, self.rank, self.world_size = store, address, rank, world_size
        self.backend, self.timeout = backend, datetime.timedelta(seconds=timeout_s)
        self.group = None

    @classmethod
    def host(
        cls, world_size: int, bind: str = "127.0.0.1", port: int = 0, backend: str = "gloo", timeout_s: float = 120.0
    ) -> Channel:
        """Rank 0: start the store on ``port`` (0: any free one, see :attr:`port`); returns before anyone joins."""
        store = dist.TCPStore(
            "0.0.0.0" if bind not in ("127.0.0.1", "localhost") else bind,
            port,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        return cls(store, bind, 0, world_size, backend, timeout_s)

    @classmethod
    def connect(
        cls, host: str, port: int, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 120.0
    ) -> Channel:
        """A worker: reach the trainer's store at ``host:port`` as ``rank``."""
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        return cls(store, local_address(host), rank, world_size, backend, timeout_s)

    @property
    def port(self) -> int:
        return self.store.port

    def join(self) -> Channel:
        """Build the group; blocks until all ``world_size`` ranks have joined (or the timeout)."""
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.address)]
            self.group = dist.ProcessGroupGloo(self.store, self.rank, self.world_size, opts)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.group = dist.ProcessGroupNCCL(self.store, self.rank, self.world_size, opts)
        return self

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast ``tensor`` from rank ``src`` into every rank's ``tensor`` (same shape and dtype); returns it."""
        if self.group is None:
            raise RuntimeError("Channel.broadcast before join()")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor], opts).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
        return tensor

    def broadcast_message(
        self, header: dict | None = None, buffer: torch.Tensor | None = None, src: int = 0, device=None
    ) -> tuple[dict, torch.Tensor]:
        """A JSON-able ``header`` and a ``uint8`` ``buffer`` (optional) from rank ``src`` to every rank.

        Rank ``src`` passes them; the others pass neither and get both back (``src`` gets its own).
        Three broadcasts: the two sizes, the header's bytes, the buffer (skipped when empty).
        """
        device = torch.device(device or "cpu")
        mine = self.rank == src
        text = json.dumps(header).encode() if mine else b""
        if mine and buffer is None:
            buffer = torch.empty(0, dtype=torch.uint8, device=device)
        sizes = torch.tensor([len(text), buffer.numel() if mine else 0], dtype=torch.int64, device=device)
        self.broadcast(sizes, src)
        n_text, n_buffer = (int(v) for v in sizes.tolist())
        data = torch.empty(n_text, dtype=torch.uint8, device=device)
        if mine:
            data.copy_(torch.frombuffer(bytearray(text), dtype=torch.uint8))
        self.broadcast(data, src)
        if not mine:
            buffer = torch.empty(n_buffer, dtype=torch.uint8, device=device)
        if n_buffer:
            self.broadcast(buffer, src)
        return json.loads(data.cpu().numpy().tobytes().decode()), buffer

    def close(self) -> None:
        """Drop the group and the store (a rank that left makes the others' next collective fail)."""
        group, self.group = self.group, None
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except Exception:  # a group whose peers are gone may refuse an orderly shutdown
                pass
        self.store = None
