"""The ``vllm.general_plugins`` entry point: makes LoGRA's weight-transfer backend known to every vLLM process.

vLLM runs every function of that entry-point group in each of its processes (API server, engine
core, workers) before it builds anything, so ``--weight-transfer-config '{"backend": "logra"}'``
works for ``vllm serve`` as for ``vllm.LLM``. ``pyproject.toml`` declares it::

    [project.entry-points."vllm.general_plugins"]
    logra = "logra_lightning.rollout.vllm.plugin:register"

The registration is lazy (a module path), so processes that never build the backend do not
import it; vLLM may call :func:`register` more than once per process.
"""

from __future__ import annotations

BACKEND = "logra"
PLUGIN = "logra"  # the entry point's name (what VLLM_PLUGINS would list)


def register() -> None:
    """Register :class:`~logra_lightning.rollout.vllm.transfer.LowRankTransferEngine` as ``"logra"`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "logra_lightning.rollout.vllm.transfer", "LowRankTransferEngine"
        )


def check_installed() -> None:
    """Raise with how to fix it when this package's vLLM plugin is not installed (vLLM could not find the backend).

    Raises:
        RuntimeError: no ``vllm.general_plugins`` entry point named ``logra`` points here.
    """
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == PLUGIN]
    if not any(ep.value == f"{__name__}:register" for ep in found):
        raise RuntimeError(
            "vLLM will not know the 'logra' weight-transfer backend: this package's `vllm.general_plugins` entry "
            f"point is not installed (found {[ep.value for ep in found] or 'none'}). Reinstall the package so its "
            "entry points are registered: `pip install -e .` in the repository (`make venv` does it), or "
            "`pip install logra-lightning` on the machine that runs vLLM."
        )
