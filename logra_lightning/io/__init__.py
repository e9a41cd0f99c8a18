"""Files a run writes and reads: atomic checkpoints (:mod:`~logra_lightning.io.checkpoint`) and the trained
policy as a Hugging Face directory (:mod:`~logra_lightning.io.export`)."""

from logra_lightning.io.checkpoint import AtomicCheckpointIO

__all__ = ["AtomicCheckpointIO"]
