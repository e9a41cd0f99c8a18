"""Kept at this path because every ``config.yaml`` that ``logra fit`` saved names
``logra_lightning.checkpoint_io.AtomicCheckpointIO`` as its checkpoint plugin; the code is in
:mod:`logra_lightning.io.checkpoint`."""

from logra_lightning.io.checkpoint import AtomicCheckpointIO

__all__ = ["AtomicCheckpointIO"]
