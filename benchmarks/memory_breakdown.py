"""Where LoGRA's training memory goes: per-tensor accounting at the peak, against the no-optimizer floor.

Run (~100M shape, ~10 min on a quiet machine; rows ``logra``, ``logra_prev`` (before issue 18)
and ``floor_nograd`` of ``benchmarks/optimizer_memory.py``, same model, data and step):

    .venv/bin/python -m benchmarks.memory_breakdown
    .venv/bin/python -m benchmarks.memory_breakdown --sizes 25m --rows logra floor_nograd --out /tmp/b.json

Each row runs in its own subprocess, three times:

* ``profiled``: under ``torch.profiler`` with ``profile_memory=True`` from before the model is
  built, with ``record_function`` scopes around forward, backward, ``opt.step()`` and LoGRA's
  internals (gradient hook, moments/direction, basis refresh, weight update). Every CPU
  allocation and free is replayed in time order, so the live tensor bytes at every instant are
  exact; at the peak of each step the live allocations are grouped: parameters, optimizer state
  (storages found in ``opt.state`` after the run), and the rest by the scope and op that allocated
  them (the largest ones listed with their size).
* ``rss_default``: no profiler, the allocators as ``optimizer_memory.py`` runs them; the kernel's
  peak RSS (VmHWM) per phase (reset at every phase start) and over the run.
* ``rss_live``: the same with ``MALLOC_MMAP_THRESHOLD_=65536 MKL_DISABLE_FAST_MM=1`` (every
  allocation >= 64 KiB is its own mapping, returned to the OS when freed): RSS follows live bytes.

``allocator_slack`` = ``rss_default`` peak / ``rss_live`` peak - 1 (what glibc keeps resident). All
peaks are relative to the RSS just before the model is built, as in ``optimizer_memory.py``.
Results: ``benchmarks/results/memory_breakdown.json``.
"""

from __future__ import annotations

import gc
from collections import defaultdict

from benchmarks.common import (
    proc_memory,
    reset_peak_rss,
    shape_config,
)
from benchmarks.harness import Benchmark, bench, main
from benchmarks.optimizer_memory import RUN, _build_model
from benchmarks.optimizer_rows import make_optimizer
from benchmarks.report import MB, Col, command_head, table

ROWS = ["logra", "logra_prev", "floor_nograd"]
MODES = {"profiled": {}, "rss_default": {}, "rss_live": {"MALLOC_MMAP_THRESHOLD_": "65536", "MKL_DISABLE_FAST_MM": "1"}}
_LOGRA_SCOPES = {  # LoGRA method -> record_function name (wrapped in the worker only)
    "_accumulate": "logra.hook_sketch",
    "_prepare_lowrank": "logra.moments_direction",
    "_next_basis": "logra.refresh_basis",
    "_apply": "logra.apply",
    "zero_grad": "logra.zero_grad",
}
_SKETCH_SCOPES = {"project": "logra.gradient_sketch", "range_sketch": "logra.range_sketch", "gaussian": "logra.omega"}
_CANDIDATE_SCOPES = {"move_": "logra.apply_update", "dense_candidate": "logra.dense_adam"}  # called as cand.<name>


def _wrap_logra_scopes() -> None:
    import functools

    import torch

    from logra_lightning.optim import LoGRA, candidate, sketch

    for owner, scopes in ((LoGRA, _LOGRA_SCOPES), (sketch, _SKETCH_SCOPES), (candidate, _CANDIDATE_SCOPES)):
        for meth, label in scopes.items():
            fn = getattr(owner, meth, None)
            if fn is None:
                continue

            def wrapped(*a, __fn=fn, __label=label, **k):
                with torch.profiler.record_function(__label):
                    return __fn(*a, **k)

            setattr(owner, meth, functools.wraps(fn)(wrapped))


def _one_step(model, opt, ids, phase_rss: list | None, scope, i: int):
    """Forward, backward, step, zero_grad; per-phase VmHWM when ``phase_rss`` is a list."""
    phases = {}

    def mark(name, fn):
        if phase_rss is not None:
            reset_peak_rss()
        with scope(f"step{i}.{name}"):
            out = fn()
        if phase_rss is not None:
            phases[name] = proc_memory()["VmHWM"]
        return out

    loss = mark("forward", lambda: model(input_ids=ids, labels=ids).loss)
    mark("backward", loss.backward)
    if opt is not None:
        mark("optimizer_step", opt.step)
        mark("zero_grad", lambda: opt.zero_grad(set_to_none=True))
    else:
        mark("zero_grad", lambda: model.zero_grad(set_to_none=True))
    if phase_rss is not None:
        phase_rss.append(phases)
    return loss


def _state_ptrs(opt) -> dict[int, str]:
    import torch

    out = {}
    if opt is None:
        return out
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes():
                out[v.untyped_storage().data_ptr()] = k
    return out


def _scope_chain(node) -> tuple[str, str]:
    """(innermost record_function scope, leaf op) of an allocation node in the profiler's event tree."""
    op, scopes = None, []
    p = node.parent
    while p is not None:
        name = p.name
        if op is None and not name.startswith(("step", "logra.", "build")):
            op = name
        if name.startswith(("step", "logra.", "build")):
            scopes.append(name)
        p = p.parent
    return (" > ".join(reversed(scopes)) or "(none)", op or "(none)")


def _replay(prof, model, state_at_start: list[dict[int, str]]) -> dict:
    """Replay every CPU allocation; the live set at each step's peak, grouped.

    ``state_at_start[s]``: storage pointer -> state key of the optimizer state live when step ``s``
    began (a state tensor still live at the step's peak is that same allocation).
    """
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    step_spans = {}
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation:
            a = e.typed[1]
            if a.device.type == "cpu":
                events.append((e.start_time_ns, a.ptr, a.alloc_size, e))
        elif e.name.startswith("step") and "." in e.name:
            step = int(e.name[4 : e.name.index(".")])
            lo, hi = step_spans.get(step, (float("inf"), 0))
            step_spans[step] = (min(lo, e.start_time_ns), max(hi, e.end_time_ns))
    events.sort(key=lambda t: t[0])
    params = {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()}
    live: dict[int, tuple[int, object]] = {}
    total = 0
    peaks = {s: (-1, None, None) for s in step_spans}  # step -> (bytes, time, snapshot)
    build_peak = 0
    for t, ptr, size, node in events:
        if size > 0:
            live[ptr] = (size, node)
        else:
            live.pop(ptr, None)
        total += size
        for s, (lo, hi) in step_spans.items():
            if lo <= t <= hi and total > peaks[s][0]:
                peaks[s] = (total, t, None)
        if not any(lo <= t <= hi for lo, hi in step_spans.values()):
            build_peak = max(build_peak, total)
    # second pass: snapshot the live set at each step's peak time
    want = {v[1]: s for s, v in peaks.items()}
    live, snaps = {}, {}
    for t, ptr, size, node in events:
        if size > 0:
            live[ptr] = (size, node)
        else:
            live.pop(ptr, None)
        if t in want and want[t] not in snaps:
            snaps[want[t]] = _group(live, params, state_at_start[want[t]])
    out = {}
    for s, (b, _t, _) in sorted(peaks.items()):
        out[f"step{s}"] = {"peak_live_bytes": b, "groups": snaps.get(s)}
    out["untracked_note"] = (
        "allocations made before the profiler started are not seen (none: it starts before the build)"
    )
    return out


def _group(live: dict, params: dict, state: dict) -> dict:
    groups: dict[str, int] = defaultdict(int)
    big = []
    for ptr, (size, node) in live.items():
        if ptr in params:
            key = "parameters"
        elif ptr in state:
            key = f"optimizer_state.{state[ptr]}"
        else:
            scope, op = _scope_chain(node)
            scope = scope.split(" > ")[-1] if scope != "(none)" else scope
            key = f"{scope} | {op}"
        groups[key] += size
        if size >= 1_000_000:
            big.append((size, key))
    big.sort(reverse=True)
    return {
        "by_group_mb": {k: round(v / MB, 2) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "n_live_allocations": len(live),
        "largest_mb": [[round(s / MB, 2), k] for s, k in big[:40]],
    }


def worker(name: str, size: str, mode: str, steps: int) -> dict:
    import torch

    run = RUN["full"]
    torch.set_num_threads(run["threads"])
    cfg = shape_config(size)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg["vocab_size"], (run["batch"], run["seq"]), generator=gen) for _ in range(steps)]
    import contextlib

    from transformers import Qwen2ForCausalLM  # noqa: F401

    profiled = mode == "profiled"
    if profiled:
        _wrap_logra_scopes()
    scope = torch.profiler.record_function if profiled else (lambda _n: contextlib.nullcontext())
    gc.collect()
    reset_peak_rss()
    rss_before = proc_memory()["VmRSS"]
    prof_cm = (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        if profiled
        else contextlib.nullcontext()
    )
    phase_rss = None if profiled else []
    state_at_start = []
    with prof_cm as prof:
        with scope("build"):
            model = _build_model(cfg, run["seq"])
            opt = make_optimizer(name, model, run["rank"])
        build_hwm = proc_memory()["VmHWM"]
        for i, ids in enumerate(data):
            state_at_start.append(_state_ptrs(opt))
            _one_step(model, opt, ids, phase_rss, scope, i)
    row = {"name": name, "size": size, "mode": mode, "steps": steps, "rss_before_model_bytes": rss_before}
    if profiled:
        row["live"] = _replay(prof, model, state_at_start)
        from logra_lightning.optim.accounting import optimizer_state_bytes, param_bytes

        row["param_bytes"] = param_bytes(model)
        row["optimizer_state_bytes"] = optimizer_state_bytes(opt) if opt is not None else 0
    else:
        row["build_peak_bytes"] = build_hwm - rss_before
        row["phase_peak_bytes"] = [{k: v - rss_before for k, v in ph.items()} for ph in phase_rss]
        row["train_peak_bytes"] = max([build_hwm] + [v for ph in phase_rss for v in ph.values()]) - rss_before
    return row


@bench(
    "memory_breakdown",
    title="Where LoGRA's training memory goes (per-tensor accounting)",
    quick=["--sizes", "quick", "--steps", "2"],
    variants=("memory_breakdown_before_issue18",),
)
class MemoryBreakdown(Benchmark):
    isolate = True  # each (size, row, allocator mode) in a fresh process, under that mode's environment

    def add_arguments(self, ap) -> None:
        ap.add_argument("--sizes", nargs="*", default=["100m"])
        ap.add_argument("--rows", nargs="*", default=ROWS)
        ap.add_argument("--modes", nargs="*", default=list(MODES))
        ap.add_argument("--steps", type=int, default=3, help="steps per row (step 0 is LoGRA's refresh step)")

    def settings(self, args) -> dict:
        return {**RUN["full"], "steps": args.steps, "allocators": MODES}

    def row_names(self, args, settings: dict) -> list[str]:
        return [f"{size}/{name}/{mode}" for size in args.sizes for name in args.rows for mode in args.modes]

    def worker_env(self, name: str, settings: dict) -> dict[str, str]:
        return MODES[name.split("/")[2]]

    def measure(self, name: str, settings: dict) -> dict:
        size, row, mode = name.split("/")
        return worker(row, size, mode, settings["steps"])

    def summarize(self, settings: dict, rows: list[dict]) -> dict:
        return _summary([r["metrics"] for r in rows if r["ok"]])

    def section(self, res: dict) -> list[str]:
        """Per row: live tensor peak, RSS peak under both allocators, the slack; then the largest live groups."""
        cols = [
            Col("row", "name"),
            Col("live tensor peak MB", lambda s: s.get("peak_live_bytes", 0), "mb0"),
            Col("RSS peak, mmap allocator MB", lambda s: s.get("rss_live_train_peak_bytes", 0), "mb0"),
            Col("RSS peak, default MB", lambda s: s.get("rss_default_train_peak_bytes", 0), "mb0"),
            Col("allocator slack", "allocator_slack", "pct"),
            Col("state MB", lambda s: s.get("optimizer_state_bytes", 0), "mb1"),
        ]
        out = [command_head(res, end=False), "", *table([{"name": k, **s} for k, s in res["summary"].items()], cols)]
        out.append("")
        for r in (r["metrics"] for r in res["rows"] if r["ok"]):
            if r.get("mode") != "profiled" or "live" not in r:
                continue
            step = max((k for k in r["live"] if k.startswith("step")), key=lambda k: r["live"][k]["peak_live_bytes"])
            top = ", ".join(f"{k} {v:.1f}" for k, v in list(r["live"][step]["groups"]["by_group_mb"].items())[:8])
            out += [f"- `{r['size']}/{r['name']}` live peak at {step}: {top} (MB)."]
        return out + [""]


def _summary(rows: list[dict]) -> dict:
    out = {}
    for r in rows:
        key = f"{r['size']}/{r['name']}"
        s = out.setdefault(key, {})
        if r.get("mode") == "profiled" and "live" in r:
            s["peak_live_bytes"] = max(v["peak_live_bytes"] for k, v in r["live"].items() if k.startswith("step"))
            s["optimizer_state_bytes"] = r["optimizer_state_bytes"]
        elif "train_peak_bytes" in r:
            s[f"{r['mode']}_train_peak_bytes"] = r["train_peak_bytes"]
    for s in out.values():
        if "rss_default_train_peak_bytes" in s and "rss_live_train_peak_bytes" in s:
            s["allocator_slack"] = s["rss_default_train_peak_bytes"] / s["rss_live_train_peak_bytes"] - 1
    return out


if __name__ == "__main__":
    main(MemoryBreakdown)
