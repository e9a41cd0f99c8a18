"""Write ``benchmarks/README.md`` from the results JSON files: every number in it comes from them.

Run after the benchmarks (``benchmarks/run_all.py`` does):

    .venv/bin/python benchmarks/make_readme.py             # results/*.json -> benchmarks/README.md
    .venv/bin/python benchmarks/make_readme.py --quick     # results/*_quick.json -> results/README_quick.md

A benchmark without a results file gets a "not measured yet" line with its command, never
a number. Hand edits to the README are overwritten: change this script instead.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, RESULTS  # noqa: E402
from benchmarks.run_all import FULL_ARGS, SCRIPTS  # noqa: E402

MB = 1e6
COMMANDS = {  # exactly what `make bench` (run_all.py) runs for each result
    name: " ".join([".venv/bin/python", f"benchmarks/{FULL_ARGS.get(name, (name, []))[0]}.py", *FULL_ARGS.get(name, (name, []))[1]])
    for name in SCRIPTS
}  # fmt: skip


def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def _num(x, fmt: str = ".2f") -> str:
    return "–" if x is None or isinstance(x, str) else format(x, fmt)


def _load(load: dict | None) -> str:
    return "–" if not load else f"{load['1m']:.1f}/{load['5m']:.1f}/{load['15m']:.1f}"


def _clip(text: str, n: int) -> str:
    """An error message cut to ``n`` characters, safe inside a table cell."""
    return text[:n].replace("|", "/").replace("\n", " ")


def _met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _missing(name: str, quick: bool) -> list[str]:
    command = f".venv/bin/python benchmarks/{FULL_ARGS.get(name, (name, []))[0]}.py --quick" if quick else COMMANDS[name]
    return [f"_Not measured yet._ Run `{command}`.", ""]


def _plot(name: str, quick: bool, results: Path, readme_dir: Path) -> list[str]:
    png = results / f"{name}{'_quick' if quick else ''}.png"
    if not png.is_file():
        return []
    return [f"![{name}]({png.relative_to(readme_dir) if png.is_relative_to(readme_dir) else png})", ""]


def section_optimizer_memory(res: dict) -> tuple[list[str], dict]:
    out = [f"Command: `{res['command']}` — {res['wall_seconds']:.0f} s, load (1/5/15 min) at start "
           f"{_load(res['load_start'])}, at end {_load(res['load_end'])}. Run settings: `{json.dumps(res['run'])}`.", ""]  # fmt: skip
    for size, rows in res["sizes"].items():
        params = next((r["params"] for r in rows if r.get("ok")), None)
        out += [f"**{size}** ({_num(params / 1e6 if params else None, '.1f')}M params, shape "
                f"`benchmarks/configs/qwen2-{size}.json`)", ""]  # fmt: skip
        table = []
        for r in rows:
            if not r.get("ok"):
                table.append([r["name"], "failed: " + _clip(r.get("error", ""), 160)] + [""] * 10)
                continue
            table.append([
                r["name"], _num(r["train_peak_bytes"] / MB, ".0f"), _pct(r.get("train_memory_reduction_vs_adamw")),
                _num(r["steady_peak_bytes"] / MB, ".0f"), _num(r["optimizer_state_bytes"] / MB, ".1f"),
                _pct(r.get("state_ratio_vs_adamw")), _num(r["grad_bytes_after_backward"] / MB, ".1f"),
                _num(r["step_time_s_median"], ".2f"), _num(r.get("step_time_ratio_vs_adamw"), ".2f"),
                _num(r.get("step_cpu_ratio_vs_adamw"), ".2f"), _num(r.get("train_peak_vs_floor_nograd"), ".3f"),
                str(r.get("threads", res["run"]["threads"]))
                + (f" ×{len(r['repeats'])}" if r.get("repeats") else ""), _load(r.get("load_before")),
            ])  # fmt: skip
        out += _table(["row", "training MB", "vs AdamW", "steady MB", "state MB", "state / AdamW", "grads after bwd MB",
                       "step s (median)", "time × AdamW", "CPU time × AdamW", "training × floor_nograd", "threads (× repeats)",
                "load at start"],
                       table) + [""]  # fmt: skip
    out += ["Rows: " + "; ".join(f"`{r['name']}`: {r['description']}" for r in next(iter(res["sizes"].values()))), ""]
    acc = res.get("acceptance")
    if acc:
        t = res["targets"]
        out += [f"Issue-3 targets ({t['size']}, `{t['row']}`): state ≤ {_pct(t['state_ratio_vs_adamw_max'], 0)} of AdamW's → "
                f"{_pct(acc['state_ratio_vs_adamw'])} ({'met' if acc['state_ratio_ok'] else 'missed'}); training memory "
                f"≥ {_pct(t['train_memory_reduction_vs_adamw_min'], 0)} below AdamW → {_pct(acc['train_memory_reduction_vs_adamw'])} "
                f"({'met' if acc['train_memory_ok'] else 'missed'}); step time ≤ {t['step_time_ratio_vs_adamw_max']}× → "
                f"{acc['step_time_ratio_vs_adamw']:.2f}× wall, {acc['step_cpu_ratio_vs_adamw']:.2f}× CPU time "
                f"({'met' if acc['step_time_ok'] else 'missed'} on wall time; timings on a loaded machine are noisy, "
                f"see the load column).", ""]  # fmt: skip
        if acc.get("train_peak_vs_floor_nograd") is not None:
            out += [f"Issue-18 targets ({t['size']}, `{t['row']}`): training memory ≤ "
                    f"{t.get('issue18_train_peak_vs_floor_nograd_max', 1.10)}× `floor_nograd` → "
                    f"{acc['train_peak_vs_floor_nograd']:.3f}× ({_num(acc.get('train_peak_vs_floor_nograd_trim'), '.3f')}× "
                    f"`floor_nograd_trim`); state ≤ {t.get('issue18_state_ratio_vs_adamw_max', 0.05)}× AdamW's → "
                    f"{acc['state_ratio_vs_adamw']:.4f}×.", ""]  # fmt: skip
    return out, acc or {}


def section_memory_breakdown(res: dict) -> tuple[list[str], dict]:
    out = [f"Command: `{res['command']}` — {res['wall_seconds']:.0f} s, load at start {_load(res['load_start'])}.", ""]
    rows = []
    for key, s in res["summary"].items():
        rows.append([key, _num(s.get("peak_live_bytes", 0) / MB, ".0f"), _num(s.get("rss_live_train_peak_bytes", 0) / MB, ".0f"),
                     _num(s.get("rss_default_train_peak_bytes", 0) / MB, ".0f"), _pct(s.get("allocator_slack")),
                     _num(s.get("optimizer_state_bytes", 0) / MB, ".1f")])  # fmt: skip
    out += _table(["row", "live tensor peak MB", "RSS peak, mmap allocator MB", "RSS peak, default MB",
                   "allocator slack", "state MB"], rows) + [""]  # fmt: skip
    for r in res["rows"]:
        if r.get("mode") != "profiled" or "live" not in r:
            continue
        step = max((k for k in r["live"] if k.startswith("step")), key=lambda k: r["live"][k]["peak_live_bytes"])
        groups = r["live"][step]["groups"]["by_group_mb"]
        top = ", ".join(f"{k} {v:.1f}" for k, v in list(groups.items())[:8])
        out += [f"- `{r['size']}/{r['name']}` live peak at {step}: {top} (MB)."]
    return out + [""], {}


def section_direction_error(res: dict) -> tuple[list[str], dict]:
    st = res["settings"]
    out = [f"Command: `{res['command']}` — ~{st['size']}, rank {st['rank']}, {st['steps']} steps, update_proj_gap "
           f"{st['update_proj_gap']}; relative Frobenius error of each matrix's update vs the all-fp32 full-V LoGRA "
           "on the same gradients.", ""]  # fmt: skip
    rows = []
    for v, s in res["summary"].items():
        emb = s.get("embedding_rel_err_per_step") or []
        last = (lambda xs: xs[-1] if xs else None)
        rows.append([v, f"`{res['variants'][v]}`", _num(res["state_bytes"][v] / MB, ".1f"),
                     _num(s.get("rel_err_median_all_steps"), ".4f"), _num(s.get("rel_err_median_last_step"), ".4f"),
                     _num(s.get("rel_err_max_all_steps"), ".3f"), _num(last(emb), ".3f"),
                     _num(last(s.get("cosine_vs_adamw_median_layers_per_step")), ".3f"),
                     _num(last(s.get("cosine_vs_adamw_embedding_per_step")), ".3f")])  # fmt: skip
    out += _table(["variant", "options", "state MB", "rel. err median (layers)", "median, last step",
                   "max", "embedding, last step", "cos vs AdamW, layers (median, last)", "cos vs AdamW, embedding (last)"],
                  rows)  # fmt: skip
    return out + [f"Reference state: {res['state_bytes']['reference'] / MB:.1f} MB.", ""], {}


def section_quality(res: dict) -> tuple[list[str], dict]:
    st = res["settings"]
    out = [f"Command: `{res['command']}` — {res['wall_seconds']:.0f} s, load at start {_load(res['load_start'])}, "
           f"at end {_load(res['load_end'])}. Base config `{st['config']}` (LoGRA settings from `{st['logra_config']}`), "
           f"{st['steps']} RL steps, {st['batch_size']} prompts × {st['group_size']} samples per step, "
           f"seeds {st['seeds']}, update_proj_gap {st['update_proj_gap']}, {st.get('jobs', 1)} run(s) at a time "
           "(1 torch thread each: s/step is a rough cost figure, accuracy does not depend on it).", ""]  # fmt: skip
    rows = []
    for row, s in res["summary"].items():
        if "accuracy_after" not in s:
            rows.append([row, "–", f"0/{s['runs']} ok", "", "", "", ""])
            continue
        a, b = s["accuracy_after"], s["accuracy_before"]
        lr = st["optimizers"][row]["init_args"]["lr"]
        rows.append([row, f"{lr:g}", f"{s['ok_runs']}/{s['runs']}", _pct(b["mean"]),
                     f"{100 * a['mean']:.1f} ± {100 * a['std']:.1f} ({100 * a['min']:.1f}–{100 * a['max']:.1f})",
                     _num(s.get("accuracy_after_vs_adamw_points"), "+.1f"), _num(s.get("step_seconds_median"), ".2f")])  # fmt: skip
    out += _table(["row", "lr", "runs ok", "accuracy before", "accuracy after, % (mean ± std, min–max)",
                   "vs AdamW (points)", "s/step (median)"], rows) + [""]  # fmt: skip
    return out, res["summary"]


def section_kl(res: dict) -> tuple[list[str], dict]:
    st = res["settings"]
    out = [f"Command: `{res['command']}` — {res['wall_seconds']:.0f} s, load at start {_load(res['load_start'])}. "
           f"Config `{st['config']}`, LoGRA {json.dumps(st['logra'])}, default lr {st['default_lr']:g}, high lr "
           f"{st['high_lr']:g}, target_kl T = {st['target_kl']:g}, min_scale {st['min_scale']}, measure_every "
           f"{st['measure_every']}, {st['steps']} steps"
           + (f"; lr and control settings from `{st['demo_config']}`." if st.get("demo_config") else "."), ""]  # fmt: skip
    rows = []
    for r in res["runs"]:
        if not r["ok"]:
            rows.append([r["row"], str(r["seed"]), f"{r['lr']:g}", "failed: " + _clip(r["error"], 120)] + [""] * 5)
            continue
        k = r.get("kl", {"measured_steps": "–"})  # demo_overhead: timing only
        rows.append([r["row"], str(r["seed"]), f"{r['lr']:g}", f"{_pct(r['accuracy_before'])} → {_pct(r['accuracy_after'])}",
                     str(k["measured_steps"]), _pct(k.get("realized_within_1.5T_share")), _num(k.get("realized_max"), ".2e"),
                     _num(k.get("median_abs_log_realized_over_raw_predicted"), ".2f"), _num(r["step_seconds_median"], ".2f")])  # fmt: skip
    out += _table(["run", "seed", "lr", "held-out accuracy", "measured steps", "realized ≤ 1.5 T", "max realized KL",
                   "median abs log(realized / raw predicted)", "s/step"], rows) + [""]  # fmt: skip
    return out + _kl_accuracy(res) + _kl_targets(res) + _kl_overhead(res), {}


def _kl_accuracy(res: dict) -> list[str]:
    """Final held-out accuracy per row over the seeds, and the "no worse than the default lr" verdict."""
    acc = res.get("accuracy")  # kl_control.accuracy_summary of the runs in the table above
    if not acc:
        return []
    parts = [f"{row} {_pct(a['mean'])} (min {_pct(a['min'])}, max {_pct(a['max'])}, {a['n']} seeds)"
             for row, a in acc.items() if isinstance(a, dict) and "mean" in a]  # fmt: skip
    if not parts:
        return []
    verdict, diff = acc["controlled_no_worse_than_default"], acc.get("controlled_vs_default")
    text = "not measured" if verdict is None else _met(verdict)
    if diff:
        se = diff["paired_standard_error_points"]
        text += (f": {diff['mean_difference_points']:+.2f} points; paired by seed "
                 + " / ".join(f"{d:+.1f}" for d in diff["paired_difference_points"])
                 + (f" (standard error {se:.2f})" if se is not None else ""))  # fmt: skip
    return [f"Held-out accuracy at the end, mean over seeds: {'; '.join(parts)}. Target: the controlled high-lr mean is "
            f"no worse than the default-lr mean → {text}.", ""]  # fmt: skip


def _kl_targets(res: dict) -> list[str]:
    """The controlled runs' share within 1.5 T against its target; every run's prediction error against log 1.5."""
    t = {"realized_within_1.5T_share_min": 0.95, "median_abs_log_ratio_max": math.log(1.5), **res.get("targets", {})}
    ok = [r for r in res["runs"] if r["ok"] and "kl" in r]
    share = [f"{r['row']} seed {r['seed']} {_pct(r['kl']['realized_within_1.5T_share'])} "
             f"({_met(r['kl']['realized_within_1.5T_share'] >= t['realized_within_1.5T_share_min'])})"
             for r in ok if r["row"] == "high_lr_kl_control" and "realized_within_1.5T_share" in r["kl"]]  # fmt: skip
    pred = [f"{r['row']} {r['kl']['median_abs_log_realized_over_raw_predicted']:.2f} "
            f"({_met(r['kl']['median_abs_log_realized_over_raw_predicted'] <= t['median_abs_log_ratio_max'])})"
            for r in ok if "median_abs_log_realized_over_raw_predicted" in r["kl"]]  # fmt: skip
    return [f"Targets: with control at the high lr, realized KL ≤ 1.5 T on ≥ {_pct(t['realized_within_1.5T_share_min'], 0)} "
            f"of measured steps → {', '.join(share) or 'not measured'}; prediction quality, median |log(realized / raw "
            f"predicted)| ≤ log 1.5 = {t['median_abs_log_ratio_max']:.3f} → {', '.join(pred) or 'not measured'}.", ""]  # fmt: skip


def _kl_overhead(res: dict) -> list[str]:
    """The ``demo_overhead`` run: time the control adds per step, against its target share."""
    run = next((r for r in res["runs"] if r["row"] == "demo_overhead"), None)
    if run is None:
        return ["_Control overhead not measured in this result_ (the `demo_overhead` run is newer than it).", ""]
    if not run["ok"] or "overhead_share" not in run.get("overhead", {}):
        return [f"Control overhead: the `demo_overhead` run failed: {_clip(run.get('error', 'no steps logged'), 200)}", ""]
    o, st = run["overhead"], res["settings"]
    limit = res["targets"]["overhead_share_max"]
    return [f"Control overhead (`demo_overhead`: `{st.get('demo_config')}` as shipped, {st['overhead_steps']} steps, "
            f"medians over {o['steps_used']} steps after the first {o['warmup_steps_skipped']}; load at start "
            f"{_load(run['load_before'])}): step {o['step_seconds_median']:.3f} s, of which the control "
            f"{o['control_seconds_median']:.3f} s → overhead **{_pct(o['overhead_share'])}** of a step without it "
            f"(≤ {_pct(limit, 0)}: {_met(o['overhead_share'] <= limit)}).", ""]  # fmt: skip


def section_plan(res: dict) -> tuple[list[str], dict]:
    """``logra plan`` against measured bytes and peaks, per size x optimizer x activation checkpointing."""
    t, allocators = res["targets"], list(res.get("allocators", {}))
    wall = res.get("wall_seconds", sum(r.get("wall_s", 0.0) for r in res["rows"]))
    load = (f"load at start {_load(res['load_start'])}, at end {_load(res.get('load_end'))}" if res.get("load_start")
            else "load not recorded")  # fmt: skip
    mallocs = "; ".join(f"`{m}`: {doc}" for m, doc in res.get("allocators", {}).items())
    out = [f"Command: `{res['command']}` — {wall:.0f} s, {load}. Run settings: `{json.dumps(res['run'])}`. Errors are "
           f"predicted / measured − 1; allocator settings: {mallocs}.", ""]  # fmt: skip
    slack_fit = res["summary"].get("allocator_slack_fit")
    fitted_head = [f"peak error (`default`, slack {_pct(slack_fit['slack'])})"] if slack_fit else []
    rows = []
    for r in res["rows"]:
        pred, err = r["predicted"], r["error"]
        # the exact sums are the same tensors under every allocator setting: show the worst
        exact = max((e["params_grads_state"] for e in err.values()), key=abs, default=None)
        pred_exact = pred["param_bytes"] + pred["grad_bytes"] + pred["optimizer_state_bytes"]
        peaks = []
        for m in allocators:
            meas = r["measured"].get(m)
            peaks += ([_num(meas["train_peak_bytes"] / MB, ".0f"), _pct(err[m]["peak"])] if meas
                      else ["failed: " + _clip(r.get("failed", {}).get(m, ""), 80), ""])  # fmt: skip
        fitted = [_pct(err.get("default", {}).get("peak_with_fitted_slack"))] if slack_fit else []
        rows.append([r["size"], _num(pred["params_m"], ".1f"), r["optimizer"], "on" if r["activation_checkpointing"] else "off",
                     _num(pred_exact / MB, ".1f"), _pct(exact, 2), _num(pred["peak_bytes"] / MB, ".0f"), pred["peak_phase"],
                     *peaks, *fitted, _num(r.get("wall_s"), ".0f")])  # fmt: skip
    out += _table(["size", "params (M)", "optimizer", "act. ckpt", "params+grads+state MB (plan)", "error",
                   "peak MB (plan)", "peak phase", *(h for m in allocators for h in (f"peak MB (`{m}`)", f"peak error (`{m}`)")),
                   *fitted_head, "wall s"], rows) + [""]  # fmt: skip
    s = res["summary"]
    exact = s.get("max_abs_error_params_grads_state")
    verdicts = [f"params+grads+state within {_pct(t['params_grads_state_abs_error_max'], 0)} → worst {_pct(exact, 2)} "
                f"({_met(exact is not None and exact <= t['params_grads_state_abs_error_max'])})"]  # fmt: skip
    for m in allocators:
        peak = s.get(f"max_abs_error_peak_{m}")
        verdicts.append(f"peak within {_pct(t['peak_abs_error_max'], 0)} under `{m}` → worst {_pct(peak)} "
                        f"({_met(peak is not None and peak <= t['peak_abs_error_max'])})")  # fmt: skip
    if slack_fit:
        held = s.get("max_abs_error_peak_default_fitted_slack_held_out")
        verdicts.append(f"peak within {_pct(t['peak_abs_error_max'], 0)} under `default` with `--allocator-slack "
                        f"{slack_fit['slack']:.3f}` fitted on the {slack_fit['size']} rows → worst held-out (other sizes) "
                        f"{_pct(held)} ({_met(held is not None and held <= t['peak_abs_error_max'])})")  # fmt: skip
    out += ["Targets: " + "; ".join(verdicts) + f"; failed rows: {s.get('failed_rows', 0)}.", ""]
    return out, s


def section_sync(res: dict) -> tuple[list[str], dict]:
    """Low-rank vs full sync per model size; the headline size's row is what the headline quotes."""
    out = [f"Command: `{res['command']}` — {res['wall_seconds']:.0f} s, load at start {_load(res['load_start'])}, at end "
           f"{_load(res['load_end'])}. Run `{json.dumps(res['run'])}`, versions {json.dumps(res['versions'])}; fp32 engine "
           "(vLLM CPU build), one engine per size in its own process.", ""]  # fmt: skip
    rows = []
    for size, r in res["sizes"].items():
        if not r["ok"]:
            rows.append([size, "failed: " + _clip(r["error"], 160)] + [""] * 8)
            continue
        lo, full, gap = r["lowrank_sync"], r["full_sync"], r["logprob_gap_after_lowrank_syncs"]
        rows.append([size, _num(r["params"] / 1e6, ".1f"), str(r["rank"]), _num(lo["bytes"] / MB, ".1f"),
                     _num(full["bytes"] / MB, ".1f"), f"**{r['bytes_ratio']:.3f}**", _num(lo["seconds_median"], ".2f"),
                     _num(full["seconds_median"], ".2f"), f"{gap['mean']:.1e} / {gap['max']:.1e}",
                     _num(r["engine"]["start_seconds"], ".0f")])  # fmt: skip
    out += _table(["size", "params (M)", "rank", "low-rank MB", "full MB", "bytes ratio", "low-rank s (median)",
                   "full s (median)", f"logprob gap after {res['run']['steps']} low-rank syncs (mean / max)",
                   "engine start s"], rows) + [""]  # fmt: skip
    head = res["sizes"].get(res["headline_size"], {})
    return out, head if head.get("ok") else None


def section_trl(res: dict) -> tuple[list[str], dict]:
    st = res["settings"]
    out = [f"Command: `{res['command']}` — {res['wall_seconds']:.0f} s, load at start {_load(res['load_start'])}, at end "
           f"{_load(res['load_end'])}. {st['steps']} steps, {st['batch_size']} prompts × {st['group_size']} samples, "
           f"lr {st['lr']:g} (LoGRA {st['logra_lr']:g}, rank {st['logra_rank']}), {st['test_size']} held-out prompts.", ""]  # fmt: skip
    rows = []
    for r in res["rows"]:
        if not r.get("ok"):
            rows.append([r["row"], "failed: " + _clip(r.get("error", ""), 160), "", "", "", ""])
            continue
        rows.append([r["row"] + (f" (trl {r['version']})" if r.get("version") else ""), _num(r["peak_bytes"] / MB, ".0f"),
                     _num(r["step_seconds_median"], ".2f"), f"{_pct(r['accuracy_before'])} → {_pct(r['accuracy_after'])}",
                     str(r["steps"]), _load(r.get("load_before"))])  # fmt: skip
    out += _table(["row", "training memory MB", "s/step (median)", "held-out accuracy", "steps", "load at start"], rows) + [""]
    return out, {}


def section_architectures(res: dict) -> tuple[list[str], dict]:
    """One row per model family: engine-vs-trainer drift after low-rank syncs, bytes per sync."""
    steps = next((r["steps"] for r in res["rows"] if r.get("ok")), "?")
    out = [f"Command: `{res['command']}` — {res['wall_seconds']:.0f} s, load at start {_load(res['load_start'])}, at end "
           f"{_load(res['load_end'])}. Per family: a tiny random-init model (2 layers, hidden 128, head dim 64, fp32), "
           f"{steps} GRPO steps with LoGRA (rank 8) and a vLLM CPU engine (fp32) kept in sync by one full sync, "
           "then a low-rank sync after every step. Drift: max |engine - trainer| logprob of sampled tokens after the "
           f"low-rank syncs (limit {res['drift_limit']:g}).", ""]  # fmt: skip
    rows = []
    for r in res["rows"]:
        if not r.get("ok"):
            rows.append([r["architecture"], "failed: " + _clip(r.get("error", ""), 160)] + [""] * 6)
            continue
        rows.append([r["architecture"], f"`{r['hf_class']}`", "tied" if r["tied_embeddings"] else "untied",
                     f"{r['lowrank_params']} ({r['lowrank_3d_params']} 3-D) / {r['dense_params']}",
                     f"**{r['drift_max']:.1e}** ({_met(r['drift_max'] <= res['drift_limit'])})",
                     f"{r['lowrank_sync_share']:.3f}", _num(r["relative_weight_change_max"], ".3f"),
                     _num(r["seconds"], ".0f")])  # fmt: skip
    out += _table(["family", "HF / vLLM class", "embeddings", "LoGRA matrices / dense params", "drift max",
                   "low-rank sync bytes / full", "max relative weight change", "s"], rows) + [""]  # fmt: skip
    return out, {}


SECTIONS = [("optimizer_memory", "Optimizer memory and speed", section_optimizer_memory),
            ("optimizer_step_time", "Step time: 1 thread, rows interleaved and repeated", section_optimizer_memory),
            ("plan_vs_measured", "Memory planner vs measurement", section_plan),
            ("quality", "Quality: held-out accuracy on the arithmetic RL task", section_quality),
            ("kl_control", "KL step control at a high learning rate", section_kl),
            ("sync_cost", "Weight sync to vLLM", section_sync),
            ("trl_grpo", "A full framework: TRL GRPOTrainer", section_trl),
            ("architectures", "Every architecture: low-rank sync into vLLM", section_architectures)]  # fmt: skip
# Recorded by their own commands (not part of `make bench`); shown when their JSON exists.
EXTRA_SECTIONS = [("memory_breakdown", "Where LoGRA's training memory goes (per-tensor accounting)", section_memory_breakdown),
                  ("direction_error", "Update direction vs. state storage (issue 18)", section_direction_error)]  # fmt: skip


def _headline(found: dict) -> list[str]:
    out = ["## Headline numbers", ""]
    acc = found.get("optimizer_memory")
    timing = found.get("optimizer_step_time")
    if acc and timing:  # the interleaved 1-thread pass is the better step-time measurement under load
        acc = {**acc, **{k: timing[k] for k in ("step_time_ratio_vs_adamw", "step_cpu_ratio_vs_adamw")}}
    if acc:
        def flag(ok: bool) -> str:
            return "target met" if ok else "**target missed**"

        out += [f"- Training memory, ~100M model, LoGRA rank 64: **{_pct(acc['train_memory_reduction_vs_adamw'])} below "
                f"AdamW** (≥ 45%: {flag(acc['train_memory_ok'])}); optimizer state **{_pct(acc['state_ratio_vs_adamw'])}** "
                f"of AdamW's (≤ 10%: {flag(acc['state_ratio_ok'])}); step time **{acc['step_time_ratio_vs_adamw']:.2f}× "
                f"AdamW** wall, {acc['step_cpu_ratio_vs_adamw']:.2f}× in CPU time (≤ 1.15×: "
                f"{flag(acc['step_time_ratio_vs_adamw'] <= 1.15)}) ([table](#optimizer-memory-and-speed))."]  # fmt: skip
    q = found.get("quality")
    if q:
        parts = [f"{row} {s['accuracy_after_vs_adamw_points']:+.1f}" for row, s in q.items()
                 if row != "adamw" and "accuracy_after_vs_adamw_points" in s]  # fmt: skip
        if parts:
            out += [f"- Held-out accuracy after RL vs AdamW (points, mean over seeds): {', '.join(parts)} "
                    "([table](#quality-held-out-accuracy-on-the-arithmetic-rl-task))."]
    s = found.get("sync_cost")
    if s:
        out += [f"- Sync to vLLM, ~{s['params'] / 1e6:.0f}M model, rank {s['rank']}: low-rank sends **{s['bytes_ratio']:.3f}×** "
                "the bytes of a full sync "
                f"({s['lowrank_sync']['seconds_median']:.2f} s vs {s['full_sync']['seconds_median']:.2f} s) "
                "([table](#weight-sync-to-vllm))."]  # fmt: skip
    return out + (["- _No full results yet._"] if len(out) == 2 else []) + [""]


def gpu_check_section(results: Path) -> list[str]:
    """The GPU check's paragraph; says whether ``gpu_check.json`` (written only on a GPU machine) exists."""
    ran = (results / "gpu_check.json").is_file()
    out = [f"## GPU check ({'results in `results/gpu_check.json`' if ran else 'not yet run on a GPU'})", "",
           "`scripts/gpu_check.sh` is the one-command check of the CUDA path (≤ 10 min including installs, nothing",
           "from a hub): random-init Qwen2.5-0.5B / 1.5B / 4-layer 7B shapes, a few GRPO steps each with dense",
           "AdamW and with LoGRA, vLLM colocated on the same GPU; peak memory per phase vs `logra plan`, s/step,",
           "sync bytes and seconds, engine drift, predicted vs realized KL, written to",
           "`benchmarks/results/gpu_check.json` (see `scripts/gpu_check.py`). `scripts/gpu_check.sh --dry-run`",
           "rehearses the same path on this CPU machine."]  # fmt: skip
    if not ran:
        out.append("No GPU has been lent yet, so there is no such file.")
    return out + [""]


def build(quick: bool, results: Path, readme: Path) -> str:
    body, found, machine, walls = [], {}, None, {}
    for name, title, fn in SECTIONS:
        body += [f"## {title}", ""]
        path = results / f"{name}{'_quick' if quick else ''}.json"
        if not path.is_file():
            body += _missing(name, quick)
            continue
        res = json.loads(path.read_text())
        walls[name] = res.get("wall_seconds")
        machine = machine or (res["machine"] if "versions" in res.get("machine", {}) else None)
        lines, found[name] = fn(res)
        body += lines + _plot(name, quick, results, readme.parent)
    for name, title, fn in EXTRA_SECTIONS:
        path = results / f"{name}.json"
        if not quick and path.is_file():
            body += [f"## {title}", ""] + fn(json.loads(path.read_text()))[0]
    head = ["# Benchmarks", "",
            f"_Generated by `benchmarks/make_readme.py` from `{results.relative_to(ROOT) if results.is_relative_to(ROOT) else results}/"
            f"*{'_quick' if quick else ''}.json`; do not edit by hand._"
            + (" **Quick smoke results: tiny sizes, not measurements.**" if quick else ""), ""]  # fmt: skip
    head += _headline(found)
    head += ["## How to reproduce", "", "```", "make bench                                  # installs the `bench` extra, runs everything",
             ".venv/bin/python benchmarks/run_all.py      # the same without the install",
             ".venv/bin/python benchmarks/run_all.py --quick   # every script's --quick mode (CI smoke)", *COMMANDS.values(),
             ".venv/bin/python benchmarks/plots.py && .venv/bin/python benchmarks/make_readme.py", "```", ""]  # fmt: skip
    if walls and all(walls.values()):
        head += [f"Wall time of the runs behind these results (one after another, as `make bench` runs them): "
                 + ", ".join(f"{name} {w / 60:.1f} min" for name, w in walls.items())
                 + f"; **{sum(walls.values()) / 60:.0f} min** in all.", ""]  # fmt: skip
    if machine:
        v = machine.get("versions", {})
        head += ["## Machine", "", f"{machine['cpu']}, {machine['cores']} cores, "
                 f"{_num((machine.get('mem_total_bytes') or 0) / 2**30, '.0f')} GiB, no GPU; Python {machine['python']}; "
                 + ", ".join(f"{k} {val}" for k, val in v.items() if val) + ". The machine is shared: every table gives the "
                 "load average (1/5/15 min, runnable processes on 2 cores) when it was measured; memory numbers are robust "
                 "to load, wall-clock times are not (CPU-time ratios are given beside them).", ""]  # fmt: skip
    return "\n".join(head + body + ([] if quick else gpu_check_section(results))) + "\n"


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="from *_quick.json into results/README_quick.md")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = Path(args.results)
    out = Path(args.out) if args.out else (results / "README_quick.md" if args.quick else ROOT / "benchmarks" / "README.md")
    out.write_text(build(args.quick, results, out))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
