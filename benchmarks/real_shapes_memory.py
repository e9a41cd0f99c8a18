"""Memory at real shapes (issue 28): an RL step at Qwen2.5-0.5B's vocabulary, chunked floors, bf16-true LoGRA.

Each row is its own measurement in its own process; the script is resumable (rows already in the
results file are kept, ``--rows`` picks what to measure now), so every row can run alone under
``cpu-run bench``:

    .venv/bin/python -m benchmarks.real_shapes_memory --rows rl/logra_chunked    # one RL step, ~15-25 min
    .venv/bin/python -m benchmarks.real_shapes_memory --rows 100m/floor_chunked  # optimizer_memory.py rows
    .venv/bin/python -m benchmarks.real_shapes_memory --quick                    # a tiny shape, ~1 min

Rows:

* ``rl/<row>``: one RL-shaped step of a random-init model with Qwen2.5-0.5B's shape (vocab 151,936,
  hidden 896, 24 layers, tied; built locally), fp32, activation checkpointing, 8 sequences of 128
  prompt + 896 completion tokens, through the functions ``PolicyGradientModule`` runs: ``pi_old``
  log-probs without grad, then per micro-batch log-probs with grad and entropy, ``grpo_loss``,
  backward, the optimizer step. ``adamw_whole``: AdamW with the whole logits (the path before issue
  28); ``adamw_chunked`` / ``logra_chunked``: the LM head in 512-token chunks; ``floor_chunked``: no
  optimizer, every gradient dropped in its hook; ``logra_budget``: ``max_tokens_per_micro_batch=4096``.
* ``<size>/<row>``: a row of ``optimizer_memory`` (``floor_chunked``, ``logra_bf16_chunked``, ...) at
  ~100M / ~400M with its own settings (bf16 rows: ``--bf16-steps`` measured steps).

The ``rl/`` rows run with glibc and MKL set so that RSS follows live tensor bytes (as
the archived ``plan_vs_measured``'s ``live`` setting), the quantity ``logra plan`` models; its prediction is beside
each row, and the peak is also taken per phase. A row that does not fit is not shrunk: the worker's
``RLIMIT_DATA`` is this machine's available memory (at most 22 GiB of 24), so an allocation past it
fails inside the worker, which records the phase and the error, instead of the OOM killer stopping
other jobs. ``--quick`` runs ``rl/logra_chunked``, ``rl/floor_chunked`` and ``quick/logra_chunked``
at a tiny shape (:data:`QUICK_SHAPE`), into ``.cache/bench_quick/``.

Departure: the planner's whole-logits head is the issue-19 model (log-softmax without the entropy);
the RL step here computes the entropy too (epoch 0, as the module), which holds more.
"""

from __future__ import annotations

import json
import resource
import time
import traceback

from benchmarks.common import ROOT, peak_rss, qwen2, rss_baseline
from benchmarks.harness import Benchmark, bench, flat, load, main, out_path
from benchmarks.report import MB, Col, command_head, met, num, table

SHAPE = "qwen2.5-0.5b"
QUICK_SHAPE = dict(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=True,
)
RUN = {
    "full": dict(rows=8, prompt=128, completion=896, rank=64, chunk=512, budget=4096, temperature=1.0, threads=2),
    "quick": dict(rows=2, prompt=16, completion=48, rank=8, chunk=32, budget=64, temperature=1.0, threads=1),
}
RL_ROWS = {  # optimizer, LM-head chunk (None: whole logits), token budget per micro-batch (None: one)
    "adamw_whole": ("adamw", None, None),
    "adamw_chunked": ("adamw", "chunk", None),
    "logra_chunked": ("logra", "chunk", None),
    "floor_chunked": ("floor", "chunk", None),
    "logra_budget": ("logra", "chunk", "budget"),
}
OPT_ROWS = {
    "100m": ["floor_chunked", "logra_chunked", "logra", "floor_nograd", "logra_bf16_stochastic", "logra_bf16_chunked"],
    "400m": ["floor_chunked", "logra_chunked"],
}
QUICK_ROWS = ["rl/logra_chunked", "rl/floor_chunked", "quick/logra_chunked"]
MAX_LIMIT_GIB = 22.0
TARGETS = {"logra_over_floor_chunked_max": 1.10, "bf16_over_fp32_max": 0.6, "plan_error_max": 0.20}
PHASES = ("pi_old", "forward_backward", "optimizer")
GiB = 2**30
# The rl/ rows' allocators: glibc serves every allocation >= 64 KiB with mmap and returns it to the OS when freed,
# and MKL's buffer cache is off, so RSS follows live tensor bytes (what the planner models, like
# torch.cuda.max_memory_allocated); with the default allocators freed heap chunks stay resident.
LIVE_BYTES = {"MALLOC_MMAP_THRESHOLD_": "65536", "MKL_DISABLE_FAST_MM": "1"}
TINY = {**QUICK_SHAPE, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "max_position_embeddings": 16}


def _spec(row: str, run: dict) -> dict:
    opt, chunk, budget = RL_ROWS[row]
    return {"optimizer": opt, "chunk": run[chunk] if chunk else None, "budget": run[budget] if budget else None}


def _fields(run: dict) -> dict:
    """Qwen2 config fields of the RL rows' shape (the real one, or :data:`QUICK_SHAPE` under ``--quick``)."""
    if run["rows"] != RUN["full"]["rows"]:
        fields = dict(QUICK_SHAPE)
    else:
        fields = json.loads((ROOT / "logra_lightning/models/shapes" / f"{SHAPE}.json").read_text())
        fields = {k: v for k, v in fields.items() if not k.startswith("_") and k not in ("model_type", "torch_dtype")}
    return {**fields, "max_position_embeddings": run["prompt"] + run["completion"]}


def _mem_available() -> int:
    return int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemAvailable"))) * 1024


def _rl_batch(vocab: int, run: dict):
    import torch

    from logra_lightning.rl.loss import grpo_advantages
    from logra_lightning.rl.trajectory import Trajectory, pack_sequences

    gen = torch.Generator().manual_seed(0)
    n = run["rows"]
    prompts = torch.randint(0, vocab, (n, run["prompt"]), generator=gen).tolist()
    completions = torch.randint(0, vocab, (n, run["completion"]), generator=gen).tolist()
    seqs = pack_sequences(prompts, completions, pad_id=0)
    rewards = (torch.rand(n, generator=gen) > 0.5).float()
    return seqs, lambda old: Trajectory(seqs, rewards, grpo_advantages(rewards, min(4, n)), old)


def warm_up_runtime(optimizer: str) -> None:
    """One RL-shaped step of a throwaway 2-layer model, with and without activation checkpointing, so lazily loaded
    code, kernels and autograd threads (~20-35 MB whatever the model size) are in the baseline, as a CUDA context
    would be."""
    import torch

    from logra_lightning.optim import LoGRA, logra_param_groups
    from logra_lightning.rl.logprobs import gather_logprobs

    for ckpt in (False, True):
        model = qwen2(TINY, checkpointing=ckpt)
        opt = (
            torch.optim.AdamW(model.parameters())
            if optimizer == "adamw"
            else LoGRA(logra_param_groups(model, rank=4), lr=1e-5)
        )
        ids = torch.randint(0, 64, (2, 16))
        logp = gather_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])  # [2, 15]
        (-(logp * torch.randn(2, 15)).mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def rl_worker(row: str, run: dict) -> dict:
    """One RL step of the shape; peak RSS per phase."""
    import torch

    from logra_lightning.models.shapes import load_architecture  # noqa: F401  (imported before the baseline)
    from logra_lightning.optim import LoGRA, logra_param_groups
    from logra_lightning.rl.logprobs import sequence_logprobs, token_logprobs
    from logra_lightning.rl.loss import LossConfig, grpo_loss
    from logra_lightning.rl.micro_batches import plan_micro_batches

    spec, RL = _spec(row, run), run
    torch.set_num_threads(RL["threads"])
    fields = _fields(run)
    seqs, trajectory = _rl_batch(fields["vocab_size"], run)
    packed = spec["budget"] is not None
    groups = plan_micro_batches(seqs.lengths.tolist(), max_tokens=spec["budget"], packed=packed)
    limit = int(min(MAX_LIMIT_GIB * GiB, _mem_available() - GiB // 2))
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    warm_up_runtime("adamw" if spec["optimizer"] == "adamw" else "logra")
    out: dict = {"row": row, "spec": spec, "micro_batches": [len(g) for g in groups], "rlimit_data_bytes": limit}
    base = rss_baseline()
    out["rss_before_model_bytes"] = base
    phases: dict[str, int] = {}
    phase = "build"
    start = time.perf_counter()
    try:
        model = qwen2(fields)
        out["params"] = sum(p.numel() for p in model.parameters())
        if spec["optimizer"] == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        elif spec["optimizer"] == "logra":
            opt = LoGRA(logra_param_groups(model, rank=RL["rank"], update_proj_gap=200), lr=1e-6)
        else:
            opt = None
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
        phases[phase] = peak_rss() - base
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
            phases[phase] = peak_rss() - base
            print(f"{row}: {phase} peak {phases[phase] / GiB:.2f} GiB after {times[phase]} s", flush=True)
        out.update(fits=True, seconds=times)
    except (RuntimeError, MemoryError) as e:  # an allocation past RLIMIT_DATA
        out.update(fits=False, failed_phase=phase, fit_error=f"{type(e).__name__}: {e}"[:400])
        out["traceback_tail"] = traceback.format_exc()[-1200:]
    out["phase_peak_bytes"] = phases
    out["train_peak_bytes"] = peak_rss() - base
    out["wall_seconds"] = round(time.perf_counter() - start, 1)
    return out


def planned(row: str, run: dict) -> dict:
    """``logra plan``'s numbers for an ``rl/`` row's setting."""
    from logra_lightning.models.shapes import architecture_from_config, load_architecture
    from logra_lightning.plan import PlanSetup, plan_optimizer

    spec, tokens = _spec(row, run), run["prompt"] + run["completion"]
    quick = run["rows"] != RUN["full"]["rows"]
    arch = (
        architecture_from_config({"model_type": "qwen2", **_fields(run)}, name="quick")
        if quick
        else load_architecture(SHAPE)
    )
    setup = PlanSetup(
        gpus=1,
        gpu_memory_gb=1024,
        rank=run["rank"],
        batch=run["rows"],
        seq_len=tokens,
        precision="fp32",
        activation_checkpointing=True,
        adamw_impl="for-loop",
        reserve_gb=0,
        lm_head_chunk=spec["chunk"] or 0,
        micro_batch_tokens=spec["budget"],
    )
    result = plan_optimizer(arch, setup, "adamw" if spec["optimizer"] == "adamw" else "logra")
    flags = f"--lm-head-chunk {spec['chunk'] or 0}" + (
        f" --micro-batch-tokens {spec['budget']}" if spec["budget"] else ""
    )
    return {
        "peak_bytes": result["peak_bytes"],
        "peak_phase": result["peak_phase"],
        "command": f"logra plan --model {SHAPE} --gpus 1 --rank {run['rank']} --batch {run['rows']} --seq-len {tokens} "
        f"--precision fp32 --adamw-impl for-loop --reserve-gb 0 {flags}",
        "note": "no optimizer: the LoGRA plan (its state is < 1% of the peak)" if spec["optimizer"] == "floor" else "",
    }


def summary(rows: dict[str, dict], run: dict) -> dict:
    """The issue's summary, from whatever rows are measured (``rows``: flat results rows by name)."""

    def mb(name: str) -> float | None:
        r = rows.get(name)
        return None if not r or not r["ok"] or r.get("fits") is False else round(r["train_peak_bytes"] / MB, 1)

    def ratio(a: str, b: str, size: str = "100m") -> float | None:
        x, y = rows.get(f"{size}/{a}"), rows.get(f"{size}/{b}")
        return round(x["train_peak_bytes"] / y["train_peak_bytes"], 3) if x and y and x["ok"] and y["ok"] else None

    stamps = [r["measured_at"] for r in rows.values() if "measured_at" in r]
    rl = {n[3:]: r for n, r in rows.items() if n.startswith("rl/")}
    return {
        "shape": "Qwen2.5-0.5B (random init, vocab 151,936, hidden 896, 24 layers, tied), fp32, activation "
        "checkpointing"
        if run["rows"] == RUN["full"]["rows"]
        else f"tiny Qwen2 {json.dumps(QUICK_SHAPE)}, fp32",
        "tokens": run["rows"] * (run["prompt"] + run["completion"]),
        **{f"{row}_mb": mb(f"rl/{row}") for row in ("logra_chunked", "floor_chunked", "adamw_chunked", "logra_budget")},
        "adamw_whole_logits_mb": mb("rl/adamw_whole"),
        "adamw_whole_logits_planned_mb": round(planned("adamw_whole", run)["peak_bytes"] / MB, 1),
        "logra_bf16_over_fp32_100m": ratio("logra_bf16_stochastic", "logra"),
        "logra_bf16_chunked_over_fp32_chunked_100m": ratio("logra_bf16_chunked", "logra_chunked"),
        "logra_over_floor_chunked_100m": ratio("logra_chunked", "floor_chunked"),
        "logra_over_floor_chunked_400m": ratio("logra_chunked", "floor_chunked", "400m"),
        "floor_chunked_100m_mb": mb("100m/floor_chunked"),
        "floor_chunked_400m_mb": mb("400m/floor_chunked"),
        "plan_error": {
            row: round(r["plan"]["peak_bytes"] / r["train_peak_bytes"] - 1, 3)
            for row, r in rl.items()
            if r["ok"] and r.get("fits") and r.get("plan")
        },
        "first_measured": min(stamps, default=None),
        "last_measured": max(stamps, default=None),
    }


def _measured(r: dict) -> str:
    if r.get("fits"):
        return num(r["train_peak_bytes"] / MB, ",.0f")
    return f"does not fit ({r.get('failed_phase', '?')}: {(r.get('fit_error') or '')[:60]})"


RL_COLS = [
    Col("row", lambda r: f"`{r['name'][3:]}`"),
    Col("training MB", _measured),
    Col("planned MB", lambda r: r["plan"]["peak_bytes"] / MB, ",.0f"),
    Col("plan error", lambda r: r["plan"]["peak_bytes"] / r["train_peak_bytes"] - 1 if r.get("fits") else None, "+.1%"),
    Col(
        "peak MB after pi_old / fwd+bwd / optimizer",
        lambda r: " / ".join(
            num(r["phase_peak_bytes"][p] / MB, ",.0f") if p in r["phase_peak_bytes"] else "–" for p in PHASES
        ),
    ),
    Col("seconds per phase", lambda r: " / ".join(str(r.get("seconds", {}).get(p, "–")) for p in PHASES)),
    Col("load at start", "load_before", "load"),
]
OPT_COLS = [
    Col("size", "size"),
    Col("row", lambda r: f"`{r['name'].split('/')[1]}`"),
    Col("training MB", lambda r: r["train_peak_bytes"] / MB, ",.0f"),
    Col("step s", "step_time_s_median", ".1f"),
    Col("load at start", "load_before", "load"),
]


@bench("real_shapes_memory", title="Memory at real shapes", quick=[])
class RealShapesMemory(Benchmark):
    isolate = True

    def add_arguments(self, ap) -> None:
        keys = [f"rl/{r}" for r in RL_ROWS] + [f"{s}/{r}" for s, rows in OPT_ROWS.items() for r in rows]
        ap.add_argument("--rows", nargs="*", default=[], help=f"rows to measure now (of {', '.join(keys)})")
        ap.add_argument("--bf16-steps", type=int, default=1, help="measured steps of the ~100M bf16 rows")

    def settings(self, args) -> dict:
        if args.quick:
            args.rows = args.rows or QUICK_ROWS
        return {"run": RUN["quick" if args.quick else "full"], "targets": TARGETS, "bf16_steps": args.bf16_steps}

    def worker_env(self, name: str, settings: dict) -> dict[str, str]:
        return LIVE_BYTES if name.startswith("rl/") else {}

    def measure(self, name: str, settings: dict) -> dict:
        from benchmarks import optimizer_memory

        where, row = name.split("/")
        if where == "rl":
            return {**rl_worker(row, settings["run"]), "plan": planned(row, settings["run"])}
        run = optimizer_memory.RUN["quick" if where == "quick" else "full"]
        return optimizer_memory.worker(
            row, where, {**run, **({"steps": settings["bf16_steps"]} if "bf16" in row else {})}
        )

    def run(self, args, settings: dict) -> list[dict]:
        """The rows of ``--rows``, measured now, beside the rows of the results file not measured again."""
        earlier = (load(out_path(self, args).stem, out_path(self, args).parent) or {}).get("rows", [])
        fresh = {}
        for name in args.rows:
            got = self.isolated(name, args)
            got["metrics"].update(
                measured_at=time.strftime("%Y-%m-%d %H:%M"), command=f"python -m benchmarks.{self.module} --rows {name}"
            )
            print(json.dumps({k: got[k] for k in ("name", "ok", "error")}), flush=True)
            fresh[name] = got
        return [r for r in earlier if r["name"] not in fresh] + list(fresh.values())

    def summarize(self, settings: dict, rows: list[dict]) -> dict:
        return summary({r["name"]: flat(r) for r in rows}, settings["run"])

    def section(self, res: dict) -> list[str]:
        s, t, run = res["summary"], res["settings"]["targets"], res["settings"]["run"]
        rows = [flat(r) for r in res["rows"]]
        out = [
            command_head(res) + f" One row per run, each alone on the machine; rows measured {s['first_measured']} to "
            f"{s['last_measured']}.",
            "",
            f"**One RL step at a real vocabulary** — {s['shape']}; {s['tokens']:,} tokens ({run['rows']} x "
            f"({run['prompt']} prompt + {run['completion']} completion)), pi_old pass, loss with entropy, backward, "
            "optimizer step. Training memory = peak RSS over the step minus RSS before the model, with RSS following "
            "live tensor bytes; the planner's prediction beside it.",
            "",
            *table([r for r in rows if r["name"].startswith("rl/")], RL_COLS),
            "",
        ]
        opt = [r for r in rows if not r["name"].startswith("rl/")]
        if opt:
            out += [
                "**Chunked floors and bf16-true LoGRA** (`benchmarks/optimizer_memory.py` rows, seq 128 x batch 4):",
                "",
            ]
            out += table(opt, OPT_COLS) + [""]
        lines = []
        for key, size in (("logra_over_floor_chunked_100m", "~100M"), ("logra_over_floor_chunked_400m", "~400M")):
            if s.get(key) is not None:
                ok = met(s[key] <= t["logra_over_floor_chunked_max"])
                lines.append(f"LoGRA / `floor_chunked` at {size}: {s[key]:.3f}x (target <= 1.10x: {ok})")
        if (bf16 := s.get("logra_bf16_over_fp32_100m")) is not None:
            extra = s.get("logra_bf16_chunked_over_fp32_chunked_100m")
            lines.append(
                f"bf16-true LoGRA / fp32 LoGRA at ~100M: {bf16:.3f}x "
                f"(target <= 0.6x: {met(bf16 <= t['bf16_over_fp32_max'])})"
                + (f"; both with the chunked head: {extra:.3f}x" if extra is not None else "")
            )
        for row, err in s.get("plan_error", {}).items():
            lines.append(
                f"Planner vs `rl:{row}`: {err:+.1%} (target within 20%: {met(abs(err) <= t['plan_error_max'])})"
            )
        return out + [f"- {x}" for x in lines] + [""]

    def headline(self, results: dict[str, dict]) -> list[str]:
        s = (results.get("real_shapes_memory") or {}).get("summary")
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


if __name__ == "__main__":
    main(RealShapesMemory)
