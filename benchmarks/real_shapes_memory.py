"""Memory at real shapes (issue 28): an RL step at Qwen2.5-0.5B's vocabulary, chunked floors, bf16-true LoGRA.

Each row is its own measurement in its own process; the script is resumable (rows already in the
results JSON are kept, ``--rows`` picks what to measure now), so every row can run alone under
``cpu-run bench``:

    .venv/bin/python -m benchmarks.real_shapes_memory --rows rl:logra_chunked    # one RL step, ~15-25 min
    .venv/bin/python -m benchmarks.real_shapes_memory --rows 100m:floor_chunked  # optimizer_memory.py rows
    .venv/bin/python -m benchmarks.real_shapes_memory --report                   # summary only, from the JSON

Rows:

* ``rl:<row>``: one RL-shaped step of a random-init model with Qwen2.5-0.5B's shape
  (``logra_lightning/models/shapes/qwen2.5-0.5b.json``: vocab 151,936, hidden 896, 24 layers,
  tied embeddings; built locally, nothing from a hub), fp32, activation checkpointing, 8 sequences
  of 128 prompt + 896 completion tokens (8 x 1,024 = 8,192 tokens), temperature 1.0. The step is
  what ``PolicyGradientModule`` runs, through the same functions: ``pi_old`` log-probs without grad
  (:func:`~logra_lightning.rl.logprobs.sequence_logprobs`), then per micro-batch the log-probs with
  grad and the entropy (:func:`~logra_lightning.rl.logprobs.token_logprobs`), ``grpo_loss``,
  backward, and the optimizer step. ``adamw_whole``: ``torch.optim.AdamW`` with the whole logits
  (``lm_head_chunk_size=None``, the path before issue 28), the whole batch in one micro-batch;
  ``adamw_chunked`` / ``logra_chunked``: the chunked LM head (512 tokens); ``floor_chunked``: no
  optimizer, chunked head, every gradient dropped in its hook; ``logra_budget``: LoGRA, chunked
  head, ``max_tokens_per_micro_batch=4096`` (two packed micro-batches of 4 sequences).
* ``<size>:<row>``: a row of ``benchmarks/optimizer_memory.py`` (``floor_chunked``,
  ``logra_chunked``, ``logra``, ``logra_bf16_stochastic``, ``logra_bf16_chunked``, ...) at the
  ~100M / ~400M shapes, measured by its own worker with its own settings (seq 128, batch 4,
  rank 64; bf16 rows one measured step after the warm-up, ``--bf16-steps``).

Memory of the ``rl:`` rows is peak RSS (``VmHWM``) minus RSS before the model is built, with glibc
and MKL set so that RSS follows live tensor bytes (``MALLOC_MMAP_THRESHOLD_=65536``,
``MKL_DISABLE_FAST_MM=1``, as ``plan_vs_measured.py``'s ``live`` setting): the quantity ``logra plan``
models (like ``torch.cuda.max_memory_allocated``), compared with its prediction for the same setting
(one process, fp32, ``--adamw-impl for-loop``, no reserve). The peak is also taken per phase
(``pi_old``, ``forward_backward``, ``optimizer``). A row that does not fit is not shrunk: the
worker runs with ``RLIMIT_DATA`` at this machine's available memory (at most 22 GiB of its 24),
so an allocation past it fails inside the worker, which records the phase and the error beside
the planner's number, instead of the kernel's OOM killer stopping other jobs.

Departures: the planner's whole-logits head is the issue-19 model (log-softmax without the
entropy); the RL step here computes the entropy too (epoch 0, as the module), which holds more.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time
import traceback
from pathlib import Path

from benchmarks.common import (
    RESULTS,
    ROOT,
    load_average,
    machine_info,
    proc_memory,
    reset_peak_rss,
    run_worker,
    write_result,
)
from benchmarks.report import MB, Report, clip, load_text, met, num
from benchmarks.report import rows_table as table

OUT = RESULTS / "real_shapes_memory.json"
SHAPE = "qwen2.5-0.5b"
RL = dict(rows=8, prompt=128, completion=896, rank=64, chunk=512, budget=4096, temperature=1.0, threads=2)
RL_ROWS = {
    "adamw_whole": dict(optimizer="adamw", chunk=None, budget=None),
    "adamw_chunked": dict(optimizer="adamw", chunk=RL["chunk"], budget=None),
    "logra_chunked": dict(optimizer="logra", chunk=RL["chunk"], budget=None),
    "floor_chunked": dict(optimizer="floor", chunk=RL["chunk"], budget=None),
    "logra_budget": dict(optimizer="logra", chunk=RL["chunk"], budget=RL["budget"]),
}
OPT_ROWS = {
    "100m": ["floor_chunked", "logra_chunked", "logra", "floor_nograd", "logra_bf16_stochastic", "logra_bf16_chunked"],
    "400m": ["floor_chunked", "logra_chunked"],
}
LIVE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MKL_DISABLE_FAST_MM": "1"}
MAX_LIMIT_GIB = 22.0
TARGETS = {"logra_over_floor_chunked_max": 1.10, "bf16_over_fp32_max": 0.6, "plan_error_max": 0.20}
GiB = 2**30


# ------------------------------------------------------------------------------------------ RL row
def _mem_available() -> int:
    return int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemAvailable"))) * 1024


def _rl_batch(vocab: int):
    import torch

    from logra_lightning.rl.loss import grpo_advantages
    from logra_lightning.rl.trajectory import Trajectory, pack_sequences

    gen = torch.Generator().manual_seed(0)
    n = RL["rows"]
    prompts = torch.randint(0, vocab, (n, RL["prompt"]), generator=gen).tolist()
    completions = torch.randint(0, vocab, (n, RL["completion"]), generator=gen).tolist()
    seqs = pack_sequences(prompts, completions, pad_id=0)
    rewards = (torch.rand(n, generator=gen) > 0.5).float()
    return seqs, lambda old: Trajectory(seqs, rewards, grpo_advantages(rewards, 4), old)


def rl_worker(row: str) -> dict:
    """One RL step of the Qwen2.5-0.5B shape; peak RSS per phase."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from logra_lightning.models.shapes import load_architecture  # noqa: F401  (imported before the baseline)
    from logra_lightning.optim import LoGRA, logra_param_groups
    from logra_lightning.rl.logprobs import sequence_logprobs, token_logprobs
    from logra_lightning.rl.loss import LossConfig, grpo_loss
    from logra_lightning.rl.micro_batches import plan_micro_batches

    spec = RL_ROWS[row]
    torch.set_num_threads(RL["threads"])
    fields = json.loads((ROOT / "logra_lightning/models/shapes" / f"{SHAPE}.json").read_text())
    fields = {k: v for k, v in fields.items() if not k.startswith("_") and k not in ("model_type", "torch_dtype")}
    fields["max_position_embeddings"] = RL["prompt"] + RL["completion"]
    seqs, trajectory = _rl_batch(fields["vocab_size"])
    packed = spec["budget"] is not None
    groups = plan_micro_batches(seqs.lengths.tolist(), max_tokens=spec["budget"], packed=packed)
    limit = int(min(MAX_LIMIT_GIB * GiB, _mem_available() - GiB // 2))
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    from benchmarks.plan_vs_measured import _warm_up_runtime

    _warm_up_runtime("adamw" if spec["optimizer"] == "adamw" else "logra")
    out: dict = {"row": row, "spec": spec, "micro_batches": [len(g) for g in groups], "rlimit_data_bytes": limit}
    out["load_before"] = load_average()
    gc.collect()
    reset_peak_rss()
    base = proc_memory()["VmRSS"]
    out["rss_before_model_bytes"] = base
    phases: dict[str, int] = {}
    phase = "build"
    start = time.perf_counter()
    try:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**fields, use_cache=False))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        out["params"] = sum(p.numel() for p in model.parameters())
        if spec["optimizer"] == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        elif spec["optimizer"] == "logra":
            opt = LoGRA(logra_param_groups(model, rank=RL["rank"], update_proj_gap=200), lr=1e-6)
        else:
            opt = None
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
        phases[phase] = proc_memory()["VmHWM"] - base
        times = {}
        for phase in ("pi_old", "forward_backward", "optimizer"):
            t0 = time.perf_counter()
            if phase == "pi_old":
                old = sequence_logprobs(model, seqs, groups, RL["temperature"], chunk_size=spec["chunk"], packed=packed)
                traj = trajectory(old)
            elif phase == "forward_backward":
                for rows in groups:
                    mb = traj.rows(torch.as_tensor(rows)).trimmed()
                    lp, ent = token_logprobs(
                        model, mb.seqs, RL["temperature"], entropy=True, chunk_size=spec["chunk"], packed=packed
                    )
                    loss, stats = grpo_loss(lp, mb, traj.num_tokens, LossConfig(), entropy=ent)
                    loss.backward()
                    del lp, ent, loss
                out["stats"] = stats
            elif opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            times[phase] = round(time.perf_counter() - t0, 1)
            phases[phase] = proc_memory()["VmHWM"] - base
            print(f"{row}: {phase} peak {phases[phase] / GiB:.2f} GiB after {times[phase]} s", flush=True)
        out.update(fits=True, seconds=times)
    except (RuntimeError, MemoryError) as e:  # an allocation past RLIMIT_DATA
        out.update(fits=False, failed_phase=phase, error=f"{type(e).__name__}: {e}"[:400])
        out["traceback_tail"] = traceback.format_exc()[-1200:]
    out["phase_peak_bytes"] = phases
    out["train_peak_bytes"] = proc_memory()["VmHWM"] - base
    out["wall_seconds"] = round(time.perf_counter() - start, 1)
    out["load_after"] = load_average()
    return out


def planned(row: str) -> dict:
    """``logra plan``'s numbers for an ``rl:`` row's setting."""
    from logra_lightning.models.shapes import load_architecture
    from logra_lightning.plan import PlanSetup, plan_optimizer

    spec = RL_ROWS[row]
    setup = PlanSetup(
        gpus=1,
        gpu_memory_gb=1024,
        rank=RL["rank"],
        batch=RL["rows"],
        seq_len=RL["prompt"] + RL["completion"],
        precision="fp32",
        activation_checkpointing=True,
        adamw_impl="for-loop",
        reserve_gb=0,
        lm_head_chunk=spec["chunk"] or 0,
        micro_batch_tokens=spec["budget"],
    )
    opt = "adamw" if spec["optimizer"] == "adamw" else "logra"
    result = plan_optimizer(load_architecture(SHAPE), setup, opt)
    flags = f"--lm-head-chunk {spec['chunk'] or 0}" + (
        f" --micro-batch-tokens {spec['budget']}" if spec["budget"] else ""
    )
    return {
        "peak_bytes": result["peak_bytes"],
        "peak_phase": result["peak_phase"],
        "command": f"logra plan --model {SHAPE} --gpus 1 --rank {RL['rank']} --batch {RL['rows']} --seq-len "
        f"{RL['prompt'] + RL['completion']} --precision fp32 --adamw-impl for-loop --reserve-gb 0 {flags}",
        "note": "no optimizer: the LoGRA plan (its state is < 1% of the peak)" if spec["optimizer"] == "floor" else "",
    }


# ----------------------------------------------------------------------------------------- driver
def _measure(key: str, args) -> dict:
    if key.startswith("rl:"):
        row = key.split(":", 1)[1]
        if row not in RL_ROWS:
            raise SystemExit(f"unknown row {key!r} (rl rows: {', '.join(RL_ROWS)})")
        out, err = run_worker(
            __file__, ["--worker", row], RESULTS / f".worker_real_{row}.json", env=LIVE_MALLOC, timeout=args.timeout
        )
        out = out or {"row": row, "fits": False, "error": err, "crashed": True}
        out["plan"] = planned(row)
        return out
    from benchmarks import optimizer_memory

    size, name = key.split(":", 1)
    steps = ["--steps", str(args.bf16_steps)] if "bf16" in name else []
    row, err = run_worker(
        optimizer_memory.__file__,
        ["--worker", name, "--worker-size", size, *steps],
        RESULTS / f".worker_real_{size}_{name}.json",
        timeout=args.timeout,
    )
    return row or {"name": name, "size": size, "ok": False, "error": err}


def summary(res: dict) -> dict:
    """The issue's summary and the targets, from whatever rows are measured."""
    rl, opt = res.get("rl", {}), res.get("optimizer_rows", {})

    def mb(row: dict | None) -> float | None:
        return None if not row or not row.get("fits", row.get("ok")) else round(row["train_peak_bytes"] / MB, 1)

    def ratio(a: str, b: str, size: str = "100m") -> float | None:
        x, y = opt.get(size, {}).get(a), opt.get(size, {}).get(b)
        ok = x and y and x.get("ok") and y.get("ok")
        return round(x["train_peak_bytes"] / y["train_peak_bytes"], 3) if ok else None

    out = {
        "shape": "Qwen2.5-0.5B (random init, vocab 151,936, hidden 896, 24 layers, tied), fp32, "
        "activation checkpointing",
        "tokens": RL["rows"] * (RL["prompt"] + RL["completion"]),
        "adamw_whole_logits_mb": mb(rl.get("adamw_whole")),
        "adamw_whole_logits_planned_mb": round(planned("adamw_whole")["peak_bytes"] / MB, 1),
        "logra_chunked_mb": mb(rl.get("logra_chunked")),
        "floor_chunked_mb": mb(rl.get("floor_chunked")),
        "adamw_chunked_mb": mb(rl.get("adamw_chunked")),
        "logra_budget_mb": mb(rl.get("logra_budget")),
        "logra_bf16_over_fp32_100m": ratio("logra_bf16_stochastic", "logra"),
        "logra_bf16_chunked_over_fp32_chunked_100m": ratio("logra_bf16_chunked", "logra_chunked"),
        "logra_over_floor_chunked_100m": ratio("logra_chunked", "floor_chunked"),
        "logra_over_floor_chunked_400m": ratio("logra_chunked", "floor_chunked", "400m"),
        "floor_chunked_100m_mb": mb(opt.get("100m", {}).get("floor_chunked")),
        "floor_chunked_400m_mb": mb(opt.get("400m", {}).get("floor_chunked")),
        "plan_error": {
            row: round(r["plan"]["peak_bytes"] / r["train_peak_bytes"] - 1, 3)
            for row, r in rl.items()
            if r.get("fits") and r.get("plan")
        },
    }
    return out


def section(res: dict) -> tuple[list[str], dict]:
    s, t = res["summary"], res["targets"]
    out = [
        f"Command: `{res['command']}` (one row per run, each alone on the machine); rows measured "
        f"{res.get('first_measured', '?')} to {res.get('last_measured', '?')}.",
        "",
        f"**One RL step at a real vocabulary** — {s['shape']}; {s['tokens']:,} tokens "
        f"({RL['rows']} x ({RL['prompt']} prompt + {RL['completion']} completion)), pi_old pass, "
        "loss with entropy, backward, optimizer step. Training memory = peak RSS over the step minus RSS "
        "before the model, with RSS following live tensor bytes; the planner's prediction beside it.",
        "",
    ]
    cells = []
    for row, r in res.get("rl", {}).items():
        phases = r.get("phase_peak_bytes", {})
        measured = num(r["train_peak_bytes"] / MB, ",.0f") if r.get("fits") else "does not fit"
        if not r.get("fits"):
            measured += f" ({r.get('failed_phase', '?')}: {clip(r.get('error', ''), 60)})"
        cells.append(
            [
                f"`{row}`",
                measured,
                num(r["plan"]["peak_bytes"] / MB, ",.0f"),
                num(r["plan"]["peak_bytes"] / r["train_peak_bytes"] - 1, "+.1%") if r.get("fits") else "–",
                " / ".join(num(phases.get(p, 0) / MB, ",.0f") if p in phases else "–" for p in PHASES),
                " / ".join(str(r.get("seconds", {}).get(p, "–")) for p in PHASES),
                load_text(r.get("load_before")),
            ]
        )
    out += table(
        [
            "row",
            "training MB",
            "planned MB",
            "plan error",
            "peak MB after pi_old / fwd+bwd / optimizer",
            "seconds per phase",
            "load at start",
        ],
        cells,
    ) + [""]
    opt = res.get("optimizer_rows", {})
    if opt:
        out += [
            "**Chunked floors and bf16-true LoGRA** (`benchmarks/optimizer_memory.py` rows, seq 128 x batch 4):",
            "",
        ]
        cells = []
        for size, rows in opt.items():
            for name, r in rows.items():
                ok = r.get("ok")
                cells.append(
                    [
                        size,
                        f"`{name}`",
                        num(r["train_peak_bytes"] / MB, ",.0f") if ok else "failed: " + clip(r.get("error", ""), 80),
                        num(r.get("step_time_s_median"), ".1f") if ok else "–",
                        load_text(r.get("load_before")),
                    ]
                )
        out += table(["size", "row", "training MB", "step s", "load at start"], cells) + [""]
    lines = []
    for key, size in (("logra_over_floor_chunked_100m", "~100M"), ("logra_over_floor_chunked_400m", "~400M")):
        if s.get(key) is not None:
            ok = s[key] <= t["logra_over_floor_chunked_max"]
            lines.append(f"LoGRA / `floor_chunked` at {size}: {s[key]:.3f}x (target <= 1.10x: {met(ok)})")
    if s.get("logra_bf16_over_fp32_100m") is not None:
        ok = s["logra_bf16_over_fp32_100m"] <= t["bf16_over_fp32_max"]
        extra = s.get("logra_bf16_chunked_over_fp32_chunked_100m")
        lines.append(
            f"bf16-true LoGRA / fp32 LoGRA at ~100M: {s['logra_bf16_over_fp32_100m']:.3f}x (target <= 0.6x: {met(ok)})"
            + (f"; both with the chunked head: {extra:.3f}x" if extra is not None else "")
        )
    for row, err in s.get("plan_error", {}).items():
        lines.append(f"Planner vs `rl:{row}`: {err:+.1%} (target within 20%: {met(abs(err) <= t['plan_error_max'])})")
    out += [f"- {x}" for x in lines] + [""]
    return out, s


PHASES = ("pi_old", "forward_backward", "optimizer")


def headline(found: dict) -> list[str]:
    s = found.get("real_shapes_memory")
    if not s or s.get("logra_chunked_mb") is None:
        return []
    whole = (
        f"{s['adamw_whole_logits_mb']:,.0f} MB"
        if s.get("adamw_whole_logits_mb")
        else "does not fit in this machine's memory (22 GiB of its 24; "
        f"planned {s['adamw_whole_logits_planned_mb']:,.0f} MB)"
    )
    return [
        f"- Real vocabulary (Qwen2.5-0.5B shape, one RL step of {s['tokens']:,} tokens): AdamW with whole logits "
        f"{whole}; LoGRA with the chunked LM head **{s['logra_chunked_mb']:,.0f} MB** "
        "([table](#memory-at-real-shapes))."
    ]


REPORTS = {"real_shapes_memory": Report("Memory at real shapes", section, None, headline)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    keys = [f"rl:{r}" for r in RL_ROWS] + [f"{s}:{r}" for s, rows in OPT_ROWS.items() for r in rows]
    ap.add_argument("--rows", nargs="*", default=[], help=f"rows to measure now (of {', '.join(keys)})")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per row")
    ap.add_argument("--bf16-steps", type=int, default=1, help="measured steps of the ~100M bf16 rows")
    ap.add_argument("--report", action="store_true", help="only rewrite the summary from the JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(rl_worker(args.worker)))
        return {}
    res = json.loads(OUT.read_text()) if OUT.exists() else {"rl": {}, "optimizer_rows": {}}
    for key in args.rows:
        print(f"measuring {key} (load {load_average()})", flush=True)
        row = _measure(key, args)
        row["measured_at"] = time.strftime("%Y-%m-%d %H:%M")
        row["command"] = f"python -m benchmarks.real_shapes_memory --rows {key}"
        if key.startswith("rl:"):
            res["rl"][key[3:]] = row
        else:
            size, name = key.split(":", 1)
            res["optimizer_rows"].setdefault(size, {})[name] = row
        print(json.dumps({k: row.get(k) for k in ("fits", "ok", "train_peak_bytes", "error")}), flush=True)
    stamps = [r["measured_at"] for r in res["rl"].values()] + [
        r["measured_at"] for rows in res["optimizer_rows"].values() for r in rows.values() if "measured_at" in r
    ]
    res.update(
        command="python -m benchmarks.real_shapes_memory --rows <row>",
        first_measured=min(stamps, default=None),
        last_measured=max(stamps, default=None),
        machine=machine_info(),
        run=RL,
        targets=TARGETS,
        summary=summary(res),
    )
    write_result(OUT, res)
    return res


if __name__ == "__main__":
    main()
