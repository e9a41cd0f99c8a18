"""`logra plan`: will RL on this model fit? Per-GPU memory of dense AdamW vs LoGRA under FSDP2.

The command line of the memory model in :mod:`logra_lightning.plan.memory`:

    logra plan --model gemma-3-27b --gpus 8 --gpu-memory-gb 80 --rank 256 --batch 1 --seq-len 4096
    logra plan --model path/to/hf_model_dir --gpus 1 --json

Every :class:`~logra_lightning.plan.setup.PlanSetup` field is one flag (``seq_len`` ->
``--seq-len``), its default, type, choices and help read from the field: a new field is a new
flag with nothing to add here. A ``bool`` field that defaults to True gets ``--no-<flag>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from typing import Any

from logra_lightning.models.shapes import ShapeError, load_architecture, shipped_shapes
from logra_lightning.plan.memory import plan
from logra_lightning.plan.setup import GiB, PlanError, PlanSetup

_ROWS = [
    ("params", "parameters"),
    ("grads", "gradients"),
    ("optimizer_state", "optimizer state"),
    ("activations", "activations"),
    ("transients", "optimizer transients"),
    ("fsdp_buffers", "FSDP2 unsharded buffers"),
    ("allocator_slack", "allocator slack"),
    ("engine_weights", "engine weights"),
    ("kv_cache", "engine KV cache"),
    ("reserve", "reserve (context, NCCL)"),
]


def format_table(result: dict[str, Any]) -> str:
    """A readable per-GPU table (GiB) for both optimizers, at each one's peak phase."""
    s, m = result["setup"], result["model"]
    opts = result["optimizers"]
    names = {"adamw": "AdamW", "logra": f"LoGRA r={s['rank']}"}
    lines = [
        f"{m['name']}: {m['params'] / 1e9:.2f}B params ({m['model_type']}, hidden {m['hidden_size']}, "
        f"{m['num_layers']} layers, vocab {m['vocab_size']}"
        + (f", {m['num_experts']} experts, {m['num_experts_per_tok']} per token" if m["num_experts"] else "")
        + ")",
        f"{s['gpus']} GPU(s) x {s['gpu_memory_gb']:g} GiB, FSDP2, {s['precision']}, batch {s['batch']} x "
        f"seq {s['seq_len']} per GPU, activation checkpointing {'on' if s['activation_checkpointing'] else 'off'}"
        + (f", engine colocated (tp={s['engine_tp']})" if s["colocate_engine"] else ""),
        "",
        f"{'per GPU, GiB, at the peak':<32}" + "".join(f"{names[k]:>14}" for k in opts),
    ]
    for key, label in _ROWS:
        lines.append(f"{label:<32}" + "".join(f"{o['breakdown'][key] / GiB:>14.2f}" for o in opts.values()))
    lines.append("-" * (32 + 14 * len(opts)))
    lines.append(f"{'peak total':<32}" + "".join(f"{o['peak_bytes'] / GiB:>14.2f}" for o in opts.values()))
    lines.append(f"{'  at':<32}" + "".join(f" {o['peak_phase']:>13}" for o in opts.values()))
    verdict = [f"{'fits' if o['fits'] else 'OOM'} ({o['headroom_bytes'] / GiB:+.1f})" for o in opts.values()]
    lines.append(f"{'fits in ' + format(s['gpu_memory_gb'], 'g') + ' GiB?':<32}" + "".join(f"{v:>14}" for v in verdict))
    for mode in ("checkpointed", "not_checkpointed"):
        label = f"activation peak, {mode.replace('_', ' ')}"
        values = (o["activation_peak_bytes"][mode] / GiB for o in opts.values())
        lines.append(f"{label:<32}" + "".join(f"{v:>14.2f}" for v in values))
    return "\n".join(lines)


def _flags() -> list[tuple[dataclasses.Field, type]]:
    """The :class:`PlanSetup` fields that are flags, each with its value type (``int | None`` -> ``int``)."""
    hints = typing.get_type_hints(PlanSetup)
    out = []
    for f in dataclasses.fields(PlanSetup):
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):
            kind = next(t for t in typing.get_args(kind) if t is not type(None))
        if f.metadata.get("cli", True):
            out.append((f, kind))
    return out


def build_parser() -> argparse.ArgumentParser:
    """``--model``, one flag per :class:`PlanSetup` field, ``--json``.

    ``--rank`` defaults to None here: the setup's rank, or the smallest matrix dim if that is smaller.
    """
    ap = argparse.ArgumentParser(prog="logra plan", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model",
        required=True,
        help=f"shipped shape ({', '.join(shipped_shapes())}), HF dir, config JSON, or hub org/name",
    )
    for f, kind in _flags():
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        if kind is bool:
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            ap.add_argument(flag, action=action, default=f.default, help=meta["help"])
            continue
        default = None if f.name == "rank" else f.default
        ap.add_argument(flag, type=kind, default=default, choices=meta["choices"], help=meta["help"])
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    """``logra plan``: print the table (or JSON); invalid inputs exit 2 with a message naming the field."""
    args = build_parser().parse_args(argv)
    try:
        arch = load_architecture(args.model)
        values = {f.name: getattr(args, f.name) for f, _ in _flags()}
        if values["rank"] is None:
            values["rank"] = min(PlanSetup.rank, arch.min_matrix_dim()[0])
        result = plan(arch, PlanSetup(**values))
    except (PlanError, ShapeError) as e:
        print(f"logra plan: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0
