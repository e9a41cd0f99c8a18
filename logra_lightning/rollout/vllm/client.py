"""The HTTP side of a ``vllm serve`` engine: its routes, each a method, with errors that name the server.

:class:`ServerClient` covers what the trainer needs from a server started by ``logra serve``
(:mod:`logra_lightning.cli.serve`) or ``VLLM_SERVER_DEV_MODE=1 vllm serve ...``:

* vLLM's weight-sync control plane (``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``; vLLM's ``VLLMWeightSyncClient`` protocol),
  ``/pause`` and ``/resume`` around an update, ``/weight_info``, ``/get_world_size``;
* token-id generation: ``/inference/v1/generate`` (``--enable-scale-out``), prompt token ids and
  vLLM ``SamplingParams`` in, completion token ids with their logprobs and weight versions out.

Errors: :class:`ServerUnreachable` when nothing answers at the URL (a connection error), and
:class:`ServerError` carrying the server's own message when it answers with an error status.
Sessions are per thread, so rollouts may run from several threads at once.

Example::

    >>> client = ServerClient("http://127.0.0.1:8000")
    >>> client.url
    'http://127.0.0.1:8000'
    >>> # client.wait_until_up(60); client.generate([5, 6, 7], {"max_tokens": 4, "logprobs": 0})
"""

from __future__ import annotations

import threading
import time
from typing import Any


class ServerUnreachable(ConnectionError):
    """Nothing answered at the server's URL (refused, reset, timed out)."""


class ServerError(RuntimeError):
    """The server answered with an error status; ``status`` is it, the message is the server's."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ServerClient:
    """One ``vllm serve`` process's routes (see the module notes).

    Args:
        url: the server's base URL, e.g. ``http://10.0.0.2:8000``.
        timeout_s: longest wait for one response (a weight update or a batch of rollouts).
    """

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._local = threading.local()

    def _session(self):
        import requests

        if getattr(self._local, "session", None) is None:
            self._local.session = requests.Session()
        return self._local.session

    def request(self, method: str, path: str, timeout_s: float | None = None, **kwargs) -> Any:
        """``method`` on ``path``; the JSON answer (or ``None``).

        Raises:
            ServerUnreachable: no connection (the message names the URL).
            ServerError: an error status (the server's message).
        """
        import requests

        url = f"{self.url}{path}"
        try:
            r = self._session().request(method, url, timeout=timeout_s or self.timeout_s, **kwargs)
        except (requests.ConnectionError, requests.Timeout) as e:
            self._local.session = None  # a dead connection must not be reused
            raise ServerUnreachable(f"no answer from the vLLM server at {url}: {type(e).__name__}: {e}") from e
        if r.status_code >= 400:
            raise ServerError(f"{method} {url} -> {r.status_code}: {_message(r)}", r.status_code)
        try:
            return r.json()
        except ValueError:
            return None

    # ----------------------------------------------------------------- state
    def healthy(self) -> bool:
        try:
            self.request("GET", "/health", timeout_s=5)
            return True
        except (ServerUnreachable, ServerError):
            return False

    def wait_until_up(self, timeout_s: float, poll_s: float = 1.0) -> float:
        """Block until ``/health`` answers; returns the seconds waited.

        Raises:
            ServerUnreachable: still no answer after ``timeout_s`` (names the URL and how to start a server).
        """
        start = time.monotonic()
        while not self.healthy():
            if time.monotonic() - start >= timeout_s:
                raise ServerUnreachable(
                    f"no vLLM server answers at {self.url} (waited {timeout_s:.0f} s for {self.url}/health). "
                    f"Start one: `logra serve --model <model> --port <port>` (docs/server_engine.md), or fix the "
                    "engine's url in the config (model.engine.init_args.url)."
                )
            time.sleep(poll_s)
        return time.monotonic() - start

    def world_size(self) -> int:
        """How many workers the server has (tensor x pipeline x data parallel)."""
        return int(self.request("GET", "/get_world_size")["world_size"])

    def weight_version(self) -> str | None:
        return self.request("GET", "/weight_info").get("weight_version")

    def pause(self, mode: str = "wait") -> None:
        """Stop scheduling (``wait``: let running requests finish) and clear the KV and prefix caches."""
        self.request("POST", "/pause", params={"mode": mode, "clear_cache": "true"})

    def resume(self) -> None:
        self.request("POST", "/resume")

    # ------------------------------------------------- weight-sync control plane
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.request("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.request("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.request("POST", "/update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version} if weight_version is not None else None
        self.request("POST", "/finish_weight_update", json=body)

    # -------------------------------------------------------------- rollouts
    def generate(self, token_ids: list[int], sampling_params: dict[str, Any]) -> dict:
        """One prompt's completions: ``choices`` with ``token_ids``, ``logprobs`` and ``weight_versions``."""
        body = {"token_ids": list(token_ids), "sampling_params": sampling_params, "output_mode": "tokens"}
        return self.request("POST", "/inference/v1/generate", json=body)


def _message(response) -> str:
    """The error text of a vLLM answer (``{"error": {"message": ...}}``, ``{"detail": ...}``) or its body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:2000]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if err:
            return str(err)
        if body.get("detail"):
            return str(body["detail"])
    return str(body)[:2000]
