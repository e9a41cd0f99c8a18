"""vLLM as the rollout engine: in this process (:mod:`.engine`) or as a separate ``vllm serve`` (:mod:`.server`).

Both keep vLLM in step with the trainer through vLLM's weight-transfer API and LoGRA's backend:

* :mod:`.engine`: :class:`VLLMEngine` / :class:`VLLMEngineSpec`, a ``vllm.LLM`` in this process;
* :mod:`.server`: :class:`VLLMServerEngine` / :class:`VLLMServerEngineSpec`, a ``vllm serve`` process
  reached over HTTP (:mod:`.client`);
* :mod:`.sender` (trainer side) and :mod:`.transfer` / :mod:`.worker` (inside vLLM's workers): the
  ``"logra"`` weight-transfer backend, which :mod:`.plugin` registers in every vLLM process;
* :mod:`.options`: :class:`VLLMOptions`, the engine options both specs share.

Importing this package does not import vLLM: the engine classes are loaded on first access.

Example::

    >>> from logra_lightning.rollout.vllm import VLLMOptions
    >>> VLLMOptions().dtype
    'float32'
"""

from logra_lightning.rollout.vllm.options import VLLMOptions

_LAZY = {
    "VLLMEngine": "engine",
    "VLLMEngineSpec": "engine",
    "VLLMServerEngine": "server",
    "VLLMServerEngineSpec": "server",
}

__all__ = ["VLLMEngine", "VLLMEngineSpec", "VLLMOptions", "VLLMServerEngine", "VLLMServerEngineSpec"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
