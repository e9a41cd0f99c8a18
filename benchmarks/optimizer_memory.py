"""Training memory, optimizer state and step time: AdamW vs LoGRA (and GaLore / APOLLO).

Run (full, ~100M Qwen2-shaped model, ~10 min on 2 cores):

    .venv/bin/python benchmarks/optimizer_memory.py
    .venv/bin/python benchmarks/optimizer_memory.py --quick      # tiny shapes, < 60 s (CI)

Each row runs in its own subprocess (``--worker NAME``) so allocator state and
peak RSS of one optimizer cannot leak into another. Memory is measured from
``/proc/self/status``:

* ``rss_before_model``: VmRSS after imports and data, just before the model is built;
  at that moment the peak counter is reset (``echo 5 > /proc/self/clear_refs``).
* ``train_peak``: VmHWM at the end of all steps minus ``rss_before_model``: the
  kernel's own high-water mark of resident memory over model build + every
  step (forward, backward, optimizer), so no sampling interval can miss a peak.
* ``steady_peak``: the same with the counter reset again after the warm-up step
  (optimizer state already allocated), i.e. the peak of a typical later step.

Step time is the median wall time of forward + backward + ``optimizer.step()``
over the measured steps (the warm-up step, which for LoGRA includes the
step-0 basis refresh, is reported separately). All rows use the same torch
thread count (2 in the full run, 1 in ``--quick``). Results go to
``benchmarks/results/optimizer_memory[_quick].json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FULL = dict(vocab=32000, hidden=768, layers=12, intermediate=2048, heads=12, kv_heads=4, seq=128, batch=4,
            rank=64, warmup=1, steps=4, threads=2)  # fmt: skip
QUICK = dict(vocab=256, hidden=64, layers=2, intermediate=128, heads=2, kv_heads=2, seq=32, batch=2,
             rank=8, warmup=1, steps=3, threads=1)  # fmt: skip
ROWS = ["adamw", "logra", "logra_dense_embed", "logra_fullgrad", "galore", "apollo", "floor_grads", "floor_nograd"]
DESCRIPTION = {
    "adamw": "torch.optim.AdamW (dense fp32 grads + 2 moments)",
    "logra": "LoGRA rank r, sketch in backward, embeddings low-rank (default)",
    "logra_dense_embed": "LoGRA rank r, sketch in backward, embeddings/lm_head on dense AdamW",
    "logra_fullgrad": "LoGRA rank r, sketch_in_backward=False (full grads, projected in step)",
    "galore": "galore_torch.GaLoreAdamW rank r on attn/mlp, rest dense",
    "apollo": "apollo_torch.APOLLOAdamW rank r (random proj, channel scale) on attn/mlp, rest dense",
    "floor_grads": "no optimizer: full grads materialized, then dropped after backward",
    "floor_nograd": "no optimizer: each grad dropped in its post-accumulate hook (lower bound)",
}


def _status() -> dict[str, int]:
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "VmHWM")):
            key, val = line.split(":")
            out[key] = int(val.split()[0]) * 1024
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _build_model(shape: dict):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=shape["seq"],
        tie_word_embeddings=True, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _lowrank_linear_params(model):
    lowrank, rest = [], []
    for name, p in model.named_parameters():
        (lowrank if p.ndim == 2 and (".self_attn." in name or ".mlp." in name) else rest).append(p)
    return lowrank, rest


def _make_optimizer(name: str, model, rank: int):
    import torch

    from logra_lightning.optim import LoGRA, logra_param_groups

    hp = dict(lr=1e-5, weight_decay=0.0)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), **hp)
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
                                "proj_type": "std"}], **hp)  # fmt: skip
    if name == "apollo":
        from apollo_torch import APOLLOAdamW

        lowrank, rest = _lowrank_linear_params(model)
        return APOLLOAdamW(
            [{"params": rest}, {"params": lowrank, "rank": rank, "proj": "random", "scale_type": "channel",
                                "scale": 1, "update_proj_gap": 200, "proj_type": "std"}], **hp)  # fmt: skip
    if name == "floor_nograd":
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
        return None
    if name == "floor_grads":
        return None
    raise ValueError(f"unknown row {name!r} (allowed: {', '.join(ROWS)})")


def worker(name: str, shape: dict) -> dict:
    import torch

    torch.set_num_threads(shape["threads"])
    from logra_lightning.optim.accounting import grad_bytes, optimizer_state_bytes, param_bytes

    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=gen)
            for _ in range(shape["warmup"] + shape["steps"])]  # fmt: skip
    import transformers  # noqa: F401  (imports before the baseline)

    gc.collect()
    _reset_peak()
    rss_before = _status()["VmRSS"]
    model = _build_model(shape)
    opt = _make_optimizer(name, model, shape["rank"])
    times, opt_times, grads_after_backward = [], [], None
    steady_peak = None
    for i, ids in enumerate(data):
        if i == shape["warmup"]:
            _reset_peak()
        t0 = time.perf_counter()
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
        t2 = time.perf_counter()
        times.append(t2 - t0)
        opt_times.append(t2 - t1)
    steady_peak = _status()["VmHWM"] - rss_before
    return {
        "name": name,
        "description": DESCRIPTION[name],
        "ok": True,
        "loss_last": float(loss.detach()),
        "param_bytes": param_bytes(model),
        "grad_bytes_after_backward": grads_after_backward,
        "optimizer_state_bytes": optimizer_state_bytes(opt) if opt is not None else 0,
        "rss_before_model_bytes": rss_before,
        "train_peak_bytes": None,  # filled below from the whole-run high-water mark
        "steady_peak_bytes": steady_peak,
        "first_step_time_s": times[0],
        "step_time_s_median": statistics.median(times[shape["warmup"]:]),
        "opt_step_time_s_median": statistics.median(opt_times[shape["warmup"]:]),
    }


def _worker_main(name: str, shape: dict, out: str) -> None:
    # The whole-run peak needs its own counter: a second process would double imports, so
    # the warm-up peak is read before the post-warm-up reset via a tiny wrapper.
    global _reset_peak
    first_peak = {}
    original = _reset_peak

    def reset_and_remember():
        st = _status()
        first_peak["hwm"] = st["VmHWM"]
        original()

    _reset_peak = original
    try:
        import torch  # noqa: F401

        # first reset (before the model) must not record; later resets record the warm-up peak
        calls = {"n": 0}

        def wrapped():
            calls["n"] += 1
            (original if calls["n"] == 1 else reset_and_remember)()

        _reset_peak = wrapped
        row = worker(name, shape)
        row["train_peak_bytes"] = max(first_peak.get("hwm", 0), _status()["VmHWM"]) - row["rss_before_model_bytes"]
    except Exception as e:  # recorded in the row, e.g. an optimizer that fails on CPU
        row = {"name": name, "description": DESCRIPTION.get(name, ""), "ok": False, "error": f"{type(e).__name__}: {e}"}
    Path(out).write_text(json.dumps(row))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes, < 60 s")
    ap.add_argument("--rows", nargs="*", default=None, help=f"subset of {ROWS}")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shape = QUICK if args.quick else FULL
    if args.worker:
        _worker_main(args.worker, shape, args.worker_out)
        return
    rows_wanted = args.rows or (ROWS if not args.quick else [r for r in ROWS if r not in ("galore", "apollo")])
    rows = []
    for name in rows_wanted:
        out = ROOT / "benchmarks" / "results" / f".worker_{name}.json"
        cmd = [sys.executable, __file__, "--worker", name, "--worker-out", str(out)] + (["--quick"] if args.quick else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if out.exists():
            row = json.loads(out.read_text())
            out.unlink()
        else:
            row = {"name": name, "ok": False, "error": f"worker exited {proc.returncode}: {proc.stderr[-2000:]}"}
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("name", "ok", "train_peak_bytes", "optimizer_state_bytes",
                                                  "step_time_s_median", "error")}), flush=True)  # fmt: skip
    base = next((r for r in rows if r["name"] == "adamw" and r.get("ok")), None)
    for r in rows:
        if base and r.get("ok"):
            r["state_ratio_vs_adamw"] = r["optimizer_state_bytes"] / base["optimizer_state_bytes"]
            r["train_memory_reduction_vs_adamw"] = 1 - r["train_peak_bytes"] / base["train_peak_bytes"]
            r["steady_memory_reduction_vs_adamw"] = 1 - r["steady_peak_bytes"] / base["steady_peak_bytes"]
            r["step_time_ratio_vs_adamw"] = r["step_time_s_median"] / base["step_time_s_median"]
    import torch

    result = {
        "command": "python benchmarks/optimizer_memory.py" + (" --quick" if args.quick else ""),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "python": platform.python_version(),
                    "torch_threads": shape["threads"]},  # fmt: skip
        "shape": {**shape, "dtype": "float32", "activation_checkpointing": True, "tie_word_embeddings": True},
        "targets": {"state_ratio_vs_adamw_max": 0.10, "train_memory_reduction_vs_adamw_min": 0.45,
                    "step_time_ratio_vs_adamw_max": 1.15},  # fmt: skip
        "rows": rows,
    }
    name = "optimizer_memory_quick.json" if args.quick else "optimizer_memory.json"
    path = ROOT / "benchmarks" / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
