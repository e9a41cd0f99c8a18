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

Before a checkpoint is *read* (``--ckpt_path``, ``logra export``), :func:`check_checkpoint_path`
checks, without loading any tensor, that it is a whole ``torch.save`` file (its zip directory and
pickle are readable) or a whole distributed-checkpoint directory (``.metadata`` and every
``*.distcp`` file it names): a missing, truncated or foreign file fails with one line naming it.

Example::

    >>> import lightning as L
    >>> trainer = L.Trainer(plugins=[AtomicCheckpointIO()], logger=False)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from logra_lightning.errors import CheckpointError, ConfigError

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


# ------------------------------------------------------------------ reading
_RESUME_HINT = "resume with --ckpt_path last (the newest last.ckpt of the run), or give the path of a .ckpt file"


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """True for a ``torch.distributed.checkpoint`` directory (``ModelParallelStrategy``'s format)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def check_checkpoint_path(path: str | os.PathLike, key: str = "--ckpt_path") -> None:
    """A checkpoint to read must exist and be whole; no tensor is loaded.

    Raises:
        ConfigError: ``<key> <path>: <what is wrong>; <how to fix it>`` for a missing path, an empty,
            truncated or non-PyTorch file, a directory that is not a distributed checkpoint, or a
            distributed checkpoint with missing shard files.
    """
    p = Path(path).expanduser()
    if not p.exists():
        near = sorted(str(c) for c in p.parent.glob("*.ckpt")) if p.parent.is_dir() else []
        hint = f"; {p.parent} holds {', '.join(near[:4])}" if near else f"; {_RESUME_HINT}"
        raise ConfigError(f"{key} {path}: no such file or directory{hint}")
    if p.is_dir():
        _check_distributed_checkpoint(p, path, key)
        return
    size = p.stat().st_size
    if size == 0:
        raise ConfigError(f"{key} {path}: the file is empty (an interrupted copy?); {_RESUME_HINT}")
    if not zipfile.is_zipfile(p):
        with p.open("rb") as fh:
            legacy = fh.read(1) == b"\x80"  # a pre-zip torch.save pickle
        if not legacy:
            raise ConfigError(
                f"{key} {path}: not a PyTorch checkpoint, or truncated ({size} bytes, no zip directory "
                f"at its end); {_RESUME_HINT}"
            )
        return
    try:
        with zipfile.ZipFile(p) as zf:
            names = zf.namelist()
            pkl = next((n for n in names if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if pkl is None:
                raise ConfigError(f"{key} {path}: a zip file but not a PyTorch checkpoint (no data.pkl inside)")
            with zf.open(pkl) as fh:
                _check_pickle(fh.read())
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - zipfile/pickle raise many types on damaged input
        raise ConfigError(f"{key} {path}: damaged checkpoint ({type(err).__name__}: {err}); {_RESUME_HINT}") from None


def _check_pickle(data: bytes) -> None:
    """Walk the pickle's opcodes (no object is built): damaged bytes raise."""
    import pickletools

    for _ in pickletools.genops(data):
        pass
    if not data.endswith(pickle.STOP):
        raise ValueError("the pickle has no STOP opcode")


def _check_distributed_checkpoint(p: Path, path: str | os.PathLike, key: str) -> None:
    if not (p / ".metadata").is_file():
        inner = sorted(p.glob("**/*.ckpt"))[:3]
        hint = f"; did you mean {inner[0]}?" if inner else f"; {_RESUME_HINT}"
        raise ConfigError(f"{key} {path}: a directory but not a distributed checkpoint (no .metadata file){hint}")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(p)).read_metadata()
    except Exception as err:  # noqa: BLE001
        raise ConfigError(
            f"{key} {path}: damaged distributed checkpoint (.metadata: {type(err).__name__}: {err})"
        ) from None
    files = {info.relative_path for info in (metadata.storage_data or {}).values()}
    missing = sorted(f for f in files if not (p / f).is_file())
    if missing:
        raise ConfigError(
            f"{key} {path}: distributed checkpoint is incomplete, {len(missing)} of {len(files)} files "
            f"missing ({', '.join(missing[:3])}); copy the whole directory"
        )
