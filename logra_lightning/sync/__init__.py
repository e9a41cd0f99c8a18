"""What crosses from the trainer to a rollout engine: the wire format of low-rank updates
(:mod:`~logra_lightning.sync.wire`) and their gathering from FSDP2 shards (:mod:`~logra_lightning.sync.gather`);
the callback that sends them is :class:`~logra_lightning.callbacks.LowRankWeightSync`."""

from logra_lightning.sync.wire import BasisCache, BasisVersions, LowRankUpdate

__all__ = ["BasisCache", "BasisVersions", "LowRankUpdate"]
