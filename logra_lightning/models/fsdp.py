"""FSDP2 sharding of a policy: ``fully_shard`` per decoder layer, then the root.

:func:`shard_policy` is called from :meth:`PolicyGradientModule.configure_model` when the
trainer runs Lightning's ``ModelParallelStrategy``; LoGRA then sees row-sharded DTensors
(docs/design.md §3; :mod:`logra_lightning.optim.sharding`). Tested in
``tests/test_fsdp2.py``, which shards a tiny Qwen2 with :func:`shard_policy` on 2 CPU
processes and checks LoGRA against one process, and end to end under Lightning in
``tests/test_fsdp_lightning.py`` (``configs/arithmetic_fsdp.yaml``).

Choices:

1. **Units.** One FSDP unit per decoder layer (HF's ``_no_split_modules`` names the layer
   class; without it, the longest ``nn.ModuleList`` of the model), and the root unit for
   the rest (embeddings, final norm, ``lm_head``; tied embeddings stay in one unit).
2. **Weight sync gathers factors, not weights**
   (:func:`~logra_lightning.sync.gather.gather_update_factors`).
3. **Data parallel only.** LoGRA supports dim-0 sharding, not tensor parallelism, so a
   ``tensor_parallel`` mesh dim larger than 1 is refused. Lightning's ``ModelParallelStrategy``
   defaults ``tensor_parallel_size`` to the devices per node: set
   ``data_parallel_size=<devices>, tensor_parallel_size=1``.

Example::

    >>> import lightning as L
    >>> from lightning.pytorch.strategies import ModelParallelStrategy
    >>> strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    >>> trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy)  # doctest: +SKIP
    >>> # in the LightningModule:
    >>> # def configure_model(self):
    >>> #     shard_policy(self.policy, self.device_mesh)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from logra_lightning.errors import ConfigError

_DP, _TP = "data_parallel", "tensor_parallel"  # ModelParallelStrategy's mesh dim names


def data_parallel_mesh(device_mesh: Any) -> Any:
    """The 1-D mesh to shard over: ``device_mesh["data_parallel"]``, or ``device_mesh`` itself if it is 1-D.

    Raises:
        ConfigError: the mesh has a ``tensor_parallel`` dim larger than 1, or is multi-dimensional
            without a ``data_parallel`` dim.
    """
    names = tuple(device_mesh.mesh_dim_names or ())
    if _TP in names and device_mesh[_TP].size() > 1:
        raise ConfigError(
            f"FSDP2 with LoGRA shards over data parallelism only, but the device mesh has "
            f"tensor_parallel size {device_mesh[_TP].size()}. Lightning's ModelParallelStrategy defaults "
            "tensor_parallel_size to the devices per node: pass "
            "ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1)."
        )
    if _DP in names:
        return device_mesh[_DP]
    if device_mesh.ndim == 1:
        return device_mesh
    raise ConfigError(f"expected a 1-D device mesh or one with a {_DP!r} dim, got dims {names or device_mesh.ndim}")


def decoder_layers(policy: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: modules of the classes in HF's ``_no_split_modules``,
    else the children of the longest ``nn.ModuleList``."""
    names = set(getattr(policy, "_no_split_modules", None) or ())
    layers = [m for m in policy.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in policy.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def shard_policy(policy: nn.Module, device_mesh: Any, **fully_shard_kwargs: Any) -> nn.Module:
    """Apply ``fully_shard`` to each decoder layer of ``policy`` and then to ``policy`` (in place).

    Args:
        policy: the model (e.g. an HF causal LM).
        device_mesh: ``LightningModule.device_mesh`` under ``ModelParallelStrategy`` (dims
            ``data_parallel`` x ``tensor_parallel``), or a 1-D mesh.
        **fully_shard_kwargs: passed to every ``fully_shard`` call (``reshard_after_forward``,
            ``mp_policy``, ``offload_policy``).

    Returns:
        ``policy``, now an FSDP2 module whose parameters are DTensors sharded on dim 0.
        Calling it again on a sharded policy does nothing.

    Raises:
        ConfigError: see :func:`data_parallel_mesh`.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(policy, FSDPModule):
        return policy
    mesh = data_parallel_mesh(device_mesh)
    for layer in decoder_layers(policy):
        fully_shard(layer, mesh=mesh, **fully_shard_kwargs)
    fully_shard(policy, mesh=mesh, **fully_shard_kwargs)
    return policy
