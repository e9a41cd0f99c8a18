"""A full framework beside this one: TRL's ``GRPOTrainer`` vs ``logra fit`` on the same RL task.

Run (full: the AdamW config's steps, ~3 runs of a few minutes each on 2 cores):

    .venv/bin/python -m benchmarks.trl_grpo
    .venv/bin/python -m benchmarks.trl_grpo --lr 3e-5 --steps 300
    .venv/bin/python -m benchmarks.trl_grpo --quick          # 3 steps, 64 held-out prompts (CI)
    # the real model (SmolLM2-135M-Instruct, reasoning-gym chain_sum), lrs as the real-model table swept them:
    .venv/bin/python -m benchmarks.trl_grpo --config configs/smollm2_chain_sum.yaml --lr 3e-6 --logra-lr 3e-5 \
        --lora-lr 1e-4 --rows trl_grpo logra_adamw logra_logra logra_lora --out benchmarks/results/trl_grpo_smollm2.json

Rows, each in its own process (``--worker``), on the config's model, problems, reward, precision
(``bf16-mixed`` -> TRL's ``bf16=True``, autocast over fp32 weights) and torch threads:

* ``trl_grpo``: ``trl.GRPOTrainer`` (version pinned in ``pyproject.toml``'s ``bench`` extra),
  its own generation (``model.generate`` on CPU: TRL's vLLM path supports vLLM 0.22-0.31 on a GPU,
  here vLLM is 0.32's CPU build), ``torch.optim.AdamW``;
* ``logra_adamw``: ``logra fit`` with the config and AdamW (in-process, ``cli.main``);
* ``logra_logra``: the same with LoGRA (rank and gap from the LoGRA config, :func:`benchmarks.common.logra_defaults`);
* ``logra_lora``: the same with LoRA (PEFT, :mod:`logra_lightning.models.lora`; rank 16, alpha 32, every
  attention/MLP matrix) and AdamW on the factors at the LoRA config's lr (``--lora-lr``);
* ``trl_grpo_lora``: ``trl.GRPOTrainer`` with the same LoRA as its ``peft_config`` and lr.

The ``logra fit`` rows keep the config's callbacks (with the real-model config: the weight sync to vLLM, and
KL step control in the LoGRA row only: the comparison charges its cost to LoGRA); their s/step includes the
sync, as TRL's includes its generation.
Matched to the config: prompts per step (``batch_size``), ``group_size`` samples per prompt,
``max_new_tokens``, temperature, lr (constant, no warm-up, no gradient clipping: the Lightning
loop has neither), token-level PPO-clip loss with ``clip_low``/``clip_high`` 0.2/0.28
(TRL ``loss_type="dapo"``, ``epsilon_high=0.28``), group-std-normalized advantages, no KL
term (``beta=0``), one optimizer step per rollout batch, the config's reward. Held-out accuracy
of every row is measured with the same code (greedy decoding in the config's engine,
:func:`~logra_lightning.rollout.greedy.greedy_accuracy`, the config's reward) before and after training. Memory is
measured like :mod:`benchmarks.optimizer_memory`: VmHWM over training minus VmRSS after imports,
before the model is loaded. If TRL cannot run here its row records the error.
Results: ``benchmarks/results/trl_grpo.json`` (tiny model), ``trl_grpo_smollm2.json`` (real model).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path

from benchmarks.common import (
    CONFIGS,
    QUICK_BUDGET,
    WORK_DIR,
    adamw,
    config_defaults,
    instantiate,
    logra_defaults,
    lora_adapter,
    lora_lr,
    peak_rss,
    rss_baseline,
)
from benchmarks.harness import Benchmark, bench, flat, main
from benchmarks.report import Col, pct

ROWS = ("trl_grpo", "logra_adamw", "logra_logra", "logra_lora", "trl_grpo_lora")
QUICK_STEPS = 3
PHASES = ("perf/time/rollout", "perf/time/forward_backward", "perf/time/optimizer", "kl/control_seconds", "perf/mfu")


def _task(s: dict) -> dict:
    """The config's model, problems, reward, evaluation engine, precision and threads, built as ``logra fit`` does."""
    import yaml

    from logra_lightning.builtin import resolve_model
    from logra_lightning.rewards.weighted import as_reward
    from logra_lightning.rollout import HFEngineSpec

    cfg = yaml.safe_load(Path(s["config"]).read_text())
    model, data = cfg["model"], cfg["data"]
    sized = lambda split: {**split, "init_args": {**split["init_args"], "test_size": s["test_size"]}}  # noqa: E731
    return {
        "path": resolve_model(model["model"]),
        # their prompts are rendered once the tokenizer is known (load())
        "sources": [instantiate(sized(data[split])) for split in ("train", "val")],
        "reward": as_reward(instantiate(model.get("reward"))),
        "engine": instantiate(model.get("engine")) or HFEngineSpec(),
        "bf16": str(cfg.get("trainer", {}).get("precision", "32")).startswith("bf16"),
        "threads": model.get("torch_threads") or 1,
    }


def _accuracy(task: dict, model, tok, s: dict) -> float:
    """Held-out greedy accuracy in the config's engine, as the module's evaluation measures it."""
    import tempfile

    from logra_lightning.rollout import HFEngineSpec
    from logra_lightning.rollout.greedy import greedy_accuracy

    with tempfile.TemporaryDirectory() as d:
        path = task["path"]
        if not isinstance(task["engine"], HFEngineSpec):
            model.save_pretrained(d)  # a separate engine process loads the trained weights from disk
            tok.save_pretrained(d)
            path = d
        engine = task["engine"].build(path, model, tok)
        try:
            return greedy_accuracy(
                engine, tok, task["test"], task["reward"], max_new_tokens=s["max_new_tokens"], batch_size=128
            )
        finally:
            getattr(engine, "close", lambda: None)()


def run_trl(s: dict, lora: dict | None = None) -> dict:
    """Train with ``trl.GRPOTrainer`` (with ``lora``: the ``init_args`` of a LoRA adapter, as PEFT's
    ``peft_config``); returns timings, accuracy and memory fields."""
    import torch

    task = _task(s)
    torch.set_num_threads(task["threads"])
    import datasets
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401  (model code imported before the baseline)
    import trl
    from transformers import TrainerCallback

    from logra_lightning.models import load_policy

    def score(prompts, completions, answer, **_):
        return task["reward"](prompts, completions, answer)

    step_times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_times.append(time.perf_counter() - self.t0)

    rss_before = rss_baseline()
    model, tok = load_policy(task["path"])
    for src in task["sources"]:
        src.tokenizer = tok  # the prompts in the policy's chat template, as the data module renders them
    train, task["test"] = (src.load() for src in task["sources"])
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train])
    acc_before = _accuracy(task, model, tok, s)
    n = s["batch_size"] * s["group_size"]
    peft_config = None
    if lora is not None:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=lora["rank"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=lora["target_modules"],
            bias="none",
            task_type="CAUSAL_LM",
        )
    cfg = trl.GRPOConfig(
        output_dir=str(WORK_DIR / "trl_grpo"),
        max_steps=s["steps"],
        learning_rate=s["lora_lr"] if lora else s["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=0.0,
        weight_decay=0.0,
        optim="adamw_torch",
        per_device_train_batch_size=n,
        num_generations=s["group_size"],
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        top_p=1.0,
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="group",
        use_vllm=False,
        use_cpu=True,
        bf16=task["bf16"],  # the config's precision: bf16 autocast over fp32 weights, as Lightning's bf16-mixed
        fp16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        seed=s["seed"],
        data_seed=s["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=score,
        args=cfg,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[StepTimer()],
        peft_config=peft_config,
    )
    t0 = time.perf_counter()
    out = trainer.train()
    seconds = time.perf_counter() - t0
    peak = peak_rss()  # training's peak, before the evaluation engine is built
    acc_after = _accuracy(task, trainer.model, tok, s)
    rewards = [[h["step"], h["reward"]] for h in trainer.state.log_history if "reward" in h]
    return {
        "version": trl.__version__,
        "accuracy_before": acc_before,
        "accuracy_after": acc_after,
        "steps": int(out.global_step),
        "train_seconds": seconds,
        "step_seconds": step_times,
        "reward_mean": rewards,
        "rss_before_model_bytes": rss_before,
        "peak_rss_bytes": peak,
    }


def run_logra(s: dict, optimizer: dict, extra: list[str] = ()) -> dict:
    """``logra fit`` in this process (``cli.main``), so this process's VmHWM is the run's peak."""
    import lightning  # noqa: F401  (imports before the baseline, as for TRL)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    from benchmarks.common import budget_args, config_callbacks, fit_argv, seed_args, tb_scalars
    from logra_lightning.cli import run as logra_run

    _task(s)  # builds and caches the model outside the measurement
    name = f"trl_compare_{optimizer['class_path'].rsplit('.', 1)[-1]}{'_lora' if extra else ''}"
    seeds = [*seed_args(s["seed"]), *extra]
    args = [*budget_args(s["steps"], s["steps"], s["test_size"]), "--trainer.enable_progress_bar", "false", *seeds]
    log_dir = WORK_DIR / name / "version_0"
    shutil.rmtree(log_dir, ignore_errors=True)  # a rerun's TensorBoard scalars must not mix with an earlier run's
    rss_before = rss_baseline()
    t0 = time.perf_counter()
    drop = ("ModelCheckpoint",) if optimizer["class_path"].endswith("LoGRA") else ("ModelCheckpoint", "KLStepControl")
    logra_run(fit_argv(name, s["config"], args, optimizer, config_callbacks(s["config"], drop)))
    seconds = time.perf_counter() - t0
    summary = json.loads((Path(log_dir) / "summary.json").read_text())
    sc = tb_scalars(log_dir, ["perf/step_seconds", "reward/mean", "sync/seconds", *PHASES])
    steps = [v for _, v in sc["perf/step_seconds"]]
    syncs = [v for _, v in sc.get("sync/seconds", [])][-len(steps) :]  # the start's full sync comes first
    syncs = syncs if len(syncs) == len(steps) else [0.0] * len(steps)
    return {
        "accuracy_before": summary["accuracy_before"],
        "accuracy_after": summary["accuracy_after"],
        "steps": summary["steps"],
        "train_seconds": summary["train_seconds"],
        "fit_seconds": seconds,
        "step_seconds": [a + b for a, b in zip(steps, syncs)],  # with the weight sync: TRL's step has none
        "sync_seconds": syncs,
        "reward_mean": sc.get("reward/mean", []),
        "rss_before_model_bytes": rss_before,
        # medians over the steps after the first (it compiles): where the step's time goes
        "phases": {k: statistics.median(v for _, v in sc[k][1:] or sc[k]) for k in PHASES if k in sc},
    }


def settings(args) -> dict:
    """The run's settings, from the configs unless a flag overrides them."""
    base, logra = config_defaults(args.config), logra_defaults()
    lr = args.lr or base["lr"]
    return {
        "config": args.config,
        "steps": args.steps or (QUICK_STEPS if args.quick else base["max_steps"]),
        "lr": lr,
        "logra_lr": args.logra_lr or args.lr or logra.get("lr") or base["lr"],
        "logra_rank": logra.get("rank") or 8,
        "update_proj_gap": logra.get("update_proj_gap") or 50,
        "batch_size": base["batch_size"],
        "group_size": base["group_size"],
        "max_new_tokens": base["max_new_tokens"],
        "temperature": base["temperature"],
        "seed": 0,
        "lora_lr": lora_lr(args, lr),
        "lora_adapter": lora_adapter(16),
        "test_size": QUICK_BUDGET["test_size"] if args.quick else (base["held_out_prompts"] or 256),
    }


@bench("trl_grpo", title="A full framework: TRL GRPOTrainer", full=["--steps", "100"], variants=("trl_grpo_smollm2",))
class TrlGrpo(Benchmark):
    isolate = True  # each row's peak memory in a process of its own

    flags = {"config": str(CONFIGS / "arithmetic_tiny_adamw.yaml"), "lr": None, "steps": None, "rows": list(ROWS)}
    columns = [
        Col("row", lambda r: r["name"] + (f" (trl {r['version']})" if r.get("version") else "")),
        Col("training memory MB", "peak_bytes", "mb0"),
        Col("s/step (median)", "step_seconds_median", ".2f"),
        Col("held-out accuracy", lambda r: f"{pct(r['accuracy_before'])} → {pct(r['accuracy_after'])}"),
        Col("steps", "steps"),
        Col("load at start", "load_before", "load"),
    ]

    def add_arguments(self, ap) -> None:
        ap.add_argument(
            "--logra-lr", type=float, default=None, help="lr of the LoGRA row (default: --lr, else the LoGRA config's)"
        )
        ap.add_argument("--lora-lr", type=float, default=None, help="lr of the LoRA rows (default: the LoRA config's)")

    settings = staticmethod(settings)

    def row_names(self, args, settings: dict) -> list[str]:
        return args.rows

    def measure(self, name: str, s: dict) -> dict:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        logra = {"lr": s["logra_lr"], "rank": s["logra_rank"], "update_proj_gap": s["update_proj_gap"]}
        rows = {
            "trl_grpo": lambda: run_trl(s),
            "logra_adamw": lambda: run_logra(s, adamw(s["lr"])),
            "logra_logra": lambda: run_logra(s, {"class_path": "logra_lightning.optim.LoGRA", "init_args": logra}),
            "logra_lora": lambda: run_logra(s, adamw(s["lora_lr"]), ["--model.adapter", json.dumps(s["lora_adapter"])]),
            "trl_grpo_lora": lambda: run_trl(s, s["lora_adapter"]["init_args"]),
        }
        if name not in rows:
            raise ValueError(f"unknown row {name!r} (allowed: {', '.join(ROWS)})")
        out = rows[name]()
        steady = out["step_seconds"][1:] or out["step_seconds"]
        return {
            **out,
            "peak_bytes": out.get("peak_rss_bytes", peak_rss()) - out["rss_before_model_bytes"],
            "step_seconds_median": statistics.median(steady) if steady else None,
        }

    def describe(self, res: dict) -> str:
        st = res["settings"]
        return (
            f"`configs/{Path(st['config']).name}`, {st['steps']} steps, "
            f"{st['batch_size']} prompts × {st['group_size']} samples, "
            f"lr {st['lr']:g} "
            f"(LoGRA {st['logra_lr']:g}, rank {st['logra_rank']}), {st['test_size']} held-out prompts."
        )

    def plot(self, res: dict, plt):
        """Memory, s/step and accuracy after, one bar per row."""
        rows = [flat(r) for r in res["rows"] if r["ok"]]
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
        panels = [
            ("peak_bytes", "training memory (MB)", 1e6),
            ("step_seconds_median", "seconds per RL step (median)", 1.0),
            ("accuracy_after", "held-out accuracy after (%)", 0.01),
        ]
        for ax, (key, title, scale) in zip(axes, panels):
            ax.bar([r["name"] for r in rows], [r[key] / scale for r in rows], color=[f"C{i}" for i in range(len(rows))])
            ax.set_title(title, fontsize=9)
            ax.tick_params(axis="x", labelsize=8)
        fig.suptitle(f"TRL GRPOTrainer vs logra fit, {res['settings']['steps']} steps", fontsize=10)
        return fig


if __name__ == "__main__":
    main(TrlGrpo)
