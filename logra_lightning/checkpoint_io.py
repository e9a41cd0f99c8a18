"""Atomic checkpoint writes: a failed or interrupted save never damages the previous checkpoint.

:class:`AtomicCheckpointIO` is the ``CheckpointIO`` plugin of ``logra fit`` (the CLI's trainer
defaults): ``torch.save`` streams into a temporary file next to the target, which is flushed,
``fsync``-ed and then renamed over the target with ``os.replace`` (atomic on POSIX and Windows
within one filesystem). A reader sees the old checkpoint or the new one, never half of one; a
write that fails (disk full, killed process) leaves the old file as it was and removes the
temporary file. Tests: ``tests/test_checkpoint_io.py``.

Departures from Lightning's ``TorchCheckpointIO`` (which goes through an fsspec transaction):

1. The temporary file is in the target's directory, so the final rename never crosses
   filesystems (fsspec's local transaction writes to the system temp dir and *moves* the file,
   which is a copy onto the target when ``/tmp`` is another filesystem).
2. The checkpoint is streamed to the file, not first serialized into memory: a save does not
   need a second copy of the weights and optimizer state in RAM.
3. Remote paths (``s3://`` and other fsspec URLs) are handed to ``TorchCheckpointIO`` unchanged.
   Distributed (directory) checkpoints of ``ModelParallelStrategy`` do not go through a
   ``CheckpointIO`` at all and are not atomic.

Example::

    >>> import lightning as L
    >>> trainer = L.Trainer(plugins=[AtomicCheckpointIO()], logger=False)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from logra_lightning.errors import CheckpointError

_HPARAMS_KEY = "hyper_parameters"  # LightningModule.CHECKPOINT_HYPER_PARAMS_KEY


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` through a temporary file in the same directory and ``os.replace``.

    Raises:
        Whatever ``torch.save`` or the filesystem raised; ``path`` is then unchanged and the
        temporary file is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # make the rename itself durable


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic (write to a temporary file, then ``os.replace``).

    Raises:
        CheckpointError: the write failed (the message names the path and the cause, and says
            the previous checkpoint there is intact).

    Example::

        >>> import lightning as L
        >>> from lightning.pytorch.callbacks import ModelCheckpoint
        >>> trainer = L.Trainer(plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        try:
            try:
                atomic_torch_save(checkpoint, path)
            except AttributeError as err:  # an unpicklable hyperparameter: save without them, as Lightning does
                checkpoint.pop(_HPARAMS_KEY, None)
                rank_zero_warn(f"Hyperparameters could not be pickled and were left out of {path}: {err}")
                atomic_torch_save(checkpoint, path)
        except Exception as err:
            previous = "the previous checkpoint there is intact" if Path(path).exists() else "no file was written"
            raise CheckpointError(
                f"writing checkpoint {path} failed ({type(err).__name__}: {err}); {previous}. "
                "Free disk space or choose another ModelCheckpoint dirpath, then resume with --ckpt_path last."
            ) from err
