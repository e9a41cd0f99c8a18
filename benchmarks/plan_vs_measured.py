"""`logra plan` against measurements: exact bytes and peak memory, AdamW vs LoGRA, three model sizes.

Run (full: ~25M / ~100M / ~400M Qwen2-shaped models, 12 rows, each measured under two allocator
settings, ``--jobs`` (2) worker processes at once; the peaks are per process, so running two at
a time changes the timings, not the bytes):

    .venv/bin/python -m benchmarks.plan_vs_measured
    .venv/bin/python -m benchmarks.plan_vs_measured --quick    # ~1M / 5M / 13M, live bytes only, ~1 min

Every row (size x optimizer x activation checkpointing) runs in its own subprocess, measured
the way ``benchmarks/optimizer_memory.py`` measures (same Qwen2 conventions: tied embeddings,
fp32, ``use_cache=False``; VmRSS before the model is built is the baseline, and the kernel's
high-water mark VmHWM over model build + all steps is the peak). Before the baseline, one step
of a throwaway 2-layer model loads the code, kernels and autograd threads that the first step
would otherwise add (~20-35 MB whatever the model size, the CPU analogue of a CUDA context).
The step is RL-shaped: full
logits, ``rl.logprobs.gather_logprobs`` (fp32 log-softmax), a policy-gradient loss, backward,
``opt.step()``, with the logits held until the step ends, which is what the planner models.

Compared per row (errors are ``predicted / measured - 1``):

* ``exact``: parameters, gradients alive after the first backward and optimizer state after a
  step, summed over the real tensors, against :func:`logra_lightning.plan.memory.plan_optimizer`
  (target: within 2%);
* ``peak``: the planner's peak (one process, no FSDP, ``--adamw-impl for-loop``, the CPU
  default, no reserve) against the measured peak RSS increase (target: within 20%), once with
  RSS following live tensor bytes (``live``) and once with the default allocators (``default``,
  allocator slack included; see ``MALLOC``);
* ``peak_with_fitted_slack`` (``default`` only): the planner with ``allocator_slack`` set to the
  mean ``measured / predicted - 1`` of the smallest size's rows (``--fit-size``, the fit), so the
  larger sizes are a held-out check of "planner + one allocator constant" (target: within 20%).

One results row per size x optimizer x checkpointing (``25m/logra/ckpt_on``), its measurements
per allocator setting in ``measured`` and their errors in ``rel_error``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import proc_memory, qwen2, random_tokens, rss_baseline, shape_config
from benchmarks.harness import Benchmark, bench, flat, main
from benchmarks.report import Col, Target, command_head, pct, table

# A shape in short keys -> the Qwen2 config field of each.
FIELDS = dict(
    vocab="vocab_size",
    hidden="hidden_size",
    layers="num_hidden_layers",
    intermediate="intermediate_size",
    heads="num_attention_heads",
    kv_heads="num_key_value_heads",
)
FULL = {s: {k: shape_config(s)[f] for k, f in FIELDS.items()} for s in ("25m", "100m", "400m")}
TINY = dict(vocab=64, hidden=32, layers=2, intermediate=64, heads=2, kv_heads=1)  # the runtime's warm-up step
QUICK = {  # small enough for ~1 min, large enough that fixed allocator overheads stay small
    "1m": dict(vocab=4096, hidden=128, layers=2, intermediate=352, heads=2, kv_heads=1),
    "5m": dict(vocab=8192, hidden=256, layers=4, intermediate=704, heads=4, kv_heads=2),
    "13m": dict(vocab=16384, hidden=384, layers=4, intermediate=1024, heads=6, kv_heads=2),
}
RUN = {
    "full": dict(seq=128, batch=4, rank=64, warmup=1, steps=1, threads=2),
    "quick": dict(seq=64, batch=2, rank=8, warmup=1, steps=1, threads=1),
}
OPTIMIZERS = ("adamw", "logra")
# Each row is measured twice. "live": glibc serves every allocation >= 64 KiB with mmap and
# returns it to the OS when freed, and MKL's buffer cache is off, so RSS follows live tensor
# bytes (the quantity the planner models, like torch.cuda.max_memory_allocated). "default": the
# allocators as benchmarks/optimizer_memory.py runs them; freed heap chunks stay resident and
# MKL keeps its GEMM buffers (19 MB on the 25M model, measured), on top of the tensors.
MALLOC = {"live": {"MALLOC_MMAP_THRESHOLD_": "65536", "MKL_DISABLE_FAST_MM": "1"}, "default": {}}
MALLOC_DOC = {
    "live": "MALLOC_MMAP_THRESHOLD_=65536 MKL_DISABLE_FAST_MM=1: RSS tracks live tensor bytes",
    "default": "default glibc malloc and MKL (as optimizer_memory.py): includes allocator slack",
}


def _config_dict(shape: dict, seq: int) -> dict:
    fields = {FIELDS[k]: v for k, v in shape.items()}
    return dict(model_type="qwen2", **fields, max_position_embeddings=seq, tie_word_embeddings=True)


def _exact_bytes(model, opt) -> tuple[int, int, int]:
    """(params, live grads, optimizer state) summed over the real tensors."""
    from logra_lightning.optim.accounting import grad_bytes, optimizer_state_bytes, param_bytes

    return param_bytes(model), grad_bytes(model), optimizer_state_bytes(opt)


def _rl_step(model, opt, ids, adv) -> int:
    """One RL-shaped training step; returns the bytes of gradients alive after backward."""
    from logra_lightning.rl.logprobs import gather_logprobs

    logits = model(input_ids=ids).logits  # [B, T, V], held until the step ends
    logp = gather_logprobs(logits[:, :-1], ids[:, 1:])  # [B, T-1]
    (-(logp * adv).mean()).backward()
    grads = _exact_bytes(model, opt)[1]
    opt.step()
    opt.zero_grad(set_to_none=True)
    return grads


def _warm_up_runtime(optimizer: str) -> None:
    """One step of a throwaway 2-layer model, so lazily loaded code, kernels and autograd threads
    (~20-35 MB, independent of the model size) are in the baseline, as a CUDA context would be."""
    import torch

    from logra_lightning.optim import LoGRA, logra_param_groups

    for ckpt in (False, True):
        model = qwen2(_config_dict(TINY, 16), checkpointing=ckpt)
        opt = (
            torch.optim.AdamW(model.parameters())
            if optimizer == "adamw"
            else LoGRA(logra_param_groups(model, rank=4), lr=1e-5)
        )
        ids = torch.randint(0, 64, (2, 16))
        _rl_step(model, opt, ids, torch.randn(2, 15))
        del model, opt


def worker(size: str, optimizer: str, ckpt: bool, shape: dict, run: dict) -> dict:
    import torch

    torch.set_num_threads(run["threads"])
    from logra_lightning.optim import LoGRA, logra_param_groups

    data = random_tokens(shape["vocab"], run["batch"], run["seq"], run["warmup"] + run["steps"])
    adv = torch.randn(run["batch"], run["seq"] - 1, generator=torch.Generator().manual_seed(1))
    _warm_up_runtime(optimizer)
    rss_before = rss_baseline()
    model = qwen2(_config_dict(shape, run["seq"]), checkpointing=ckpt)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    else:
        opt = LoGRA(logra_param_groups(model, rank=run["rank"], update_proj_gap=200), lr=1e-5)
    grads, times = [], []
    for ids in data:
        t0 = time.perf_counter()
        grads.append(_rl_step(model, opt, ids, adv))
        times.append(time.perf_counter() - t0)
    params, _, state = _exact_bytes(model, opt)
    return {
        "param_bytes": params,
        "grad_bytes_after_backward": grads[0],
        "optimizer_state_bytes": state,
        "rss_before_model_bytes": rss_before,
        "train_peak_bytes": proc_memory()["VmHWM"] - rss_before,
        "step_time_s": times,
    }


def predict(shape: dict, run: dict, optimizer: str, ckpt: bool, allocator_slack: float = 0.0) -> dict:
    from logra_lightning.models.shapes import architecture_from_config
    from logra_lightning.plan import PlanSetup, plan_optimizer

    arch = architecture_from_config(_config_dict(shape, run["seq"]), name="bench")
    setup = PlanSetup(
        gpus=1,
        gpu_memory_gb=1024,
        rank=run["rank"],
        batch=run["batch"],
        seq_len=run["seq"],
        precision="fp32",
        activation_checkpointing=ckpt,
        adamw_impl="for-loop",
        reserve_gb=0,
        allocator_slack=allocator_slack,
        lm_head_chunk=0,  # the step below holds the whole logits
    )
    out = plan_optimizer(arch, setup, optimizer)
    b = out["phases"]["optimizer_step"]
    return {
        "params_m": arch.num_params() / 1e6,
        "param_bytes": b["params"],
        "grad_bytes": b["grads"],
        "optimizer_state_bytes": b["optimizer_state"],
        "peak_bytes": out["peak_bytes"],
        "peak_phase": out["peak_phase"],
        "peak_breakdown": out["breakdown"],
    }


def compare(pred: dict, meas: dict) -> dict:
    """``predicted / measured - 1`` for the exact sums and the peak."""
    err = lambda p, m: (p / m - 1) if m else (0.0 if p == 0 else float("inf"))  # noqa: E731
    exact_p = pred["param_bytes"] + pred["grad_bytes"] + pred["optimizer_state_bytes"]
    exact_m = meas["param_bytes"] + meas["grad_bytes_after_backward"] + meas["optimizer_state_bytes"]
    return {
        "params": err(pred["param_bytes"], meas["param_bytes"]),
        "grads": err(pred["grad_bytes"], meas["grad_bytes_after_backward"]),
        "optimizer_state": err(pred["optimizer_state_bytes"], meas["optimizer_state_bytes"]),
        "params_grads_state": err(exact_p, exact_m),
        "peak": err(pred["peak_bytes"], meas["train_peak_bytes"]),
    }


def fit_allocator_slack(rows: list[dict], fit_size: str, run: dict) -> float | None:
    """Fit ``allocator_slack`` on ``fit_size``'s default-allocator rows and score every row with it.

    Adds ``rel_error["default"]["peak_with_fitted_slack"]`` (and the prediction) to each row measured
    with the default allocators; returns the slack, or None when no ``fit_size`` row has one.
    """
    fit = [
        r["measured"]["default"]["train_peak_bytes"] / r["predicted"]["peak_bytes"] - 1
        for r in rows
        if r["size"] == fit_size and "default" in r["measured"]
    ]
    if not fit:
        return None
    slack = sum(fit) / len(fit)
    for r in rows:
        if "default" in r["measured"]:
            pred = predict(r["shape"], run, r["optimizer"], r["activation_checkpointing"], allocator_slack=slack)
            r["predicted_with_fitted_slack"] = {"peak_bytes": pred["peak_bytes"], "peak_phase": pred["peak_phase"]}
            r["rel_error"]["default"]["peak_with_fitted_slack"] = (
                pred["peak_bytes"] / r["measured"]["default"]["train_peak_bytes"] - 1
            )
    return slack


TARGETS = {"params_grads_state_abs_error_max": 0.02, "peak_abs_error_max": 0.20}
COLS = [
    Col("size", "size"),
    Col("params (M)", lambda r: r["predicted"]["params_m"], ".1f"),
    Col("optimizer", "optimizer"),
    Col("act. ckpt", lambda r: "on" if r["activation_checkpointing"] else "off"),
    Col("params+grads+state MB (plan)", lambda r: sum(r["predicted"][k] for k in EXACT), "mb1"),
    # the exact sums are the same tensors under every allocator setting: the worst
    Col("error", lambda r: max((e["params_grads_state"] for e in r["rel_error"].values()), key=abs), "pct2"),
    Col("peak MB (plan)", lambda r: r["predicted"]["peak_bytes"], "mb0"),
    Col("peak phase", lambda r: r["predicted"]["peak_phase"]),
]
EXACT = ("param_bytes", "grad_bytes", "optimizer_state_bytes")


def _targets(res: dict) -> list[Target]:
    t, fit = res["settings"]["targets"], res["summary"].get("allocator_slack_fit")
    exact, peak = t["params_grads_state_abs_error_max"], t["peak_abs_error_max"]
    out = [
        Target(
            f"params+grads+state within {pct(exact, 0)}, worst", "max_abs_error_params_grads_state", "<=", exact, "pct2"
        )
    ]
    out += [
        Target(f"peak within {pct(peak, 0)} under `{m}`, worst", f"max_abs_error_peak_{m}", "<=", peak, "pct")
        for m in res["settings"]["allocators"]
    ]
    if fit:
        label = f"peak within {pct(peak, 0)} under `default` with `--allocator-slack {fit['slack']:.3f}` fitted on "
        label += f"the {fit['size']} rows, worst held-out (other sizes)"
        out.append(Target(label, "max_abs_error_peak_default_fitted_slack_held_out", "<=", peak, "pct"))
    return out


@bench("plan_vs_measured", title="Memory planner vs measurement", quick=[], full=[])
class PlanVsMeasured(Benchmark):
    flags = {"sizes": None, "jobs": 2}  # jobs: worker processes at once (the peaks are per process)

    def add_arguments(self, ap) -> None:
        ap.add_argument(
            "--fit-size", default="25m", help="size whose rows fit the allocator slack (the rest are held out)"
        )

    def settings(self, args) -> dict:
        shapes, run = (QUICK, RUN["quick"]) if args.quick else (FULL, RUN["full"])
        unknown = sorted(set(args.sizes or ()) - set(shapes))
        if unknown:
            raise SystemExit(f"unknown --sizes {unknown} (allowed: {', '.join(shapes)})")
        mallocs = ("live",) if args.quick else tuple(MALLOC)
        return {
            "jobs": args.jobs,
            "run": {**run, "dtype": "float32", "tie_word_embeddings": True, "loss": "gather_logprobs policy gradient"},
            "targets": TARGETS,
            "allocators": {m: MALLOC_DOC[m] for m in mallocs},
            "shapes": {s: shapes[s] for s in args.sizes or shapes},
            "checkpointing": [True] if args.quick else [True, False],
            "fit_size": args.fit_size,
        }

    def worker_env(self, name: str, settings: dict) -> dict[str, str]:
        return MALLOC[name.rsplit("/", 1)[1]]

    def measure(self, name: str, settings: dict) -> dict:
        size, opt, ckpt, _malloc = name.split("/")
        return worker(size, opt, ckpt == "ckpt_on", settings["shapes"][size], settings["run"])

    def run(self, args, settings: dict) -> list[dict]:
        keys = [
            f"{s}/{o}/ckpt_{'on' if c else 'off'}"
            for s in settings["shapes"]
            for c in settings["checkpointing"]
            for o in OPTIMIZERS
        ]
        tasks = [f"{k}/{m}" for k in keys for m in settings["allocators"]]

        def timed(name: str) -> tuple[dict, float]:
            t0 = time.perf_counter()
            return self.isolated(name, args), time.perf_counter() - t0

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # threads only wait on the worker processes
            measured = dict(zip(tasks, pool.map(timed, tasks)))
        rows = []
        for key in keys:
            size, opt, ckpt = key.split("/")
            shape, ckpt = settings["shapes"][size], ckpt == "ckpt_on"
            pred = predict(shape, settings["run"], opt, ckpt)
            r = {
                "size": size,
                "optimizer": opt,
                "activation_checkpointing": ckpt,
                "shape": shape,
                "predicted": pred,
                "measured": {},
                "rel_error": {},
                "wall_s": 0.0,
            }
            failed = {}
            for m in settings["allocators"]:
                got, seconds = measured[f"{key}/{m}"]
                r["wall_s"] += seconds
                if got["ok"]:
                    r["measured"][m], r["rel_error"][m] = got["metrics"], compare(pred, got["metrics"])
                else:
                    failed[m] = got["error"]
            error = "; ".join(f"{m}: {e}" for m, e in failed.items()) or None
            rows.append({"name": key, "ok": not failed, "error": error, "metrics": r})
            print(json.dumps({"name": key, **{m: e["peak"] for m, e in r["rel_error"].items()}}), flush=True)
        return rows

    def summarize(self, settings: dict, rows: list[dict]) -> dict:
        failed, rows = sum(not r["ok"] for r in rows), [r["metrics"] for r in rows]
        slack = fit_allocator_slack(rows, settings["fit_size"], settings["run"])  # adds the fitted errors to the rows
        errors = [(m, e) for r in rows for m, e in r["rel_error"].items()]
        held_out = [
            r["rel_error"]["default"]["peak_with_fitted_slack"]
            for r in rows
            if r["size"] != settings["fit_size"] and "peak_with_fitted_slack" in r["rel_error"].get("default", {})
        ]
        return {
            "max_abs_error_params_grads_state": max((abs(e["params_grads_state"]) for _, e in errors), default=None),
            **{
                f"max_abs_error_peak_{m}": max((abs(e["peak"]) for n, e in errors if n == m), default=None)
                for m in settings["allocators"]
            },
            "allocator_slack_fit": None if slack is None else {"size": settings["fit_size"], "slack": slack},
            "max_abs_error_peak_default_fitted_slack_held_out": max(map(abs, held_out), default=None),
            "failed_rows": failed,
        }

    def section(self, res: dict) -> list[str]:
        """``logra plan`` against measured bytes and peaks, per size x optimizer x activation checkpointing."""
        allocators, fit = res["settings"]["allocators"], res["summary"].get("allocator_slack_fit")
        cols = COLS + [
            c
            for m in allocators
            for c in (
                Col(f"peak MB (`{m}`)", lambda r, m=m: r["measured"][m]["train_peak_bytes"], "mb0"),
                Col(f"peak error (`{m}`)", lambda r, m=m: r["rel_error"][m]["peak"], "pct"),
            )
        ]
        if fit:
            cols.append(
                Col(
                    f"peak error (`default`, slack {pct(fit['slack'])})",
                    lambda r: r["rel_error"]["default"].get("peak_with_fitted_slack"),
                    "pct",
                )
            )
        cols.append(Col("wall s", "wall_s", ".0f"))
        mallocs = "; ".join(f"`{m}`: {doc}" for m, doc in allocators.items())
        head = (
            command_head(res)
            + f" Run settings: `{json.dumps(res['settings']['run'])}`. Errors are predicted / measured − 1; "
            + f"allocator settings: {mallocs}."
        )
        verdicts = "; ".join(t.verdict(res["summary"]) for t in _targets(res))
        tail = f"Targets: {verdicts}; failed rows: {res['summary'].get('failed_rows', 0)}."
        return [head, "", *table([flat(r) for r in res["rows"]], cols), "", tail, ""]


if __name__ == "__main__":
    main(PlanVsMeasured)
