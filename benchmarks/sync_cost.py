"""Cost of keeping a vLLM engine in step with the trainer: low-rank factors vs full weights, per model size.

Run (full: the ~25M / ~100M / ~400M Qwen2 shapes of ``optimizer_memory.py``, rank 64, each size
in its own process; about 5 min on 2 cores):

    .venv/bin/python benchmarks/sync_cost.py
    .venv/bin/python benchmarks/sync_cost.py --sizes 100m     # one size
    .venv/bin/python benchmarks/sync_cost.py --quick          # the tiny test model, rank 8 (~1 min)

Per size, the trainer takes real LoGRA steps (rank r, every matrix low-rank, embeddings
included) on random tokens; after each step the applied update goes to a real ``VLLMEngine``
(fp32, CPU build here) as factors plus the dense params, exactly as
:class:`~logra_lightning.callbacks.weight_sync.LowRankWeightSync` sends it. Then a full sync
of every parameter is timed for comparison. Reported per sync: bytes handed to the engine
(tensor payload; ``payload_bytes`` adds safetensors framing), wall seconds (serialize + RPC +
the worker applying it, which on vLLM's CPU backend includes rebuilding the repacked weights
of every changed module), and the drift: mean/max ``|engine - trainer|`` logprob of tokens
the engine sampled after the last low-rank sync. A size that fails is recorded with its error.
Results go to ``benchmarks/results/sync_cost[_quick].json`` (``headline_size``: the row the
README headline quotes).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import RESULTS, load_average, run_worker, shape_config, write_result  # noqa: E402
from benchmarks.report import MB, Report, clip, load_text, num, table  # noqa: E402

SIZES = ("25m", "100m", "400m")
HEADLINE = "100m"
RUN = {"full": dict(rank=64, steps=3, full_syncs=2, batch=2, seq=32, threads=2),
       "quick": dict(rank=8, steps=3, full_syncs=2, batch=4, seq=16, threads=1)}  # fmt: skip
QUICK_SIZE = "tiny"  # build_tiny_model: the test model and char tokenizer


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
    cfg = Qwen2Config(**fields, max_position_embeddings=256, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, torch_dtype="float32")  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


def drift(engine, policy, prompts, n: int = 4) -> tuple[float, float]:
    """Mean / max ``|engine - trainer|`` logprob of ``n`` sampled 16-token completions per prompt."""
    import torch

    from logra_lightning.rollout import SamplingConfig

    out = engine.generate(prompts, n=n, sampling=SamplingConfig(max_new_tokens=16, temperature=1.0, seed=0))
    diffs = []
    with torch.no_grad():
        for i, (ids, lps) in enumerate(zip(out.completion_ids, out.logprobs)):
            prompt = out.prompt_ids[i // n]
            logits = policy(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)  # [T]
            diffs.append((torch.tensor(lps) - ref).abs())
    d = torch.cat(diffs)
    return d.mean().item(), d.max().item()


def measure(size: str, run: dict) -> dict:
    """Low-rank syncs after real LoGRA steps, then full syncs, into one fresh engine; one size."""
    import torch

    torch.set_num_threads(run["threads"])
    from logra_lightning.models import load_policy
    from logra_lightning.optim import LoGRA
    from logra_lightning.rollout import VLLMEngineSpec
    from logra_lightning.sync_wire import tensor_nbytes

    tmp = tempfile.TemporaryDirectory(prefix="sync_cost_")
    path = build_model_dir(size, Path(tmp.name) / "model")
    policy, tok = load_policy(path)
    t0 = time.perf_counter()
    engine = VLLMEngineSpec(dtype="float32", kv_cache_space_gb=1, seed=0).build(path, policy, tok)
    start_seconds = time.perf_counter() - t0
    opt = LoGRA(list(policy.named_parameters()), lr=1e-3, weight_decay=0.01, rank=run["rank"], update_proj_gap=200)
    opt.record_updates = True
    dense_names = set(opt.dense_param_names())
    params = dict(policy.named_parameters())
    g = torch.Generator().manual_seed(0)
    vocab = policy.config.vocab_size
    prompts = [torch.randint(3, min(vocab, 100), (8,), generator=g).tolist() for _ in range(2)]

    engine.load_weights(policy.named_parameters())  # start in step
    lowrank = []
    for _ in range(run["steps"]):
        ids = torch.randint(0, vocab, (run["batch"], run["seq"]), generator=g)
        policy(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        updates = [u for step in opt.pop_applied_updates() for u in step]
        dense = [(n, params[n].detach()) for n in dense_names]
        t = time.perf_counter()
        engine.apply_lowrank_updates(updates, dense)
        seconds = time.perf_counter() - t
        sent = sum(u.nbytes for u in updates) + sum(tensor_nbytes(v) for _, v in dense)
        lowrank.append({"bytes": sent, "payload_bytes": engine.last_sync["bytes"], "seconds": seconds})
    gap_lowrank = drift(engine, policy, prompts)
    full = []
    for _ in range(run["full_syncs"]):
        t = time.perf_counter()
        engine.load_weights(policy.named_parameters())
        full.append({"bytes": sum(map(tensor_nbytes, policy.parameters())),
                     "payload_bytes": engine.last_sync["bytes"], "seconds": time.perf_counter() - t})  # fmt: skip
    gap_full = drift(engine, policy, prompts)
    engine.close()
    tmp.cleanup()
    return {
        "ok": True, "params": sum(p.numel() for p in policy.parameters()), "rank": run["rank"],
        "engine": {"dtype": "float32", "sync_mode": engine.init_info["mode"],
                   "reload_modules": engine.init_info["reload_modules"], "start_seconds": round(start_seconds, 1)},
        "lowrank_sync": {"bytes": lowrank[-1]["bytes"], "payload_bytes": lowrank[-1]["payload_bytes"],
                         "seconds_median": statistics.median(r["seconds"] for r in lowrank),
                         "seconds_each": [round(r["seconds"], 3) for r in lowrank]},
        "full_sync": {"bytes": full[-1]["bytes"], "payload_bytes": full[-1]["payload_bytes"],
                      "seconds_median": statistics.median(r["seconds"] for r in full),
                      "seconds_each": [round(r["seconds"], 3) for r in full]},
        "bytes_ratio": lowrank[-1]["bytes"] / full[-1]["bytes"],
        "logprob_gap_after_lowrank_syncs": {"mean": gap_lowrank[0], "max": gap_lowrank[1], "syncs": run["steps"]},
        "logprob_gap_after_full_sync": {"mean": gap_full[0], "max": gap_full[1]},
    }  # fmt: skip


def _run_size(size: str, quick: bool) -> dict:
    """``measure(size)`` in a fresh process (one engine per process); a failure becomes an error row."""
    t0 = time.perf_counter()
    row, err = run_worker(__file__, ["--worker", size] + (["--quick"] if quick else []), RESULTS / f".sync_worker_{size}.json")
    return {**(row or {"ok": False, "error": err}), "wall_seconds": round(time.perf_counter() - t0, 1)}


# The README section and the plot of this script's results (benchmarks/report.py says how they are used).


def section(res: dict) -> tuple[list[str], dict]:
    """Low-rank vs full sync per model size; the headline size's row is what the headline quotes."""
    out = [f"Command: `{res['command']}` — {res['wall_seconds']:.0f} s, load at start {load_text(res['load_start'])}, at end "
           f"{load_text(res['load_end'])}. Run `{json.dumps(res['run'])}`, versions {json.dumps(res['versions'])}; fp32 engine "
           "(vLLM CPU build), one engine per size in its own process.", ""]  # fmt: skip
    rows = []
    for size, r in res["sizes"].items():
        if not r["ok"]:
            rows.append([size, "failed: " + clip(r["error"], 160)] + [""] * 8)
            continue
        lo, full, gap = r["lowrank_sync"], r["full_sync"], r["logprob_gap_after_lowrank_syncs"]
        rows.append([size, num(r["params"] / 1e6, ".1f"), str(r["rank"]), num(lo["bytes"] / MB, ".1f"),
                     num(full["bytes"] / MB, ".1f"), f"**{r['bytes_ratio']:.3f}**", num(lo["seconds_median"], ".2f"),
                     num(full["seconds_median"], ".2f"), f"{gap['mean']:.1e} / {gap['max']:.1e}",
                     num(r["engine"]["start_seconds"], ".0f")])  # fmt: skip
    out += table(["size", "params (M)", "rank", "low-rank MB", "full MB", "bytes ratio", "low-rank s (median)",
                  "full s (median)", f"logprob gap after {res['run']['steps']} low-rank syncs (mean / max)",
                  "engine start s"], rows) + [""]  # fmt: skip
    head = res["sizes"].get(res["headline_size"], {})
    return out, head if head.get("ok") else None


def plot(res: dict, plt):
    """Bytes and seconds per sync, low-rank vs full, per size."""
    rows = {size: r for size, r in res["sizes"].items() if r["ok"]}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    x, width = range(len(rows)), 0.38
    for ax, key, title in ((axes[0], "bytes", "MB sent per sync"), (axes[1], "seconds_median", "seconds per sync (median)")):
        scale = 1e6 if key == "bytes" else 1.0
        for i, (kind, label) in enumerate((("lowrank_sync", "low-rank"), ("full_sync", "full"))):
            ax.bar([j + (i - 0.5) * width for j in x], [r[kind][key] / scale for r in rows.values()], width,
                   label=label, color=f"C{i}")  # fmt: skip
        ax.set_xticks(list(x), [f"{size} (r={r['rank']})" for size, r in rows.items()])
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle("Weight sync to a vLLM engine (fp32, CPU): low-rank factors vs full weights", fontsize=10)
    return fig


def headline(found: dict) -> list[str]:
    """The headline bullet: bytes and seconds of a low-rank sync against a full one at the headline size."""
    s = found.get("sync_cost")
    if not s:
        return []
    return [f"- Sync to vLLM, ~{s['params'] / 1e6:.0f}M model, rank {s['rank']}: low-rank sends **{s['bytes_ratio']:.3f}×** "
            "the bytes of a full sync "
            f"({s['lowrank_sync']['seconds_median']:.2f} s vs {s['full_sync']['seconds_median']:.2f} s) "
            "([table](#weight-sync-to-vllm))."]  # fmt: skip


REPORTS = {"sync_cost": Report("Weight sync to vLLM", section, plot, headline)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny test model, rank 8")
    parser.add_argument("--sizes", nargs="*", default=None, help=f"subset of {', '.join(SIZES)}")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/sync_cost[_quick].json)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    run = RUN["quick" if args.quick else "full"]
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(measure(args.worker, run)))
        return {}
    sizes = [QUICK_SIZE] if args.quick else (args.sizes or list(SIZES))
    unknown = sorted(set(sizes) - set(SIZES) - {QUICK_SIZE})
    if unknown:
        raise SystemExit(f"unknown --sizes {unknown} (allowed: {', '.join(SIZES)})")
    import torch
    import vllm

    started, load_start = time.perf_counter(), load_average()
    rows = {}
    for size in sizes:
        rows[size] = _run_size(size, args.quick)
        r = rows[size]
        print(f"{size}: " + (f"low-rank {r['lowrank_sync']['bytes'] / 1e6:.1f} MB {r['lowrank_sync']['seconds_median']:.2f} s, "
                             f"full {r['full_sync']['bytes'] / 1e6:.1f} MB {r['full_sync']['seconds_median']:.2f} s"
                             if r["ok"] else f"FAILED {r['error'][-300:]}"), flush=True)  # fmt: skip
    result = {
        "command": "python benchmarks/sync_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "wall_seconds": round(time.perf_counter() - started, 1), "load_start": load_start, "load_end": load_average(),
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "python": platform.python_version()},
        "torch_threads": run["threads"], "run": run,
        "shapes": {s: ("build_tiny_model default (TinyModelConfig)" if s == QUICK_SIZE else shape_config(s)) for s in sizes},
        "headline_size": HEADLINE if HEADLINE in rows else sizes[0],
        "sizes": rows,
    }  # fmt: skip
    write_result(Path(args.out) if args.out else RESULTS / f"sync_cost{'_quick' if args.quick else ''}.json", result)
    return result


if __name__ == "__main__":  # vLLM starts its workers with spawn
    main()
