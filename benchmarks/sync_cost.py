"""Cost of keeping a vLLM engine in step with the trainer: full weights, low-rank factors, coefficients only.

Run (full: the ~25M / ~100M / ~400M Qwen2 shapes of ``optimizer_memory.py``, rank 64, each size
in its own process; about 12 min on 2 cores):

    .venv/bin/python -m benchmarks.sync_cost
    .venv/bin/python -m benchmarks.sync_cost --sizes 100m     # one size
    .venv/bin/python -m benchmarks.sync_cost --quick          # the tiny test model, rank 8 (~1 min)

Per size, the trainer takes real LoGRA steps (every matrix low-rank, embeddings included, a small
``update_proj_gap`` so that refreshes happen) on random tokens, and after each step sends the applied
update to a real ``VLLMEngine`` exactly as :class:`~logra_lightning.callbacks.weight_sync.LowRankWeightSync`
does (:func:`~logra_lightning.sync.wire.wire_updates`): the engine keeps each matrix's basis, so a sync
carries bases only after a refresh and coefficients otherwise. This runs once per wire format from a
full sync: ``float32``; ``bfloat16`` with ``match_rounding`` (the trainer applies the rounded update
too); ``bfloat16_unmatched``. Per sync: bytes handed to the engine, wall seconds (on vLLM's CPU backend
including the rebuild of every changed module's repacked weights), by kind; bytes per step over a
refresh period of ``G`` steps for ``G`` in ``GAPS``; the drift (``|engine - trainer|`` logprob of
sampled tokens) after 1, 2, 4, ... syncs, beside how far the policy moved. Full syncs are timed for
comparison. One results row per size; ``settings.headline_size`` is the row the headline quotes.

Against the field's lossless sync, in the same run: the sparse bitwise bf16 delta
(:mod:`benchmarks.sparse_delta`: int32 indices + bf16 values of the changed bf16 weights) of the same
LoGRA steps and of AdamW's from the same weights, and LoGRA's bf16 coefficient sync over AdamW's
sparse delta (target <= ``SPARSE_TARGET``), also at lower learning rates (``sparse_delta_lr_sweep``).
"""

from __future__ import annotations

import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import engine_drift, logprob_gap, sample, shape_config, trainer_logprobs
from benchmarks.harness import Benchmark, bench, flat, main
from benchmarks.report import Col, bars, command_head, load_text, met, num, table

SIZES = ("25m", "100m", "400m")
HEADLINE = "100m"
GAPS = (50, 100, 200)  # refresh periods the per-step average is given for (configs use 50-100; LoGRA's default 200)
FORMATS = {"float32": ("float32", False), "bfloat16": ("bfloat16", True), "bfloat16_unmatched": ("bfloat16", False)}
FULL = dict(rank=64, steps={"25m": 16, "100m": 8, "400m": 6}, update_proj_gap=3, full_syncs=2, batch=2, seq=32)
FULL.update(threads=2, lr=1e-3, sweep_lrs=(1e-4, 1e-5, 1e-6), sweep_steps=3)
QUICK = {**FULL, "rank": 8, "steps": {"tiny": 4}, "batch": 4, "seq": 16, "threads": 1}
QUICK.update(sweep_lrs=(1e-5,), sweep_steps=2)
SPARSE_TARGET = 0.5  # LoGRA's coefficient sync (bf16 wire) at most this share of AdamW's sparse delta per step
QUICK_SIZE = "tiny"  # build_tiny_model: the test model and char tokenizer
OPTS = ("adamw", "logra")  # the optimizers of the sparse-delta learning-rate sweep


def build_model_dir(size: str, path: Path) -> str:
    """A randomly initialised Qwen2 of the benchmark shape ``size`` plus the char tokenizer
    (vLLM itself never tokenizes here); ``tiny``: the test model."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from logra_lightning.models import build_char_tokenizer, build_tiny_model

    if size == QUICK_SIZE:
        return build_tiny_model(path)
    tok = build_char_tokenizer()
    fields = {k: v for k, v in shape_config(size).items() if k != "model_type"}
    special = dict(eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = Qwen2Config(**fields, max_position_embeddings=256, **special, torch_dtype="float32")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


def _median(rows: list[dict], key: str) -> float | None:
    return statistics.median(r[key] for r in rows) if rows else None


def _rounded(rows: list[dict], digits: int) -> list[dict]:
    return [{k: (round(v, digits) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]


def make_optimizer(name: str, policy, lr: float, run: dict):
    """AdamW or LoGRA (every matrix low-rank) over ``policy``, as every pass of this benchmark builds it."""
    import torch

    from logra_lightning.optim import LoGRA

    if name == "adamw":
        return torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.01)
    params = list(policy.named_parameters())
    return LoGRA(params, lr=lr, weight_decay=0.01, rank=run["rank"], update_proj_gap=run["update_proj_gap"])


def lm_step(policy, opt, run: dict, g) -> None:
    """One language-model step on random tokens (``[batch, seq]``, drawn from ``g``)."""
    import torch

    ids = torch.randint(0, policy.config.vocab_size, (run["batch"], run["seq"]), generator=g)
    policy(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def run_format(engine, policy, opt, wire: str, steps: int, run: dict, prompts, g, sparse: bool = False) -> dict:
    """From a full sync, ``steps`` LoGRA steps each synced in ``wire`` format; bytes, seconds and drift.

    ``sparse``: also measure the sparse bf16 delta of each of these steps (``sparse_delta`` in the result).
    """
    import torch

    from benchmarks.sparse_delta import SparseDelta
    from logra_lightning.sync.wire import match_wire_rounding_, tensor_nbytes, wire_updates

    dtype_name, match = FORMATS[wire]
    dtype = getattr(torch, dtype_name)
    params = dict(policy.named_parameters())
    dense_names = set(opt.dense_param_names())
    engine.load_weights(policy.named_parameters())  # start in step
    start = sample(engine, prompts)  # the policy at the start, as the engine samples it
    held: dict[str, str] = {}
    syncs, drifts, sparse_rows = [], [], []
    checkpoints = {k for k in (1, 2, 4, 8, 16, 32) if k <= steps} | {steps}
    delta = SparseDelta(params) if sparse else None
    for k in range(1, steps + 1):
        lm_step(policy, opt, run, g)
        if delta is not None:  # what the field's sparse sync would send for this LoGRA step
            sparse_rows.append(delta.step(params))
        updates = [u for step in opt.pop_applied_updates() for u in step]
        t = time.perf_counter()
        if match:
            with torch.no_grad():
                for u in updates:
                    match_wire_rounding_(params[u.name].view(-1, params[u.name].shape[-1]), u.left, u.right, dtype)
        match_seconds = time.perf_counter() - t
        sent, held = wire_updates(updates, held, dtype)
        dense = [(n, params[n].detach()) for n in dense_names]
        t = time.perf_counter()
        engine.apply_lowrank_updates(sent, dense)
        seconds = time.perf_counter() - t
        basis_bytes = sum(u.basis_nbytes for u in sent)
        syncs.append(
            {
                "kind": "with_bases" if basis_bytes else "coefficients",
                "bases": sum(u.basis_nbytes > 0 for u in sent),
                "bytes": sum(u.nbytes for u in sent) + sum(tensor_nbytes(v) for _, v in dense),
                "basis_bytes": basis_bytes,
                "payload_bytes": engine.last_sync["bytes"],
                "seconds": seconds,
                "match_seconds": match_seconds if match else None,
            }
        )
        if k in checkpoints:
            mean, worst = engine_drift(engine, policy, prompts)
            drifts.append({"syncs": k, "mean": mean, "max": worst})
    moved = logprob_gap(trainer_logprobs(policy, start), start.logprobs)
    out: dict = {"wire_dtype": dtype_name, "match_rounding": match, "steps": steps}
    for kind in ("with_bases", "coefficients"):
        rows = [r for r in syncs if r["kind"] == kind]
        last = rows[-1] if rows else {}
        out[kind] = {"syncs": len(rows), "bytes": last.get("bytes"), "payload_bytes": last.get("payload_bytes")}
        out[kind]["seconds_median"] = _median(rows, "seconds")
    return {
        **out,
        "match_seconds_median": _median(syncs, "match_seconds") if match else None,
        "drift": drifts,
        "drift_max": max(d["max"] for d in drifts),
        "policy_moved": {"mean": moved[0], "max": moved[1]},
        "each": _rounded(syncs, 4),
        "sparse_delta": sparse_rows or None,
    }


def sparse_row(rows: list[dict], optimizer: str, lr: float, each: bool = True) -> dict:
    """A ``sparse_delta_*_bf16`` row: per-step bytes (median over the steps; int32 indices + bf16 values) etc."""
    out = {
        "optimizer": optimizer,
        "lr": lr,
        "encoding": "int32 flat indices + bf16 values of the changed bf16 weights (6 bytes each)",
        "syncs": len(rows),
        "bytes_per_step": statistics.median(r["bytes"] for r in rows),
        "bitmask_bytes_per_step": statistics.median(r["bitmask_bytes"] for r in rows),
        "changed_fraction_median": statistics.median(r["changed_fraction"] for r in rows),
        "seconds_median": statistics.median(r["seconds"] for r in rows),
        "drift_max": max(r["drift_max"] for r in rows),
    }
    return {**out, "each": _rounded(rows, 6)} if each else out


def sparse_steps(path: str, name: str, lr: float, steps: int, run: dict, seed: int = 0) -> list[dict]:
    """``steps`` steps of AdamW or LoGRA from the model at ``path`` (fresh), each measured as a sparse bf16 sync."""
    import torch

    from benchmarks.sparse_delta import SparseDelta
    from logra_lightning.models import load_policy

    policy, _ = load_policy(path)
    params, opt = dict(policy.named_parameters()), make_optimizer(name, policy, lr, run)
    g, delta, rows = torch.Generator().manual_seed(seed), SparseDelta(params), []
    for _ in range(steps):
        lm_step(policy, opt, run, g)
        rows.append(delta.step(params))
    return rows


def measure(size: str, run: dict) -> dict:
    """Full syncs, then each wire format's low-rank syncs after real LoGRA steps, into one fresh engine; one size."""
    import torch

    torch.set_num_threads(run["threads"])
    from logra_lightning.models import load_policy
    from logra_lightning.rollout import VLLMEngineSpec
    from logra_lightning.sync.wire import tensor_nbytes

    tmp = tempfile.TemporaryDirectory(prefix="sync_cost_")
    path = build_model_dir(size, Path(tmp.name) / "model")
    policy, tok = load_policy(path)
    t0 = time.perf_counter()
    engine = VLLMEngineSpec(dtype="float32", kv_cache_space_gb=1, seed=0).build(path, policy, tok)
    start_seconds = time.perf_counter() - t0
    opt = make_optimizer("logra", policy, run["lr"], run)
    opt.record_updates = True
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, min(policy.config.vocab_size, 100), (8,), generator=g).tolist() for _ in range(2)]
    full = []
    for _ in range(run["full_syncs"]):
        t = time.perf_counter()
        engine.load_weights(policy.named_parameters())
        seconds = time.perf_counter() - t
        bytes_ = sum(map(tensor_nbytes, policy.parameters()))
        full.append({"bytes": bytes_, "payload_bytes": engine.last_sync["bytes"], "seconds": seconds})
    gap_full = engine_drift(engine, policy, prompts)
    steps = run["steps"][size]
    formats = {w: run_format(engine, policy, opt, w, steps, run, prompts, g, sparse=w == "float32") for w in FORMATS}
    engine.close()
    params_count = sum(p.numel() for p in policy.parameters())
    del opt, policy
    # The field's sparse bf16 deltas: of the LoGRA steps above (fp32 pass) and of AdamW's at the same lr and steps,
    # then a few steps of each at lower learning rates (only the sparse side: coefficient bytes do not depend on lr).
    sparse_logra = sparse_row(formats["float32"].pop("sparse_delta"), "LoGRA", run["lr"])
    sparse_adamw = sparse_row(sparse_steps(path, "adamw", run["lr"], steps, run), "AdamW", run["lr"])
    n = run["sweep_steps"]
    sweep = [
        {"lr": lr, "steps": n, **{o: sparse_row(sparse_steps(path, o, lr, n, run), o, lr, each=False) for o in OPTS}}
        for lr in run["sweep_lrs"]
    ]
    for f in formats.values():
        f.pop("sparse_delta", None)
    tmp.cleanup()
    full_bytes = full[-1]["bytes"]
    fp32, bf16 = formats["float32"], formats["bfloat16"]
    per_step = {
        wire: {str(G): (f["with_bases"]["bytes"] + (G - 1) * f["coefficients"]["bytes"]) / G / full_bytes for G in GAPS}
        for wire, f in formats.items()
        if f["with_bases"]["bytes"] is not None and f["coefficients"]["bytes"] is not None
    }
    coef_bf16 = bf16["coefficients"]["bytes"]
    sparse, bitmask = sparse_adamw["bytes_per_step"], sparse_adamw["bitmask_bytes_per_step"]
    info = engine.init_info
    engine_info = {"dtype": "float32", "sync_mode": info["mode"], "reload_modules": info["reload_modules"]}
    return {
        "params": params_count,
        "rank": run["rank"],
        "engine": {**engine_info, "start_seconds": round(start_seconds, 1)},
        "full_sync": {
            "bytes": full_bytes,
            "payload_bytes": full[-1]["payload_bytes"],
            "seconds_median": statistics.median(r["seconds"] for r in full),
            "seconds_each": [round(r["seconds"], 3) for r in full],
        },
        "lowrank_sync": {
            **fp32["with_bases"],
            "seconds_each": [r["seconds"] for r in fp32["each"] if r["kind"] == "with_bases"],
        },
        "bytes_ratio": fp32["with_bases"]["bytes"] / full_bytes,
        "coefficient_sync": {"float32": fp32["coefficients"], "bfloat16": bf16["coefficients"]},
        "coefficient_bytes_ratio": {
            w: formats[w]["coefficients"]["bytes"] / full_bytes for w in ("float32", "bfloat16")
        },
        "bytes_per_step_ratio": per_step,
        "wire_formats": formats,
        "logprob_gap_after_lowrank_syncs": {k: fp32["drift"][-1][k] for k in ("mean", "max", "syncs")},
        "logprob_gap_after_full_sync": {"mean": gap_full[0], "max": gap_full[1]},
        "sparse_delta_adamw_bf16": sparse_adamw,
        "sparse_delta_logra_bf16": sparse_logra,
        "coefficient_vs_sparse_adamw": {
            "coefficient_bf16_bytes": coef_bf16,
            "sparse_adamw_bytes_per_step": sparse,
            "ratio": coef_bf16 / sparse if sparse else None,
            "ratio_to_bitmask": coef_bf16 / bitmask if bitmask else None,
            "per_step_bf16_with_bases": {str(G): (bf16["with_bases"]["bytes"] + (G - 1) * coef_bf16) / G for G in GAPS},
            "target": SPARSE_TARGET,
            "met": bool(sparse and coef_bf16 <= SPARSE_TARGET * sparse),
            "bf16_full_bytes": params_count * 2,
        },
        "sparse_delta_lr_sweep": sweep,
    }


def _sync(header: str, kind: str, wire: str | None, digits: str) -> Col:
    """A cell "MB (× full), s" of one kind of sync."""

    def cell(r: dict) -> str:
        sync, ratio = (r[kind][wire], r["coefficient_bytes_ratio"][wire]) if wire else (r[kind], r["bytes_ratio"])
        return f"{format(sync['bytes'] / 1e6, digits)} MB ({ratio:.3f}), {num(sync['seconds_median'])} s"

    return Col(f"{header} (× full)", cell)


def _per_step(wire: str, gaps: list[int]) -> Col:
    name = "fp32" if wire == "float32" else "bf16"
    return Col(
        f"bytes per step {name}, G={'/'.join(map(str, gaps))} (× full)",
        lambda r: " / ".join(f"{r['bytes_per_step_ratio'][wire][str(G)]:.3f}" for G in gaps),
    )


def _sparse(key: str, name: str, seconds: bool) -> Col:
    def cell(r: dict) -> str:
        d = r[key]
        text = f"{d['bytes_per_step'] / 1e6:.2f} MB ({100 * d['changed_fraction_median']:.1f}% changed)"
        return text + (f", {d['seconds_median']:.2f} s" if seconds else "")

    return Col(f"sparse delta, {name}", cell)


SYNCS = [
    Col("size", "name"),
    Col("params (M)", lambda r: r["params"] / 1e6, ".1f"),
    Col("full sync", lambda r: f"{r['full_sync']['bytes'] / 1e6:.0f} MB, {r['full_sync']['seconds_median']:.2f} s"),
    _sync("with bases fp32", "lowrank_sync", None, ".1f"),
    _sync("coefficients fp32", "coefficient_sync", "float32", ".2f"),
    _sync("coefficients bf16", "coefficient_sync", "bfloat16", ".2f"),
]
DRIFT = [
    Col("size", "size"),
    Col("wire", "wire"),
    Col(
        "drift after N syncs (N: mean / max)",
        lambda f: "; ".join(f"{d['syncs']}: {d['mean']:.1e} / {d['max']:.1e}" for d in f["drift"]),
    ),
    Col("moved", lambda f: f["policy_moved"]["mean"], ".3f"),
    Col(
        "coefficient sync s",
        lambda f: (
            f"{num(f['coefficients']['seconds_median'])} s"
            + (f" (+{f['match_seconds_median']:.3f} s trainer)" if f.get("match_seconds_median") is not None else "")
        ),
    ),
]
SPARSE = [
    Col("size", "name"),
    Col("lr", lambda r: r["sparse_delta_adamw_bf16"]["lr"], ".0e"),
    Col("bf16 full", lambda r: f"{r['coefficient_vs_sparse_adamw']['bf16_full_bytes'] / 1e6:.0f} MB"),
    _sparse("sparse_delta_adamw_bf16", "AdamW", True),
    _sparse("sparse_delta_logra_bf16", "LoGRA", True),
    Col(
        "LoGRA coefficients bf16",
        lambda r: (
            f"{r['coefficient_vs_sparse_adamw']['coefficient_bf16_bytes'] / 1e6:.2f} MB, "
            f"{num(r['coefficient_sync']['bfloat16']['seconds_median'])} s"
        ),
    ),
    Col("coefficients / sparse AdamW", lambda r: r["coefficient_vs_sparse_adamw"]["ratio"], ".3f"),
    Col(f"target <= {SPARSE_TARGET}", lambda r: met(r["coefficient_vs_sparse_adamw"]["met"])),
]
SWEEP = [
    Col("size", "size"),
    Col("lr", "lr", ".0e"),
    _sparse("adamw", "AdamW", False),
    _sparse("logra", "LoGRA", False),
    Col("LoGRA coefficients bf16", lambda p: f"{p['coef'] / 1e6:.2f} MB"),
    Col("ratio", "ratio", ".3f"),
    Col(f"target <= {SPARSE_TARGET}", lambda p: "–" if p["ratio"] is None else met(p["ratio"] <= SPARSE_TARGET)),
]


@bench("sync_cost", title="Weight sync to vLLM", quick=[], full=[], variants=("sync_cost_25m", "sync_cost_400m"))
class SyncCost(Benchmark):
    isolate = True  # one engine per process

    flags = dict.fromkeys(("sizes",))

    def settings(self, args) -> dict:
        sizes = [QUICK_SIZE] if args.quick else (args.sizes or list(SIZES))
        unknown = sorted(set(sizes) - set(SIZES) - {QUICK_SIZE})
        if unknown:
            raise SystemExit(f"unknown --sizes {unknown} (allowed: {', '.join(SIZES)})")
        import torch
        import vllm

        run = QUICK if args.quick else FULL
        return {
            "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "python": platform.python_version()},
            "torch_threads": run["threads"],
            "run": run,
            "gaps": list(GAPS),
            "shapes": {
                s: "build_tiny_model default (TinyModelConfig)" if s == QUICK_SIZE else shape_config(s) for s in sizes
            },
            "headline_size": HEADLINE if HEADLINE in sizes else sizes[0],
        }

    def row_names(self, args, settings: dict) -> list[str]:
        return list(settings["shapes"])

    def measure(self, name: str, settings: dict) -> dict:
        return measure(name, settings["run"])

    def section(self, res: dict) -> list[str]:
        """Bytes and seconds per sync (full, with bases, coefficients), bytes per step, drift per wire format."""
        st, rows = res["settings"], [flat(r) for r in res["rows"]]
        run, ok = st["run"], [r for r in rows if r["ok"]]
        head = (
            command_head(res) + f" Rank {run['rank']}, `update_proj_gap` {run['update_proj_gap']} during the run (so "
            f"that refreshes happen), LoGRA steps per wire format {json.dumps(run['steps'])}, versions "
            f"{json.dumps(st['versions'])}; fp32 engine (vLLM CPU build) keeping each matrix's basis, one engine per "
            'size in its own process. "with bases": a sync after a basis refresh (both factors); "coefficients": the '
            "other syncs (the engine holds the basis). Bytes per step: one sync with bases and `G - 1` with "
            f"coefficients per refresh period `G` ({', '.join(map(str, st['gaps']))})."
        )
        if st.get("merged"):  # rows measured by separate calls, each with its own command and load
            calls = [
                f"{r['name']}: `{r.get('command', '?')}`, {r.get('wall_seconds', 0):.0f} s, load at start "
                f"{load_text(r.get('load_start'))}"
                for r in rows
            ]
            head += " Sizes measured by separate calls: " + "; ".join(calls) + "."
        full = ", ".join(f"{r['name']} {r['logprob_gap_after_full_sync']['max']:.1e}" for r in ok)
        drift = [{"size": r["name"], "wire": w, **f} for r in ok for w, f in r["wire_formats"].items()]
        per_step = [_per_step(w, st["gaps"]) for w in ("float32", "bfloat16")]
        out = [head, "", *table(rows, SYNCS + per_step), ""]
        out += [
            "Engine-vs-trainer drift, |logprob| of sampled tokens (mean / max), after N low-rank syncs from a full "
            'sync; "moved": mean |logprob change| of the run\'s policy on the same tokens (how large the synced '
            "updates were). `bfloat16`: the trainer applies the rounded update too (`match_rounding=True`, the "
            f"default), `bfloat16_unmatched`: it does not. Full sync: drift {full} (max).",
            "",
            *table(drift, DRIFT),
            "",
        ]
        return out + _sparse_section([r for r in ok if "sparse_delta_adamw_bf16" in r])

    def plot(self, res: dict, plt):
        """Bytes and seconds per sync per size and kind; drift against the number of syncs per wire format."""
        rows = {f"{r['name']} (r={r['metrics']['rank']})": r["metrics"] for r in res["rows"] if r["ok"]}
        fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
        kinds = {
            "full": lambda r: r["full_sync"],
            "with bases": lambda r: r["lowrank_sync"],
            "coef fp32": lambda r: r["coefficient_sync"]["float32"],
            "coef bf16": lambda r: r["coefficient_sync"]["bfloat16"],
        }
        for ax, key, scale, title in (
            (axes[0], "bytes", 1e6, "MB sent per sync"),
            (axes[1], "seconds_median", 1.0, "seconds per sync (median)"),
        ):
            bars(
                ax, list(rows), list(kinds), lambda size, kind: (kinds[kind](rows[size])[key] or 0) / scale, title=title
            )
            ax.set_yscale("log")
        for i, (size, r) in enumerate(rows.items()):
            for wire, style in (("float32", "-"), ("bfloat16", "--"), ("bfloat16_unmatched", ":")):
                d = r["wire_formats"][wire]["drift"]
                xs, ys = [p["syncs"] for p in d], [max(p["max"], 1e-8) for p in d]
                axes[2].plot(xs, ys, style, marker="o", color=f"C{i}", label=f"{size.split()[0]} {wire}")
        axes[2].set_xscale("log", base=2)
        axes[2].set_yscale("log")
        axes[2].set_xlabel("low-rank syncs since the last full sync", fontsize=8)
        axes[2].set_title("max |engine - trainer| logprob", fontsize=9)
        axes[2].legend(fontsize=6, ncol=1)
        fig.suptitle(
            "Weight sync to a vLLM engine (fp32, CPU): full weights, factors with bases, coefficients only", fontsize=10
        )
        return fig

    def headline(self, results: dict[str, dict]) -> list[str]:
        """Bytes per step and seconds of a coefficient sync against a full one; against the field's sparse deltas."""
        res = results.get("sync_cost")
        s = res and next(
            (r["metrics"] for r in res["rows"] if r["name"] == res["settings"]["headline_size"] and r["ok"]), None
        )
        if not s:
            return []
        per_step = s["bytes_per_step_ratio"]["float32"]
        worst = max(per_step, key=per_step.get)
        out = [
            f"- Sync to vLLM, ~{s['params'] / 1e6:.0f}M model, rank {s['rank']}: a step's sync sends "
            f"**{per_step[worst]:.3f}×** the bytes of a full sync in fp32 "
            f"({s['bytes_per_step_ratio']['bfloat16'][worst]:.3f}× in bf16), averaged over a refresh period "
            f"({s['coefficient_sync']['float32']['seconds_median']:.2f} s vs "
            f"{s['full_sync']['seconds_median']:.2f} s per sync) ([table](#weight-sync-to-vllm))."
        ]
        c = s.get("coefficient_vs_sparse_adamw")
        if c:
            points = [(s["sparse_delta_adamw_bf16"]["lr"], c["ratio"])] + [
                (p["lr"], c["coefficient_bf16_bytes"] / p["adamw"]["bytes_per_step"])
                for p in s.get("sparse_delta_lr_sweep", [])
            ]
            out.append(
                f"- Against the field's sparse bf16 deltas (slime/verl/TRL), ~{s['params'] / 1e6:.0f}M: LoGRA's "
                f"coefficient sync sends {', '.join(f'**{r:.3f}×** at lr {lr:.0e}' for lr, r in points)} the bytes of "
                f"AdamW's sparse delta per step (target ≤ {c['target']}) ([table](#weight-sync-to-vllm))."
            )
        return out


def _sparse_section(sized: list[dict]) -> list[str]:
    """LoGRA's coefficient sync against the field's sparse bf16 deltas of AdamW's and LoGRA's steps."""
    if not sized:
        return []
    out = [
        "Against the field's lossless sync: sparse bitwise deltas of bf16 weights as slime, verl, TRL and NeMo-RL "
        "send them (`benchmarks/sparse_delta.py`: the int32 index and bf16 value of every bf16 weight whose bits "
        "changed, 6 bytes each; drift 0 by construction, checked bit for bit on a receiver copy), for AdamW's steps "
        "and for LoGRA's, at the run's learning rate and steps (median over the steps), next to LoGRA's "
        "coefficient sync in bf16 (a step between basis refreshes). Seconds: building and applying the patch "
        "in-process (no transport); LoGRA's: the real sync into vLLM.",
        "",
        *table(sized, SPARSE),
        "",
    ]
    sweep = []
    for r in sized:
        coef = r["coefficient_vs_sparse_adamw"]["coefficient_bf16_bytes"]
        for p in r.get("sparse_delta_lr_sweep", []):
            ratio = coef / p["adamw"]["bytes_per_step"] if p["adamw"]["bytes_per_step"] else None
            sweep.append({"size": r["name"], "coef": coef, "ratio": ratio, **p})
    if sweep:
        out += [
            "The sparse deltas shrink with the learning rate (a bf16 weight changes only when its update exceeds about "
            "|w|/256) while LoGRA's coefficient bytes do not depend on it; a few steps per learning rate from the "
            "same initial weights:",
            "",
            *table(sweep, SWEEP),
            "",
        ]
    return out


if __name__ == "__main__":  # vLLM starts its workers with spawn
    main(SyncCost)
