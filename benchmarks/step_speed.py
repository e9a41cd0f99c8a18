"""The RL step's training phase, one speed setting at a time: what each switch of the real-model config buys.

One forward and backward of an RL step's batch through :func:`~logra_lightning.rl.logprobs.token_logprobs`
and a policy-gradient loss, then LoGRA's ``step()``, on SmolLM2-135M-Instruct (64 sequences of 43 prompt and
8 completion tokens, LoGRA r16, 2 threads; ``--quick``: the built-in 3.3M policy). Each row adds one setting to
the row before, from the settings ``configs/smollm2_chain_sum.yaml`` had before (fp32, micro-batches of 8,
activation checkpointing, a host-memory trim in every sketch hook) to what it ships (trim once per 64 MiB,
bf16 autocast as Lightning's ``bf16-mixed`` runs it, eager attention, micro-batches of 32, ``torch.compile``
per decoder layer). Two more rows keep the shipped settings and swap the optimizer: none (the bare
forward+backward, the reference docs/speed.md compares the whole RL step with) and AdamW. Each row runs in a
fresh process; times are medians over the steps after the first two
(the first compiles). MFU: the model FLOPs (:mod:`~logra_lightning.rl.throughput`) over a matmul peak measured
in the row's dtype.

    python -m benchmarks.step_speed            # -> benchmarks/results/step_speed.json
    python -m benchmarks.step_speed --quick
"""

from __future__ import annotations

import contextlib
import statistics
import time

from benchmarks.harness import Benchmark, bench, flat, main
from benchmarks.report import Col, command_head, table

# Each row: the settings it changes from the row before. The last two swap the optimizer of the shipped settings:
# none (the bare forward+backward the issue measures the whole step against) and AdamW.
ROWS = {
    "fp32, micro 8, trim every hook": dict(
        bf16=False, micro=8, trim_every=0, attn=None, compile=False, optimizer="logra"
    ),
    "+ trim per 64 MiB": {"trim_every": 64 << 20},
    "+ bf16 autocast": {"bf16": True},
    "+ eager attention": {"attn": "eager"},
    "+ micro-batches of 32": {"micro": 32},
    "+ torch.compile per layer": {"compile": True},
    "same, no optimizer (bare forward+backward)": {"optimizer": None},
    "same, AdamW instead of LoGRA": {"optimizer": "adamw"},
}


def row_settings(name: str) -> dict:
    """The settings of row ``name``: the first row's, with every change up to ``name`` applied."""
    out: dict = {}
    for row, change in ROWS.items():
        out.update(change)
        if row == name:
            return out
    raise KeyError(name)


def measure_row(settings: dict, cfg: dict) -> dict:
    import torch

    from logra_lightning.builtin.registry import resolve_model
    from logra_lightning.models import load_policy
    from logra_lightning.models.fsdp import decoder_layers
    from logra_lightning.optim import LoGRA, host_memory
    from logra_lightning.rl.logprobs import token_logprobs
    from logra_lightning.rl.throughput import ModelDims, measure_peak_flops
    from logra_lightning.rl.trajectory import pack_sequences

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    policy, tok = load_policy(resolve_model(cfg["model"]))
    if settings["attn"]:
        policy.set_attn_implementation(settings["attn"])
    dims = ModelDims.of(policy)
    policy.train()
    policy.gradient_checkpointing_enable()
    policy.config.use_cache = False
    if settings["compile"]:
        for layer in decoder_layers(policy):
            layer.compile(dynamic=True)
    if settings["optimizer"] == "logra":
        opt = LoGRA(list(policy.named_parameters()), lr=3e-5, rank=cfg["rank"], update_proj_gap=50, weight_decay=0.0)
        opt.trimmer.every = settings["trim_every"]
    elif settings["optimizer"] == "adamw":
        opt = torch.optim.AdamW(policy.parameters(), lr=3e-6, weight_decay=0.0)
    else:  # the bare forward+backward: gradients accumulate into .grad and are dropped
        opt = None
    n, prompt, completion = cfg["sequences"], cfg["prompt_tokens"], cfg["completion_tokens"]
    vocab = min(policy.config.vocab_size, 40_000)
    seqs = pack_sequences(
        [torch.randint(3, vocab, (prompt,)).tolist() for _ in range(n)],
        [torch.randint(3, vocab, (completion,)).tolist() for _ in range(n)],
        tok.pad_token_id,
    )
    advantages = torch.randn(n)
    dtype = torch.bfloat16 if settings["bf16"] else torch.float32

    def autocast():  # as Lightning's bf16-mixed: no cast cache (weights change in place within a step)
        if not settings["bf16"]:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)

    host_memory.reset_peak_rss()
    fb, step = [], []
    for _ in range(cfg["steps"]):
        start = time.perf_counter()
        with autocast():
            for i in range(0, n, settings["micro"]):
                rows = torch.arange(i, min(n, i + settings["micro"]))
                mb = seqs.rows(rows)
                logprobs, _ = token_logprobs(policy, mb, 1.0, entropy=True)  # [n, L-1]
                loss = -(logprobs * advantages[rows, None] * mb.mask).sum() / (n * completion)
                loss.backward()
        fb.append(time.perf_counter() - start)
        if opt is not None:
            opt.step()
            opt.zero_grad()  # LoGRA's also drops the step's sketches
        else:
            policy.zero_grad(set_to_none=True)
        step.append(time.perf_counter() - start)
    seconds = statistics.median(fb[2:])
    flops = dims.training_flops(seqs.lengths.tolist(), int(seqs.mask.sum()))
    peak = measure_peak_flops(dtype)
    return {
        **settings,
        "forward_backward_seconds": seconds,
        "step_seconds": statistics.median(step[2:]),
        "first_step_seconds": step[0],
        "peak_rss_bytes": host_memory.peak_rss(),
        "model_tflops_per_second": flops / seconds / 1e12,
        "peak_tflops": peak / 1e12,
        "mfu": flops / seconds / peak,
    }


@bench("step_speed", title="The RL step's training phase, setting by setting", quick=[], full=[])
class StepSpeed(Benchmark):
    isolate = True

    def settings(self, args) -> dict:
        if args.quick:
            return {"model": "builtin:arithmetic-tiny", "sequences": 16, "prompt_tokens": 12, "completion_tokens": 6,
                    "rank": 8, "steps": 3, "threads": 2}  # fmt: skip
        return {"model": "builtin:smollm2-135m-instruct", "sequences": 64, "prompt_tokens": 43,
                "completion_tokens": 8, "rank": 16, "steps": 6, "threads": 2}  # fmt: skip

    def row_names(self, args, settings) -> list[str]:
        return list(ROWS)

    def measure(self, name: str, settings: dict) -> dict:
        return measure_row(row_settings(name), settings)

    def section(self, res: dict) -> list[str]:
        rows = [flat(r) for r in res["rows"]]
        base = next((r["step_seconds"] for r in rows if r["ok"]), None)
        s = res["settings"]
        cols = [
            Col("setting (each row adds one)", "name"),
            Col("forward+backward s", "forward_backward_seconds", ".2f"),
            Col("with optimizer step s", "step_seconds", ".2f"),
            Col("speed-up", lambda r: f"{base / r['step_seconds']:.2f}×" if base else "–"),
            Col("peak RSS MB", "peak_rss_bytes", "mb0"),
            Col("model TFLOP/s", "model_tflops_per_second", ".3f"),
            Col("MFU (peak in the row's dtype)", "mfu", "pct"),
            Col("first step s", "first_step_seconds", ".1f"),
        ]
        head = (
            command_head(res) + f" `{s['model']}`, {s['sequences']} sequences of {s['prompt_tokens']} + "
            f"{s['completion_tokens']} tokens, LoGRA r{s['rank']}, {s['threads']} threads, medians of steps 3-"
            f"{s['steps']}. The whole RL step on the shipped config, with rollout, sync and KL control: docs/speed.md."
        )
        return [head, "", *table(rows, cols), ""]


if __name__ == "__main__":
    main(StepSpeed)
