"""Cost of keeping a vLLM engine in step with the trainer: low-rank factors vs full weights.

Run (full, ~100M Qwen2-shaped model as in ``optimizer_memory.py``, a few minutes on 2 cores):

    .venv/bin/python benchmarks/sync_cost.py
    .venv/bin/python benchmarks/sync_cost.py --quick      # the tiny test model, rank 8 (~1 min)

The trainer takes real LoGRA steps (rank r, every matrix low-rank, embeddings included)
on random tokens; after each step the applied update goes to a real ``VLLMEngine``
(fp32, CPU build here) as factors plus the dense params, exactly as
:class:`~logra_lightning.callbacks.weight_sync.LowRankWeightSync` sends it. Then a full
sync of every parameter is timed for comparison. Reported per sync: bytes handed to the
engine (tensor payload; ``payload_bytes`` adds safetensors framing), wall seconds
(serialize + RPC + the worker applying it, which on vLLM's CPU backend includes rebuilding
the repacked weights of every changed module), and the drift: mean/max
``|engine - trainer|`` logprob of tokens the engine sampled after the last low-rank sync.
Results go to ``benchmarks/results/sync_cost[_quick].json``.
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

FULL = dict(vocab=32000, hidden=768, layers=12, intermediate=2048, heads=12, kv_heads=4, max_pos=256,
            rank=64, steps=3, full_syncs=2, batch=2, seq=32, threads=2, tie=True)  # fmt: skip
QUICK = dict(rank=8, steps=3, full_syncs=2, batch=4, seq=16, threads=1)


def build_model_dir(shape: dict, path: Path) -> str:
    """A randomly initialised Qwen2 of ``shape`` plus the char tokenizer (vLLM itself never tokenizes here)."""
    import torch
    from transformers import AutoModelForCausalLM

    from logra_lightning.models import build_char_tokenizer, build_tiny_model

    if "vocab" not in shape:
        return build_tiny_model(path)
    from transformers import Qwen2Config

    tok = build_char_tokenizer()
    cfg = Qwen2Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=shape["max_pos"], tie_word_embeddings=shape["tie"], eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return str(path)


def drift(engine, policy, prompts, n: int = 4) -> tuple[float, float]:
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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny test model, rank 8")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL

    import torch

    torch.set_num_threads(shape["threads"])
    import vllm

    from logra_lightning.models import load_policy
    from logra_lightning.optim import LoGRA
    from logra_lightning.rollout import VLLMEngineSpec

    tmp = tempfile.TemporaryDirectory(prefix="sync_cost_")
    path = build_model_dir(shape, Path(tmp.name) / "model")
    policy, tok = load_policy(path)
    n_params = sum(p.numel() for p in policy.parameters())
    t0 = time.perf_counter()
    engine = VLLMEngineSpec(dtype="float32", kv_cache_space_gb=1, seed=0).build(path, policy, tok)
    start_seconds = time.perf_counter() - t0
    opt = LoGRA(list(policy.named_parameters()), lr=1e-3, weight_decay=0.01, rank=shape["rank"], update_proj_gap=200)
    opt.record_updates = True
    dense_names = set(opt.dense_param_names())
    params = dict(policy.named_parameters())
    g = torch.Generator().manual_seed(0)
    vocab = policy.config.vocab_size
    prompts = [torch.randint(3, min(vocab, 100), (8,), generator=g).tolist() for _ in range(2)]

    engine.load_weights(policy.named_parameters())  # start in step
    lowrank = []
    for _ in range(shape["steps"]):
        ids = torch.randint(0, vocab, (shape["batch"], shape["seq"]), generator=g)
        policy(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        updates = [u for step in opt.pop_applied_updates() for u in step]
        dense = [(n, params[n].detach()) for n in dense_names]
        t = time.perf_counter()
        engine.apply_lowrank_updates(updates, dense)
        seconds = time.perf_counter() - t
        sent = sum(u.nbytes for u in updates) + sum(v.numel() * v.element_size() for _, v in dense)
        lowrank.append({"bytes": sent, "payload_bytes": engine.last_sync["bytes"], "seconds": seconds})
    gap_lowrank = drift(engine, policy, prompts)
    full = []
    for _ in range(shape["full_syncs"]):
        t = time.perf_counter()
        engine.load_weights(policy.named_parameters())
        full.append({"bytes": sum(p.numel() * p.element_size() for p in policy.parameters()),
                     "payload_bytes": engine.last_sync["bytes"], "seconds": time.perf_counter() - t})  # fmt: skip
    gap_full = drift(engine, policy, prompts)
    engine.close()

    lr_bytes, full_bytes = lowrank[-1]["bytes"], full[-1]["bytes"]
    result = {
        "model": {k: shape[k] for k in ("vocab", "hidden", "layers", "intermediate", "heads", "kv_heads", "tie") if k in shape}
        or "build_tiny_model default (TinyModelConfig)",
        "params": n_params,
        "rank": shape["rank"],
        "engine": {"dtype": "float32", "sync_mode": engine.init_info["mode"], "reload_modules": engine.init_info["reload_modules"],
                   "start_seconds": round(start_seconds, 1)},  # fmt: skip
        "lowrank_sync": {"bytes": lr_bytes, "payload_bytes": lowrank[-1]["payload_bytes"],
                         "seconds_median": statistics.median(r["seconds"] for r in lowrank),
                         "seconds_each": [round(r["seconds"], 3) for r in lowrank]},  # fmt: skip
        "full_sync": {"bytes": full_bytes, "payload_bytes": full[-1]["payload_bytes"],
                      "seconds_median": statistics.median(r["seconds"] for r in full),
                      "seconds_each": [round(r["seconds"], 3) for r in full]},  # fmt: skip
        "bytes_ratio": lr_bytes / full_bytes,
        "logprob_gap_after_lowrank_syncs": {"mean": gap_lowrank[0], "max": gap_lowrank[1], "syncs": shape["steps"]},
        "logprob_gap_after_full_sync": {"mean": gap_full[0], "max": gap_full[1]},
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "python": platform.python_version()},
        "torch_threads": shape["threads"],
        "command": "benchmarks/sync_cost.py" + (" --quick" if args.quick else ""),
    }
    out = ROOT / "benchmarks" / "results" / f"sync_cost{'_quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    tmp.cleanup()
    return result


if __name__ == "__main__":  # vLLM starts its workers with spawn
    main()
