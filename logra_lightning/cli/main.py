"""The ``logra`` command: ``fit|validate|test`` (LightningCLI), and ``plan|export|serve|generate|configs``.

``logra`` and ``python -m logra_lightning`` both run :func:`main` (the console); from Python, :func:`run`.
``plan``, ``export``, ``serve``, ``generate`` and ``configs`` have their own small parsers
(:mod:`logra_lightning.plan.cli`, :mod:`logra_lightning.cli.export`, :mod:`logra_lightning.cli.serve`,
:mod:`logra_lightning.cli.generate`, :mod:`logra_lightning.cli.shipped`); the trainer subcommands are
:class:`~logra_lightning.cli.lightning_cli.LograCLI`.

``--config`` takes a file or the name of a shipped config (``logra configs`` lists them), and the
working directory is put on ``sys.path`` (as ``trl`` does), so a config can name a reward or a source
in a module beside it (``model.reward: my_reward.score``).

Example::

    >>> from logra_lightning.cli import run
    >>> run(["fit", "--config", "configs/arithmetic_tiny.yaml", "--trainer.max_steps", "2"])  # doctest: +SKIP
    >>> run(["fit", "--config", "configs/arithmetic_tiny.yaml", "--ckpt_path", "last"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from importlib import import_module
from typing import TYPE_CHECKING

from logra_lightning.errors import ConfigError, LograError

if TYPE_CHECKING:
    from logra_lightning.cli.lightning_cli import LograCLI


def error_line(err: BaseException) -> str:
    """``logra: error: <message>`` on one line (newlines inside the message become spaces)."""
    return "logra: error: " + re.sub(r"\s*\n\s*", " ", str(err).strip())


def _fail(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(2) from None


USAGE = """usage: logra <command> [options]   (logra <command> --help for each command's options)

commands:
  fit        RL post-training (LightningCLI): logra fit --config arithmetic_tiny   (a shipped config's name, or a file)
  validate   held-out greedy accuracy of the policy, or of a checkpoint (--ckpt_path)
  test       the same, logged as test/accuracy
  plan       will RL on this model fit, with AdamW or LoGRA, on these GPUs? (no Lightning, no model download)
  export     a checkpoint as a Hugging Face directory that transformers and `vllm serve` load
  serve      a vLLM server that takes LoGRA's low-rank syncs (docs/server_engine.md)
  generate   completions of a checkpoint or model directory; pass@k of a reward on held-out problems
  configs    the shipped configs and callback snippets; `logra configs cp NAME DST` copies one to edit
"""


def _builtin_plan_model(argv: list[str]) -> list[str]:
    """``logra plan --model builtin:NAME``: the built-in's cached directory instead (built first if it is not).

    ``logra_lightning.plan`` sits below the built-in policies in the package's layers, so the name is
    resolved here, where ``logra fit`` resolves it too.
    """
    out = list(argv)
    for i, arg in enumerate(out):
        value = out[i + 1] if arg == "--model" and i + 1 < len(out) else arg.partition("=")[2]
        if (arg == "--model" or arg.startswith("--model=")) and value.startswith("builtin:"):
            from logra_lightning.builtin import resolve_model

            try:
                path = resolve_model(value)
            except ConfigError as err:
                _fail(f"logra plan: error: {err}")
            if arg == "--model":
                out[i + 1] = path
            else:
                out[i] = f"--model={path}"
    return out


def run(argv: Sequence[str]) -> LograCLI | int:
    """``logra ARGV`` from Python: the :class:`LograCLI` of ``fit``/``validate``/``test``, or a command's exit code.

    A :class:`~logra_lightning.errors.LograError` propagates to the caller; a command line that does not parse
    (unknown key, wrong type, missing ``--config`` file) prints its one ``logra: error:`` line and exits with
    status 2, as argparse does.
    """
    return _run(list(argv), own_command_line=False)


def main() -> int | None:
    """The console entry point (``logra``, ``python -m logra_lightning``): runs ``sys.argv[1:]``.

    Returns ``None`` (exit status 0) or a command's non-zero exit code, which the console script passes to
    ``sys.exit``; a :class:`~logra_lightning.errors.LograError` becomes ``logra: error: ...`` and exit status 2.
    """
    import torch.multiprocessing

    torch.multiprocessing.set_start_method("spawn", force=True)  # vLLM's engine and DDP workers: no forked threads
    try:
        out = _run(sys.argv[1:], own_command_line=True)
    except LograError as err:
        _fail(error_line(err))
    return (out or None) if isinstance(out, int) else None


def _run(argv: list[str], own_command_line: bool) -> LograCLI | int:
    """:func:`run`; ``own_command_line``: ``argv`` is this process's ``sys.argv[1:]``, which Lightning's DDP
    launcher starts its other ranks with, so the resolved command line is written back there."""
    if not argv:
        _fail("logra: error: a command is required: fit, validate, test, plan, export, serve, generate or configs")
    if argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if os.getcwd() not in sys.path:  # a reward or source in a module beside the config (as `trl` does)
        sys.path.insert(0, os.getcwd())
    if argv[0] == "plan":
        from logra_lightning import plan

        return plan.main(_builtin_plan_model(argv[1:]))
    if argv[0] in COMMANDS:
        return import_module(COMMANDS[argv[0]]).main(argv[1:])
    from omegaconf.errors import OmegaConfBaseException

    from logra_lightning.cli.lightning_cli import LograCLI, interpolation_error_line, parse_error_line, subcommand_of
    from logra_lightning.cli.shipped import resolve_argv
    from logra_lightning.config.files import check_config_files, config_file_args

    try:
        argv = resolve_argv(argv)  # shipped configs and callback snippets by name
        check_config_files(argv)  # a parse error, like jsonargparse's own: exits from Python too
    except ConfigError as err:
        _fail(error_line(err))
    if own_command_line:
        sys.argv[1:] = argv  # the resolved paths, for the CLI and for the DDP launcher's other ranks
    try:
        # None: the CLI reads sys.argv itself (given both, LightningCLI warns that they may disagree)
        return LograCLI(args=None if own_command_line else argv)
    except argparse.ArgumentError as err:
        _fail("logra: error: " + parse_error_line(str(err), subcommand_of(argv)))
    except OmegaConfBaseException as err:  # an interpolation that cannot be resolved: a parse error too
        _fail("logra: error: " + interpolation_error_line(err, config_file_args(argv)))


# The commands with a parser of their own: `main(argv)` returns an exit code, a bad value raises LograError.
COMMANDS = {
    "serve": "logra_lightning.cli.serve",  # a vLLM server for VLLMServerEngineSpec (docs/server_engine.md)
    "configs": "logra_lightning.cli.shipped",
    "generate": "logra_lightning.cli.generate",
    "export": "logra_lightning.cli.export",
}


if __name__ == "__main__":
    main()
