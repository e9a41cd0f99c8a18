"""The ``logra`` command: ``fit|validate|test`` (LightningCLI), and ``plan|export|serve|generate|configs``.

``logra`` and ``python -m logra_lightning`` both run :func:`main`. ``plan``, ``export``, ``serve``,
``generate`` and ``configs`` have their own small parsers (:mod:`logra_lightning.plan.cli`,
:mod:`logra_lightning.cli.export`, :mod:`logra_lightning.cli.serve`, :mod:`logra_lightning.cli.generate`,
:mod:`logra_lightning.cli.shipped`); the trainer subcommands are
:class:`~logra_lightning.cli.lightning_cli.LograCLI`.

``--config`` takes a file or the name of a shipped config (``logra configs`` lists them), and the
working directory is put on ``sys.path`` (as ``trl`` does), so a config can name a reward or a source
in a module beside it (``model.reward: my_reward.score``).

Example::

    >>> from logra_lightning.cli import main
    >>> main(["fit", "--config", "configs/arithmetic_tiny.yaml", "--trainer.max_steps", "2"])  # doctest: +SKIP
    >>> main(["fit", "--config", "configs/arithmetic_tiny.yaml", "--ckpt_path", "last"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import os
import re
import sys
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


def main(args: list[str] | None = None) -> LograCLI | int | None:
    """Entry point of ``logra`` and ``python -m logra_lightning``; ``args`` defaults to ``sys.argv[1:]``.

    Called with ``args`` (from Python) it returns the :class:`LograCLI` (or the exit code of
    ``plan``/``export``/``serve``/``generate``/``configs``) and lets a :class:`~logra_lightning.errors.LograError`
    propagate; from the console it returns ``None`` (exit status 0; the console script passes the
    return value to ``sys.exit``) and turns a ``LograError`` into ``logra: error: ...`` and exit
    status 2. A command line that does not parse (unknown key, wrong type, missing ``--config``
    file) prints that one line and exits with status 2 either way, as argparse does.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if args is None:  # a console entry point: vLLM's engine and DDP workers must not fork a threaded process
        import torch.multiprocessing

        torch.multiprocessing.set_start_method("spawn", force=True)
    if not argv:
        _fail("logra: error: a command is required: fit, validate, test, plan, export, serve, generate or configs")
    if argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args is not None else None
    if os.getcwd() not in sys.path:  # a reward or source in a module beside the config (as `trl` does)
        sys.path.insert(0, os.getcwd())
    if argv and argv[0] == "plan":
        from logra_lightning import plan

        return plan.main(_builtin_plan_model(argv[1:]))
    if argv and argv[0] == "serve":  # a vLLM server for VLLMServerEngineSpec (docs/server_engine.md)
        from logra_lightning.cli import serve

        code = serve.main(argv[1:])
        return code if args is not None else None
    try:
        if argv[0] == "configs":
            from logra_lightning.cli import shipped

            code = shipped.main(argv[1:])
            return code if args is not None else (code or None)
        if argv[0] == "generate":
            from logra_lightning.cli import generate

            code = generate.main(argv[1:])
            return code if args is not None else None
        if argv and argv[0] == "export":
            from logra_lightning.cli import export

            code = export.main(argv[1:])
            return code if args is not None else None
    except LograError as err:
        if args is not None:
            raise
        _fail(error_line(err))
    from omegaconf.errors import OmegaConfBaseException

    from logra_lightning.cli.lightning_cli import LograCLI, interpolation_error_line, parse_error_line, subcommand_of
    from logra_lightning.cli.shipped import resolve_argv
    from logra_lightning.config.files import check_config_files, config_file_args

    try:
        argv = resolve_argv(argv)  # shipped configs and callback snippets by name
        check_config_files(argv)  # a parse error, like jsonargparse's own: exits from Python too
    except ConfigError as err:
        _fail(error_line(err))
    if args is None:
        sys.argv[1:] = argv  # the CLI reads the resolved paths from there
    try:
        cli = LograCLI(args=None if args is None else argv)  # None: the CLI reads sys.argv itself, without a warning
    except argparse.ArgumentError as err:
        _fail("logra: error: " + parse_error_line(str(err), subcommand_of(argv)))
    except OmegaConfBaseException as err:  # an interpolation that cannot be resolved: a parse error too
        _fail("logra: error: " + interpolation_error_line(err, config_file_args(argv)))
    except LograError as err:
        if args is not None:  # called from Python (tests): let the caller see the exception
            raise
        _fail(error_line(err))
    return cli if args is not None else None


if __name__ == "__main__":
    main()
