"""Training memory, optimizer state and step time: AdamW vs LoGRA vs GaLore / APOLLO / 8-bit AdamW.

Run (full: ~25M / ~100M / ~400M Qwen2-shaped models, ~15 min on a quiet machine, 30 min loaded):

    .venv/bin/python benchmarks/optimizer_memory.py
    .venv/bin/python benchmarks/optimizer_memory.py --sizes 100m          # the issue-3 acceptance shape only
    .venv/bin/python benchmarks/optimizer_memory.py --quick               # tiny shape, < 2 min (CI)
    .venv/bin/python benchmarks/optimizer_memory.py --sizes 100m --rows adamw logra --repeat 3 \
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
3. bf16 rows (issue 18; each row's ``precision``): ``logra_bf16_*`` and ``adamw_bf16`` cast the
   model to bf16 (weights, grads and activations bf16; LoGRA's moments and bases stay fp32,
   AdamW's moments are bf16); ``adamw_bf16_mixed`` keeps fp32 weights and runs forward and
   backward under ``torch.autocast("cpu", bfloat16)``. This CPU has no bf16 matrix instructions
   (no AVX512-BF16/AMX), so bf16 step times here say little about a GPU; memory does.
4. ``lora``: LoRA at LoGRA's rank (PEFT, every attention/MLP matrix, embeddings frozen); its
   ``param_bytes`` include the frozen base weights and the factors.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    RESULTS, load_average, machine_info, proc_memory, reset_peak_rss, run_worker, shape_config, write_result,
)  # fmt: skip

# One torch thread: on this shared 2-core machine a 2-thread step slowed down up to 20x whenever
# another job ran (OpenMP threads wait on each other), which made wall times of rows measured
# minutes apart incomparable; with one thread a step only loses its share of the CPU.
RUN = {"full": dict(seq=128, batch=4, rank=64, warmup=1, steps=5, threads=1),
       "quick": dict(seq=32, batch=2, rank=8, warmup=1, steps=3, threads=1)}  # fmt: skip
RUN_OVERRIDES = {"400m": dict(steps=2)}
ROWS = ["adamw", "logra", "logra_dense_embed", "logra_fullgrad", "galore", "apollo", "adamw8bit_bnb",
        "adamw8bit_torchao", "floor_grads", "floor_nograd",
        "logra_bf16_stochastic", "logra_bf16_kahan", "adamw_bf16_mixed", "adamw_bf16", "lora"]  # fmt: skip
# Rows whose weights are not fp32: "bf16" = the model cast to bf16 (no fp32 copy anywhere),
# "bf16-mixed" = fp32 weights with the forward under torch.autocast(bf16) (Lightning's bf16-mixed).
PRECISION = {"logra_bf16_stochastic": "bf16", "logra_bf16_kahan": "bf16", "adamw_bf16": "bf16",
             "adamw_bf16_mixed": "bf16-mixed"}  # fmt: skip
SIZES = {"full": {"25m": ROWS, "100m": ROWS, "400m": ["adamw", "logra", "adamw8bit_bnb", "floor_nograd"]},
         "quick": {"quick": ROWS}}  # fmt: skip
DESCRIPTION = {
    "adamw": "torch.optim.AdamW (dense fp32 grads + 2 moments)",
    "logra": "LoGRA rank r, sketch in backward, embeddings low-rank (default)",
    "logra_dense_embed": "LoGRA rank r, sketch in backward, embeddings/lm_head on dense AdamW",
    "logra_fullgrad": "LoGRA rank r, sketch_in_backward=False (full grads, projected in step)",
    "galore": "galore_torch.GaLoreAdamW rank r on attn/mlp, rest dense",
    "apollo": "apollo_torch.APOLLOAdamW rank r (random proj, channel scale) on attn/mlp, rest dense",
    "adamw8bit_bnb": "bitsandbytes.optim.AdamW8bit (block-wise 8-bit moments, CPU backend)",
    "adamw8bit_torchao": "torchao.optim.AdamW8bit (8-bit moments as tensor subclass, torch.compile'd step)",
    "floor_grads": "no optimizer: full grads materialized, then dropped after backward",
    "floor_nograd": "no optimizer: each grad dropped in its post-accumulate hook (lower bound)",
    "logra_bf16_stochastic": "LoGRA rank r on bf16 weights (no fp32 copy), update added with stochastic rounding",
    "logra_bf16_kahan": "LoGRA rank r on bf16 weights, update added with Kahan compensation (bf16 buffer in state)",
    "adamw_bf16_mixed": "torch.optim.AdamW on fp32 master weights, forward/backward under bf16 autocast",
    "adamw_bf16": "torch.optim.AdamW on bf16 weights (grads and moments bf16, round to nearest)",
    "lora": "LoRA (PEFT) rank r, alpha 2r, on every attention/MLP matrix; torch.optim.AdamW on the factors",
}
TARGETS = {"size": "100m", "row": "logra", "state_ratio_vs_adamw_max": 0.10,
           "train_memory_reduction_vs_adamw_min": 0.45, "step_time_ratio_vs_adamw_max": 1.15}  # fmt: skip


def _build_model(cfg: dict, seq: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg, max_position_embeddings=seq, use_cache=False))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _lowrank_linear_params(model):
    lowrank, rest = [], []
    for name, p in model.named_parameters():
        (lowrank if p.ndim == 2 and (".self_attn." in name or ".mlp." in name) else rest).append(p)
    return lowrank, rest


def make_optimizer(name: str, model, rank: int):
    """The optimizer of row ``name`` (``None`` for the no-optimizer floors)."""
    import torch

    from logra_lightning.optim import LoGRA, logra_param_groups

    hp = dict(lr=1e-5, weight_decay=0.0)
    if name in ("adamw", "adamw_bf16_mixed", "adamw_bf16"):
        return torch.optim.AdamW(model.parameters(), **hp)
    if name == "lora":  # the adapter was attached in worker(); only the factors are trainable
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **hp)
    if name in ("logra_bf16_stochastic", "logra_bf16_kahan"):
        rule = name.rsplit("_", 1)[1]
        return LoGRA(logra_param_groups(model, rank=rank, update_proj_gap=200), bf16_update=rule, **hp)
    if name == "logra":
        return LoGRA(logra_param_groups(model, rank=rank, update_proj_gap=200), **hp)
    if name == "logra_dense_embed":
        groups = logra_param_groups(model, rank=rank, update_proj_gap=200, exclude=[r"embed_tokens", r"lm_head"])
        return LoGRA(groups, **hp)
    if name == "logra_fullgrad":
        return LoGRA(logra_param_groups(model, rank=rank, update_proj_gap=200), sketch_in_backward=False, **hp)
    if name == "galore":
        from galore_torch import GaLoreAdamW

        lowrank, rest = _lowrank_linear_params(model)
        return GaLoreAdamW(
            [{"params": rest}, {"params": lowrank, "rank": rank, "update_proj_gap": 200, "scale": 0.25,
                                "proj_type": "std"}], no_deprecation_warning=True, **hp)  # fmt: skip
    if name == "apollo":
        from apollo_torch import APOLLOAdamW

        lowrank, rest = _lowrank_linear_params(model)
        return APOLLOAdamW(
            [{"params": rest}, {"params": lowrank, "rank": rank, "proj": "random", "scale_type": "channel",
                                "scale": 1, "update_proj_gap": 200, "proj_type": "std"}], **hp)  # fmt: skip
    if name == "adamw8bit_bnb":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(model.parameters(), **hp)
    if name == "adamw8bit_torchao":
        from torchao.optim import AdamW8bit

        return AdamW8bit(model.parameters(), **hp)
    if name == "floor_nograd":
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
        return None
    if name == "floor_grads":
        return None
    raise ValueError(f"unknown row {name!r} (allowed: {', '.join(ROWS)})")


def deep_state_bytes(optimizer) -> int:
    """Bytes of every tensor reachable from ``optimizer.state``: through dicts, lists, plain objects'
    attributes (GaLore/APOLLO projectors) and tensor-subclass internals (torchao), each storage once."""
    import torch

    seen_storage: set[int] = set()
    seen_obj: set[int] = set()
    total = 0

    def visit(obj, depth: int) -> None:
        nonlocal total
        if depth > 8 or id(obj) in seen_obj:
            return
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
                names, _ = obj.__tensor_flatten__()
                for n in names:
                    visit(getattr(obj, n), depth + 1)
                return
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen_storage and storage.nbytes():
                seen_storage.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                visit(v, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for v in vars(obj).values():
                visit(v, depth + 1)

    visit(list(optimizer.state.values()), 0)
    return total


PEER_MODULES = {"galore": "galore_torch", "apollo": "apollo_torch", "adamw8bit_bnb": "bitsandbytes",
                "adamw8bit_torchao": "torchao.optim", "lora": "peft"}  # fmt: skip


def _tensor_only_state_bytes(opt) -> int | str:
    """:func:`~logra_lightning.optim.accounting.optimizer_state_bytes`, or its error (tensor subclasses)."""
    from logra_lightning.optim.accounting import optimizer_state_bytes

    try:
        return optimizer_state_bytes(opt)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"


def worker(name: str, size: str, run: dict) -> dict:
    import torch

    torch.set_num_threads(run["threads"])
    from logra_lightning.optim.accounting import grad_bytes, param_bytes

    cfg = shape_config(size)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg["vocab_size"], (run["batch"], run["seq"]), generator=gen)
            for _ in range(run["warmup"] + run["steps"])]  # fmt: skip
    import importlib

    from transformers import Qwen2ForCausalLM  # noqa: F401  (model code imported before the baseline, like the peer)

    if name in PEER_MODULES:
        importlib.import_module(PEER_MODULES[name])

    load_before = load_average()
    gc.collect()
    reset_peak_rss()
    rss_before = proc_memory()["VmRSS"]
    model = _build_model(cfg, run["seq"])
    if name == "lora":
        from logra_lightning.adapters import LoRA

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
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        opt_walls.append(time.perf_counter() - t1)
    steady_hwm = proc_memory()["VmHWM"]
    w = run["warmup"]
    return {
        "name": name, "size": size, "description": DESCRIPTION[name], "ok": True, "threads": run["threads"],
        "precision": precision,
        "params": sum(p.numel() for p in model.parameters()),
        "loss_last": float(loss.detach()),
        "param_bytes": param_bytes(model),
        "grad_bytes_after_backward": grads_after_backward,
        "optimizer_state_bytes": deep_state_bytes(opt) if opt is not None else 0,
        "optimizer_state_bytes_tensors": _tensor_only_state_bytes(opt) if opt is not None else 0,
        "rss_before_model_bytes": rss_before,
        "train_peak_bytes": max(warm_peak, steady_hwm) - rss_before,
        "steady_peak_bytes": steady_hwm - rss_before,
        "first_step_time_s": walls[0],
        "step_time_s_median": statistics.median(walls[w:]),
        "step_cpu_s_median": statistics.median(cpus[w:]),
        "opt_step_time_s_median": statistics.median(opt_walls[w:]),
        "step_times_s": [round(t, 4) for t in walls],
        **({"lost_updates": opt.lost_updates, "low_precision_updates": opt.low_precision_updates}
           if hasattr(opt, "lost_updates") else {}),
        "load_before": load_before, "load_after": load_average(),
    }  # fmt: skip


def _run_row(name: str, size: str, quick: bool, timeout: float, threads: int | None = None) -> dict:
    args = ["--worker", name, "--worker-size", size] + (["--quick"] if quick else []) + (["--threads", str(threads)] if threads else [])
    row, err = run_worker(__file__, args, RESULTS / f".worker_{size}_{name}.json", timeout=timeout)
    return row or {"name": name, "size": size, "description": DESCRIPTION.get(name, ""), "ok": False, "error": err}


def _add_repeat(first: dict, row: dict) -> None:
    """Fold a repeat of a row into its first run: timings become medians over the repeats."""
    if not (first.get("ok") and row.get("ok")):
        first.setdefault("repeat_errors", []).append(row.get("error"))
        return
    if "repeats" not in first:
        first["repeats"] = [{k: first[k] for k in ("step_time_s_median", "step_cpu_s_median", "train_peak_bytes", "load_before")}]
    first["repeats"].append({k: row[k] for k in ("step_time_s_median", "step_cpu_s_median", "train_peak_bytes", "load_before")})
    first["step_time_s_median"] = statistics.median(r["step_time_s_median"] for r in first["repeats"])
    first["step_cpu_s_median"] = statistics.median(r["step_cpu_s_median"] for r in first["repeats"])


def _add_ratios(rows: list[dict]) -> None:
    base = next((r for r in rows if r["name"] == "adamw" and r.get("ok")), None)
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
        "step_cpu_ratio_vs_adamw": row["step_cpu_ratio_vs_adamw"],
        "step_time_ok": row["step_time_ratio_vs_adamw"] <= TARGETS["step_time_ratio_vs_adamw_max"],
        "lowrank_grads_freed": row["grad_bytes_after_backward"] < row["param_bytes"] * 0.05,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shape, all rows, < 2 min")
    ap.add_argument("--sizes", nargs="*", default=None, help="subset of the sizes (full: 25m 100m 400m)")
    ap.add_argument("--rows", nargs="*", default=None, help=f"subset of {ROWS} (default: each size's row set)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per row before it is recorded as failed")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/optimizer_memory[_quick].json)")
    ap.add_argument("--merge", action="store_true", help="keep the other sizes already in the results JSON")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per row (default 1)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the row list this many times, interleaved (A B A B ...), for step times under drifting "
                         "load: timings are medians over repeats, memory is the first run's")  # fmt: skip
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-size", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    mode = "quick" if args.quick else "full"
    if args.worker:
        run = {**RUN[mode], **RUN_OVERRIDES.get(args.worker_size, {})}
        run["threads"] = args.threads or run["threads"]
        try:
            row = worker(args.worker, args.worker_size, run)
        except Exception as e:  # recorded in the row, e.g. an optimizer without a CPU kernel
            row = {"name": args.worker, "size": args.worker_size, "description": DESCRIPTION.get(args.worker, ""),
                   "ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback_tail": traceback.format_exc()[-1500:]}  # fmt: skip
        Path(args.worker_out).write_text(json.dumps(row))
        return row
    plan = SIZES[mode]
    sizes = args.sizes or list(plan)
    started, load_start = time.time(), load_average()
    out = Path(args.out) if args.out else RESULTS / f"optimizer_memory{'_quick' if args.quick else ''}.json"
    earlier = json.loads(out.read_text())["sizes"] if args.merge and out.exists() else {}  # rows keep their own load
    command = "python benchmarks/optimizer_memory.py" + " ".join([""] + (argv if argv is not None else sys.argv[1:]))
    results: dict[str, list[dict]] = {}

    def save(complete: bool) -> dict:
        merged = {**earlier, **results}
        result = {
            "command": command, "complete": complete, "machine": machine_info(),
            "load_start": load_start, "load_end": load_average(), "wall_seconds": round(time.time() - started, 1),
            "run": {**RUN[mode], "threads": args.threads or RUN[mode]["threads"], "repeat": args.repeat,
                    "overrides": RUN_OVERRIDES if mode == "full" else {}, "dtype": "float32 unless the row's precision says otherwise",
                    "activation_checkpointing": True, "tie_word_embeddings": True, "lr": 1e-5},
            "shapes": {s: shape_config(s) for s in merged},
            "targets": TARGETS,
            "acceptance": _acceptance(merged),
            "sizes": merged,
        }  # fmt: skip
        write_result(out, result)
        return result

    for size in sizes:
        results[size] = []
        names = args.rows or plan.get(size, ROWS)
        for rep in range(args.repeat):
            for name in names:
                row = _run_row(name, size, args.quick, args.timeout, args.threads)
                print(json.dumps({k: row.get(k) for k in ("size", "name", "ok", "train_peak_bytes", "optimizer_state_bytes",
                                                          "step_time_s_median", "error")}), flush=True)  # fmt: skip
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
