"""Training memory, optimizer state and step time: AdamW vs LoGRA vs GaLore / APOLLO / 8-bit AdamW.

Run (full: ~25M / ~100M / ~400M Qwen2-shaped models, ~15 min on a quiet machine, 30 min loaded):

    .venv/bin/python -m benchmarks.optimizer_memory
    .venv/bin/python -m benchmarks.optimizer_memory --sizes 100m          # the issue-3 acceptance shape only
    .venv/bin/python -m benchmarks.optimizer_memory --quick               # tiny shape, < 2 min (CI)
    .venv/bin/python -m benchmarks.optimizer_memory --sizes 100m --rows adamw logra --repeat 3 \
        --out benchmarks/results/optimizer_step_time.json                  # step time, rows interleaved A B A B ...

Model shapes are HF Qwen2 config fields in ``benchmarks/configs/qwen2-<size>.json`` (random
weights, tied embeddings, fp32, activation checkpointing on, ``use_cache=False``); the step is
a language-model loss on random tokens (seq 128, batch 4). Each row (size x optimizer) runs in
its own subprocess (``--worker``) so allocator state and peak RSS of one optimizer cannot leak
into another. A row that fails (peer not installed, no CPU kernel, ...) records its error
instead of disappearing. Memory is read from ``/proc/self/status``:

* ``rss_before_model``: VmRSS after imports and data, just before the model is built; the
  kernel's peak counter is reset there (``echo 5 > /proc/self/clear_refs``).
* ``train_peak``: the highest VmHWM over model build + every step, minus ``rss_before_model``
  (the issue-3 "training memory"); no sampling interval can miss a peak.
* ``steady_peak``: the same with the counter reset again after the warm-up step (optimizer
  state already allocated): the peak of a typical later step.

Byte counts: ``optimizer_state_bytes`` walks ``optimizer.state`` *including* Python objects
kept there (GaLore's and APOLLO's projector objects hold their projection matrices as
attributes) and the inner tensors of tensor subclasses (torchao's 8-bit state), each storage
once; ``optimizer_state_bytes_tensors`` is :func:`logra_lightning.optim.accounting.optimizer_state_bytes`
(plain tensors only), kept to show what a tensor-only walk misses for the peers.

Step time: median wall time of forward + backward + ``optimizer.step()`` over the measured
steps (the warm-up step, which includes LoGRA's step-0 refresh and lazy state allocation, is
reported separately), and the median process CPU time of the same span (``time.process_time``,
all threads), which moves less than wall time when other jobs share the cores. Ratios are to
AdamW of the same size in the same run. The load average is recorded per row.

Departures from the issue-3 wording:

1. 400M rows are a subset (AdamW, LoGRA, bitsandbytes 8-bit AdamW, floor) with 2 measured
   steps: one step takes ~40 s there, and the full row set would take an hour.
2. GaLore and APOLLO project attention/MLP matrices only (their usual setup; embeddings
   dense), LoGRA also projects the tied embedding (its default, ``logra_dense_embed`` shows
   the other choice).
3. Issue 18 compares LoGRA's training memory with ``floor_nograd``. On CPU LoGRA calls glibc's
   ``malloc_trim(0)`` in each gradient hook and at the end of ``step()`` (``logra.py`` choice 10),
   which also returns the pages the model's own forward/backward freed; ``floor_nograd_trim`` is
   the floor with the same calls, so ``train_peak_vs_floor_nograd_trim`` is the ratio without
   that advantage.
   ``logra_prev`` is LoGRA with the storage and allocator behaviour from before issue 18 (fp32
   bases and first moments, full second moment everywhere, no trim).
4. bf16 rows (issue 18, ~100M only; each row's ``precision``): ``logra_bf16_*`` and ``adamw_bf16``
   cast the model to bf16 (weights, grads and activations bf16; LoGRA's moments and bases as
   configured, AdamW's moments bf16); ``adamw_bf16_mixed`` keeps fp32 weights and runs forward and
   backward under ``torch.autocast("cpu", bfloat16)``. This CPU has no bf16 matrix instructions
   (no AVX512-BF16/AMX), so bf16 step times here say little about a GPU; memory does.
5. ``lora``: LoRA at LoGRA's rank (PEFT, every attention/MLP matrix, embeddings frozen); its
   ``param_bytes`` include the frozen base weights and the factors.
6. Chunked rows (issue 28: ``floor_chunked``, ``logra_chunked``, ``logra_bf16_chunked``) compute the
   same token-mean loss through :func:`logra_lightning.rl.logprobs.token_logprobs` with the chunked
   LM head (512-token blocks), so the logits never exist whole; ``floor_chunked`` is the floor
   for them (``train_peak_vs_floor_chunked``). They are recorded by
   ``benchmarks/real_shapes_memory.py`` (``benchmarks/results/real_shapes_memory.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

from benchmarks.common import (
    RESULTS,
    load_average,
    machine_info,
    proc_memory,
    reset_peak_rss,
    run_worker,
    shape_config,
    write_result,
)
from benchmarks.optimizer_rows import (
    BF16_ROWS,
    CHUNKED_LOSS,
    DESCRIPTION,
    PEER_MODULES,
    PRECISION,
    ROWS,
    deep_state_bytes,
    make_optimizer,
    tensor_only_state_bytes,
)
from benchmarks.report import GB, MB, Report, clip, load_text, num, pct
from benchmarks.report import rows_table as table

# One torch thread: on this shared 2-core machine a 2-thread step slowed down up to 20x whenever
# another job ran (OpenMP threads wait on each other), which made wall times of rows measured
# minutes apart incomparable; with one thread a step only loses its share of the CPU.
RUN = {
    "full": dict(seq=128, batch=4, rank=64, warmup=1, steps=5, threads=1),
    "quick": dict(seq=32, batch=2, rank=8, warmup=1, steps=3, threads=1),
}
RUN_OVERRIDES = {"400m": dict(steps=2)}
ROW_OVERRIDES = {row: dict(steps=2) for row in BF16_ROWS}  # bf16 steps take minutes on this CPU (departure 4)
LM_HEAD_CHUNK = 512  # tokens per block of the chunked rows (the module's default lm_head_chunk_size)
SIZES = {
    "full": {
        "25m": ROWS,
        "100m": ROWS + BF16_ROWS,
        "400m": [
            "adamw",
            "logra",
            "adamw8bit_bnb",
            "floor_nograd",
            "floor_nograd_trim",
            "floor_chunked",
            "logra_chunked",
        ],
    },
    "quick": {"quick": ROWS},
}
TARGETS = {
    "size": "100m",
    "row": "logra",
    "state_ratio_vs_adamw_max": 0.10,
    "train_memory_reduction_vs_adamw_min": 0.45,
    "step_time_ratio_vs_adamw_max": 1.15,
    "issue18_state_ratio_vs_adamw_max": 0.05,
    "issue18_train_peak_vs_floor_nograd_max": 1.10,
    "issue28_train_peak_vs_floor_chunked_max": 1.10,
}


def _build_model(cfg: dict, seq: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg, max_position_embeddings=seq, use_cache=False))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def worker(name: str, size: str, run: dict) -> dict:
    import torch

    torch.set_num_threads(run["threads"])
    from logra_lightning.optim import host_memory
    from logra_lightning.optim.accounting import grad_bytes, param_bytes

    cfg = shape_config(size)
    gen = torch.Generator().manual_seed(0)
    data = [
        torch.randint(0, cfg["vocab_size"], (run["batch"], run["seq"]), generator=gen)
        for _ in range(run["warmup"] + run["steps"])
    ]
    import importlib

    from transformers import Qwen2ForCausalLM  # noqa: F401  (model code imported before the baseline, like the peer)

    if name in PEER_MODULES:
        importlib.import_module(PEER_MODULES[name])
    if name in CHUNKED_LOSS:
        from logra_lightning.rl.logprobs import token_logprobs
        from logra_lightning.rl.trajectory import PackedBatch

    load_before = load_average()
    gc.collect()
    reset_peak_rss()
    rss_before = proc_memory()["VmRSS"]
    model = _build_model(cfg, run["seq"])
    if name == "lora":
        from logra_lightning.models.lora import LoRA

        model = LoRA(rank=run["rank"], alpha=2 * run["rank"]).attach(model)
    precision = PRECISION.get(name, "fp32")
    if precision == "bf16":
        model.to(torch.bfloat16)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    opt = make_optimizer(name, model, run["rank"])
    walls, cpus, opt_walls, warm_peak, grads_after_backward = [], [], [], 0, None
    for i, ids in enumerate(data):
        if i == run["warmup"]:
            warm_peak = proc_memory()["VmHWM"]
            reset_peak_rss()
        t0, c0 = time.perf_counter(), time.process_time()
        with autocast:
            if name in CHUNKED_LOSS:  # the same token-mean NLL, through the chunked head
                ones = torch.ones_like(ids)
                lp, _ = token_logprobs(
                    model, PackedBatch(ids, ones, ids[:, 1:], ones[:, 1:].float()), 1.0, chunk_size=LM_HEAD_CHUNK
                )  # [B, T-1]
                loss = -lp.mean()
            else:
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if grads_after_backward is None:
            grads_after_backward = grad_bytes(model)
        t1 = time.perf_counter()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
            if name == "floor_nograd_trim":
                host_memory.trim()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        opt_walls.append(time.perf_counter() - t1)
    steady_hwm = proc_memory()["VmHWM"]
    w = run["warmup"]
    return {
        "name": name,
        "size": size,
        "description": DESCRIPTION[name],
        "ok": True,
        "threads": run["threads"],
        "precision": precision,
        **(
            {"lost_updates": opt.lost_updates, "low_precision_updates": opt.low_precision_updates}
            if hasattr(opt, "lost_updates")
            else {}
        ),
        "params": sum(p.numel() for p in model.parameters()),
        "loss_last": float(loss.detach()),
        "param_bytes": param_bytes(model),
        "grad_bytes_after_backward": grads_after_backward,
        "optimizer_state_bytes": deep_state_bytes(opt) if opt is not None else 0,
        "optimizer_state_bytes_tensors": tensor_only_state_bytes(opt) if opt is not None else 0,
        "rss_before_model_bytes": rss_before,
        "train_peak_bytes": max(warm_peak, steady_hwm) - rss_before,
        "steady_peak_bytes": steady_hwm - rss_before,
        "first_step_time_s": walls[0],
        "step_time_s_median": statistics.median(walls[w:]),
        "step_cpu_s_median": statistics.median(cpus[w:]),
        "opt_step_time_s_median": statistics.median(opt_walls[w:]),
        "step_times_s": [round(t, 4) for t in walls],
        "load_before": load_before,
        "load_after": load_average(),
    }


def _run_row(name: str, size: str, quick: bool, timeout: float, threads: int | None = None) -> dict:
    args = (
        ["--worker", name, "--worker-size", size]
        + (["--quick"] if quick else [])
        + (["--threads", str(threads)] if threads else [])
    )
    row, err = run_worker(__file__, args, RESULTS / f".worker_{size}_{name}.json", timeout=timeout)
    return row or {"name": name, "size": size, "description": DESCRIPTION.get(name, ""), "ok": False, "error": err}


def _add_repeat(first: dict, row: dict) -> None:
    """Fold a repeat of a row into its first run: timings become medians over the repeats."""
    if not (first.get("ok") and row.get("ok")):
        first.setdefault("repeat_errors", []).append(row.get("error"))
        return
    if "repeats" not in first:
        first["repeats"] = [
            {k: first[k] for k in ("step_time_s_median", "step_cpu_s_median", "train_peak_bytes", "load_before")}
        ]
    first["repeats"].append(
        {k: row[k] for k in ("step_time_s_median", "step_cpu_s_median", "train_peak_bytes", "load_before")}
    )
    first["step_time_s_median"] = statistics.median(r["step_time_s_median"] for r in first["repeats"])
    first["step_cpu_s_median"] = statistics.median(r["step_cpu_s_median"] for r in first["repeats"])


def _add_ratios(rows: list[dict]) -> None:
    base = next((r for r in rows if r["name"] == "adamw" and r.get("ok")), None)
    for floor in ("floor_nograd", "floor_nograd_trim", "floor_chunked"):
        f = next((r for r in rows if r["name"] == floor and r.get("ok")), None)
        for r in rows:
            if f and r.get("ok"):
                r[f"train_peak_vs_{floor}"] = r["train_peak_bytes"] / f["train_peak_bytes"]
    for r in rows:
        if not (base and r.get("ok")):
            continue
        r["state_ratio_vs_adamw"] = r["optimizer_state_bytes"] / base["optimizer_state_bytes"]
        r["train_memory_reduction_vs_adamw"] = 1 - r["train_peak_bytes"] / base["train_peak_bytes"]
        r["steady_memory_reduction_vs_adamw"] = 1 - r["steady_peak_bytes"] / base["steady_peak_bytes"]
        r["step_time_ratio_vs_adamw"] = r["step_time_s_median"] / base["step_time_s_median"]
        r["step_cpu_ratio_vs_adamw"] = r["step_cpu_s_median"] / base["step_cpu_s_median"]


def _acceptance(sizes: dict[str, list[dict]]) -> dict | None:
    rows = {r["name"]: r for r in sizes.get(TARGETS["size"], [])}
    row = rows.get(TARGETS["row"])
    if not row or not row.get("ok") or "state_ratio_vs_adamw" not in row:
        return None
    return {
        "state_ratio_vs_adamw": row["state_ratio_vs_adamw"],
        "state_ratio_ok": row["state_ratio_vs_adamw"] <= TARGETS["state_ratio_vs_adamw_max"],
        "train_memory_reduction_vs_adamw": row["train_memory_reduction_vs_adamw"],
        "train_memory_ok": row["train_memory_reduction_vs_adamw"] >= TARGETS["train_memory_reduction_vs_adamw_min"],
        "step_time_ratio_vs_adamw": row["step_time_ratio_vs_adamw"],
        "train_peak_vs_floor_nograd": row.get("train_peak_vs_floor_nograd"),
        "train_peak_vs_floor_nograd_trim": row.get("train_peak_vs_floor_nograd_trim"),
        "issue18_state_ok": row["state_ratio_vs_adamw"] <= TARGETS["issue18_state_ratio_vs_adamw_max"],
        "issue18_peak_ok": (row.get("train_peak_vs_floor_nograd") or 9)
        <= TARGETS["issue18_train_peak_vs_floor_nograd_max"],
        "step_cpu_ratio_vs_adamw": row["step_cpu_ratio_vs_adamw"],
        "step_time_ok": row["step_time_ratio_vs_adamw"] <= TARGETS["step_time_ratio_vs_adamw_max"],
        "lowrank_grads_freed": row["grad_bytes_after_backward"] < row["param_bytes"] * 0.05,
    }


# The README sections and the plot of this script's results (benchmarks/report.py says how they are used).


def section(res: dict) -> tuple[list[str], dict]:
    """Per size, a table of every row against AdamW; the issue-3 and issue-18 targets and whether they were met."""
    out = [
        f"Command: `{res['command']}` — {res['wall_seconds']:.0f} s, load (1/5/15 min) at start "
        f"{load_text(res['load_start'])}, at end {load_text(res['load_end'])}. "
        f"Run settings: `{json.dumps(res['run'])}`.",
        "",
    ]
    for size, rows in res["sizes"].items():
        params = next((r["params"] for r in rows if r.get("ok")), None)
        out += [
            f"**{size}** ({num(params / 1e6 if params else None, '.1f')}M params, shape "
            f"`benchmarks/configs/qwen2-{size}.json`)",
            "",
        ]
        cells = []
        for r in rows:
            if not r.get("ok"):
                cells.append([r["name"], "failed: " + clip(r.get("error", ""), 160)] + [""] * 11)
                continue
            cells.append(
                [
                    r["name"],
                    num(r["train_peak_bytes"] / MB, ".0f"),
                    pct(r.get("train_memory_reduction_vs_adamw")),
                    num(r["steady_peak_bytes"] / MB, ".0f"),
                    num(r["optimizer_state_bytes"] / MB, ".1f"),
                    pct(r.get("state_ratio_vs_adamw")),
                    num(r["grad_bytes_after_backward"] / MB, ".1f"),
                    num(r["step_time_s_median"], ".2f"),
                    num(r.get("step_time_ratio_vs_adamw"), ".2f"),
                    num(r.get("step_cpu_ratio_vs_adamw"), ".2f"),
                    num(r.get("train_peak_vs_floor_nograd"), ".3f"),
                    str(r.get("threads", res["run"]["threads"]))
                    + (f" ×{len(r['repeats'])}" if r.get("repeats") else ""),
                    load_text(r.get("load_before")),
                ]
            )
        out += table(
            [
                "row",
                "training MB",
                "vs AdamW",
                "steady MB",
                "state MB",
                "state / AdamW",
                "grads after bwd MB",
                "step s (median)",
                "time × AdamW",
                "CPU time × AdamW",
                "training × floor_nograd",
                "threads (× repeats)",
                "load at start",
            ],
            cells,
        ) + [""]
    out += ["Rows: " + "; ".join(f"`{r['name']}`: {r['description']}" for r in next(iter(res["sizes"].values()))), ""]
    acc = res.get("acceptance")
    if acc:
        t = res["targets"]
        out += [
            f"Issue-3 targets ({t['size']}, `{t['row']}`): "
            f"state ≤ {pct(t['state_ratio_vs_adamw_max'], 0)} of AdamW's → "
            f"{pct(acc['state_ratio_vs_adamw'])} ({'met' if acc['state_ratio_ok'] else 'missed'}); training memory "
            f"≥ {pct(t['train_memory_reduction_vs_adamw_min'], 0)} below AdamW → "
            f"{pct(acc['train_memory_reduction_vs_adamw'])} "
            f"({'met' if acc['train_memory_ok'] else 'missed'}); step time ≤ {t['step_time_ratio_vs_adamw_max']}× → "
            f"{acc['step_time_ratio_vs_adamw']:.2f}× wall, {acc['step_cpu_ratio_vs_adamw']:.2f}× CPU time "
            f"({'met' if acc['step_time_ok'] else 'missed'} on wall time; timings on a loaded machine are noisy, "
            f"see the load column).",
            "",
        ]
        if acc.get("train_peak_vs_floor_nograd") is not None:
            out += [
                f"Issue-18 targets ({t['size']}, `{t['row']}`): training memory ≤ "
                f"{t.get('issue18_train_peak_vs_floor_nograd_max', 1.10)}× `floor_nograd` → "
                f"{acc['train_peak_vs_floor_nograd']:.3f}× ({num(acc.get('train_peak_vs_floor_nograd_trim'), '.3f')}× "
                f"`floor_nograd_trim`); state ≤ {t.get('issue18_state_ratio_vs_adamw_max', 0.05)}× AdamW's → "
                f"{acc['state_ratio_vs_adamw']:.4f}×.",
                "",
            ]
    return out, acc or {}


def plot(res: dict, plt):
    """Training memory, optimizer state and step CPU time per row, one bar per size."""
    sizes = list(res["sizes"])
    names = list(dict.fromkeys(r["name"] for s in sizes for r in res["sizes"][s]))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    width = 0.8 / max(len(sizes), 1)
    metrics = [
        ("train_peak_bytes", "training memory (GB): peak RSS - RSS before model", GB),
        ("optimizer_state_bytes", "optimizer state (GB)", GB),
        ("step_cpu_ratio_vs_adamw", "step CPU time / AdamW's (median)", 1.0),
    ]
    for ax, (key, title, scale) in zip(axes, metrics):
        for i, size in enumerate(sizes):
            rows = {r["name"]: r for r in res["sizes"][size]}
            xs = [j + i * width for j in range(len(names))]
            vals = [
                rows[n][key] / scale if n in rows and rows[n].get("ok") and rows[n].get(key) is not None else 0.0
                for n in names
            ]
            ax.bar(xs, vals, width, label=size)
            for x, n in zip(xs, names):
                if n in rows and not rows[n].get("ok"):
                    ax.text(x, 0, "x", ha="center", va="bottom", color="red")
        ax.set_xticks([j + width * (len(sizes) - 1) / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        if key == "step_cpu_ratio_vs_adamw":
            ax.axhline(1.15, color="gray", ls="--", lw=0.8)
    axes[0].legend(title="model")
    fig.suptitle("Optimizer memory and speed (each row its own process; x = failed row)", fontsize=10)
    return fig


def headline(found: dict) -> list[str]:
    """The headline bullet: LoGRA's memory, state and step time against AdamW's (step times from the 1-thread pass)."""
    acc = found.get("optimizer_memory")
    timing = found.get("optimizer_step_time")
    if acc and timing:  # the interleaved 1-thread pass is the better step-time measurement under load
        acc = {**acc, **{k: timing[k] for k in ("step_time_ratio_vs_adamw", "step_cpu_ratio_vs_adamw")}}
    if not acc:
        return []

    def flag(ok: bool) -> str:
        return "target met" if ok else "**target missed**"

    return [
        f"- Training memory, ~100M model, LoGRA rank 64: **{pct(acc['train_memory_reduction_vs_adamw'])} below "
        f"AdamW** (≥ 45%: {flag(acc['train_memory_ok'])}); optimizer state **{pct(acc['state_ratio_vs_adamw'])}** "
        f"of AdamW's (≤ 10%: {flag(acc['state_ratio_ok'])}); step time **{acc['step_time_ratio_vs_adamw']:.2f}× "
        f"AdamW** wall, {acc['step_cpu_ratio_vs_adamw']:.2f}× in CPU time (≤ 1.15×: "
        f"{flag(acc['step_time_ratio_vs_adamw'] <= 1.15)}) ([table](#optimizer-memory-and-speed))."
    ]


REPORTS = {
    "optimizer_memory": Report("Optimizer memory and speed", section, plot, headline),
    "optimizer_step_time": Report("Step time: 1 thread, rows interleaved and repeated", section),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shape, all rows, < 2 min")
    ap.add_argument("--sizes", nargs="*", default=None, help="subset of the sizes (full: 25m 100m 400m)")
    ap.add_argument(
        "--rows", nargs="*", default=None, help=f"subset of {ROWS + BF16_ROWS} (default: each size's row set)"
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per row before it is recorded as failed")
    ap.add_argument(
        "--out", default=None, help="results JSON (default benchmarks/results/optimizer_memory[_quick].json)"
    )
    ap.add_argument("--merge", action="store_true", help="keep the other sizes already in the results JSON")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per row (default 1)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per row (default: RUN and its overrides)")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the row list this many times, interleaved (A B A B ...), for step times under drifting "
        "load: timings are medians over repeats, memory is the first run's",
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-size", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    if args.worker:
        run = {
            **RUN[mode],
            **RUN_OVERRIDES.get(args.worker_size, {}),
            **(ROW_OVERRIDES.get(args.worker, {}) if mode == "full" else {}),
        }
        run["threads"] = args.threads or run["threads"]
        run["steps"] = args.steps or run["steps"]
        try:
            row = worker(args.worker, args.worker_size, run)
        except Exception as e:  # recorded in the row, e.g. an optimizer without a CPU kernel
            row = {
                "name": args.worker,
                "size": args.worker_size,
                "description": DESCRIPTION.get(args.worker, ""),
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback_tail": traceback.format_exc()[-1500:],
            }
        Path(args.worker_out).write_text(json.dumps(row))
        return row
    plan = SIZES[mode]
    sizes = args.sizes or list(plan)
    started, load_start = time.time(), load_average()
    out = Path(args.out) if args.out else RESULTS / f"optimizer_memory{'_quick' if args.quick else ''}.json"
    earlier = json.loads(out.read_text())["sizes"] if args.merge and out.exists() else {}  # rows keep their own load
    command = "python -m benchmarks.optimizer_memory" + " ".join([""] + (argv if argv is not None else sys.argv[1:]))
    results: dict[str, list[dict]] = {}

    def save(complete: bool) -> dict:
        merged = {**earlier, **results}
        result = {
            "command": command,
            "complete": complete,
            "machine": machine_info(),
            "load_start": load_start,
            "load_end": load_average(),
            "wall_seconds": round(time.time() - started, 1),
            "run": {
                **RUN[mode],
                "threads": args.threads or RUN[mode]["threads"],
                "repeat": args.repeat,
                "overrides": {**RUN_OVERRIDES, **ROW_OVERRIDES} if mode == "full" else {},
                "dtype": "float32 unless the row's precision says otherwise",
                "activation_checkpointing": True,
                "tie_word_embeddings": True,
                "lr": 1e-5,
            },
            "shapes": {s: shape_config(s) for s in merged},
            "targets": TARGETS,
            "acceptance": _acceptance(merged),
            "sizes": merged,
        }
        write_result(out, result)
        return result

    for size in sizes:
        results[size] = []
        names = args.rows or plan.get(size, ROWS)
        for rep in range(args.repeat):
            for name in names:
                row = _run_row(name, size, args.quick, args.timeout, args.threads)
                print(
                    json.dumps(
                        {
                            k: row.get(k)
                            for k in (
                                "size",
                                "name",
                                "ok",
                                "train_peak_bytes",
                                "optimizer_state_bytes",
                                "step_time_s_median",
                                "error",
                            )
                        }
                    ),
                    flush=True,
                )
                if rep == 0:
                    results[size].append(row)
                else:
                    _add_repeat(next(r for r in results[size] if r["name"] == name), row)
                _add_ratios(results[size])
                save(complete=False)  # a long run killed midway keeps its finished rows
    result = save(complete=True)
    return result


if __name__ == "__main__":
    main()
