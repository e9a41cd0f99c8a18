"""``logra export``: a checkpoint of ``logra fit`` as a Hugging Face model directory.

Run::

    logra export --ckpt_path runs/x/version_0/checkpoints/last.ckpt --out exported/
    logra export --ckpt_path best --config my_task.yaml --out exported/   # (--config: where the fit's runs are)
    vllm serve exported/

``--ckpt_path last`` / ``best`` are found as ``logra test`` finds them
(:func:`~logra_lightning.cli.checkpoints.resolve_ckpt_path`); the conversion itself is
:func:`~logra_lightning.io.export.export_checkpoint`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from logra_lightning.errors import ConfigError
from logra_lightning.io.export import DTYPES, export_checkpoint


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one `logra: error:` line, like every other mistake
        raise ConfigError(f"logra export: {message} (see logra export --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="logra export", description="Write a logra fit checkpoint as a Hugging Face model directory.")
    p.add_argument(
        "--ckpt_path",
        required=True,
        help="a .ckpt file, a distributed-checkpoint directory (FSDP2), or last / best (with --config)",
    )
    p.add_argument("--out", required=True, help="directory to write (new, empty, or an earlier export)")
    p.add_argument("--config", action="append", default=[], help="the fit's config: where last / best are looked up")
    p.add_argument("--base_model", default=None, help="the model the run started from (default: from the checkpoint)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="cast the weights (default: as trained)")
    return p


def main(argv: Sequence[str]) -> int:
    """``logra export ...``; returns 0, raises :class:`~logra_lightning.errors.LograError` on a mistake."""
    from logra_lightning.cli.checkpoints import resolve_ckpt_path

    args = parser().parse_args(list(argv))
    ckpt_path = resolve_ckpt_path(args.ckpt_path, args.config, "export")
    out = export_checkpoint(ckpt_path, args.out, args.base_model, args.dtype)
    print(f"[logra] exported {ckpt_path} to {out}\n  serve it: vllm serve {out}", flush=True)
    return 0
