"""``LogCompletions``: what the policy says, every few steps, where you can read it.

Every ``every_n_steps`` RL steps it takes the first ``num_rows`` samples of the step's rollout
(``pl_module.last_samples``, a :class:`~logra_lightning.rl.samples.ScoredSamples`: step, prompt,
completion, answer, reward and, with :class:`~logra_lightning.rewards.WeightedRewards`, each part)
and writes them

* appended to ``completions.jsonl`` in the run's log directory (one JSON object per sample, the
  texts whole; verl's rollout dump),
* as a text table under ``completions`` to every TensorBoard logger,
* as a table under ``completions`` to every W&B logger (TRL's ``log_completions``),

and at the end of fit prints the first ``print_rows`` of the last step it logged (each prompt's end, where
the question is). TensorBoard and the printout show a reasoning-gym record's reference answer, the JSONL its
whole address. ``logra fit``
adds it (every 10 steps) unless the config names one. A module without ``last_samples`` (not
:class:`~logra_lightning.PolicyGradientModule`) is left alone.

Run: ``logra fit --config arithmetic_tiny_adamw --trainer.callbacks+=log_completions``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from logra_lightning.errors import ConfigError
from logra_lightning.rewards.reasoning_gym import readable_answer

COLUMNS = ("step", "prompt", "completion", "answer", "reward")


def _cell(value: Any, max_chars: int | None) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    return text if max_chars is None or len(text) <= max_chars else text[: max_chars - 1] + "…"


def _tail(text: str, max_chars: int) -> str:
    """The end of ``text``: a chat-templated prompt starts with its system prompt and ends with the question."""
    return text if len(text) <= max_chars else "…" + text[-(max_chars - 1) :]


def markdown_table(rows: list[dict], max_chars: int | None = None) -> str:
    """``rows`` as a Markdown table (what TensorBoard's text tab renders); ``|`` and newlines escaped.

    Example::

        >>> print(markdown_table([{"step": 0, "prompt": "1+1=", "completion": "2\\n", "reward": 1.0}]))
        | step | prompt | completion | reward |
        |---|---|---|---|
        | 0 | 1+1= | 2<br> | 1.000 |
    """
    keys = list(rows[0]) if rows else list(COLUMNS)

    def fmt(v: Any) -> str:
        return _cell(v, max_chars).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


class LogCompletions(Callback):
    """Sample completions to ``completions.jsonl``, TensorBoard text and W&B tables (see the module notes).

    Args:
        every_n_steps: log the rollout of every this many RL steps (the first step's too).
        num_rows: samples logged per time (the first ones of the rollout: a prompt's group together).
        print_rows: samples printed at the end of fit (0: none).
        max_chars: longest text shown per cell in TensorBoard and the printout (``completions.jsonl``
            keeps the texts whole); ``None``: no limit.

    Raises:
        ConfigError: a non-positive ``every_n_steps`` or ``num_rows``, a negative ``print_rows``.

    Logged metrics:
        None as scalars. Writes ``<log_dir>/completions.jsonl`` (keys ``step``, ``prompt``, ``completion``,
        ``answer``, ``reward`` and ``reward/<part>``), the TensorBoard text ``completions`` and the W&B
        table ``completions`` (same columns).

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(max_steps=100, callbacks=[LogCompletions(every_n_steps=20, num_rows=4)])
    """

    def __init__(self, every_n_steps: int = 10, num_rows: int = 8, print_rows: int = 4, max_chars: int | None = 300):
        for key, value, low in (
            ("every_n_steps", every_n_steps, 1),
            ("num_rows", num_rows, 1),
            ("print_rows", print_rows, 0),
        ):
            if not (isinstance(value, int) and value >= low):
                raise ConfigError(f"LogCompletions.{key}={value!r}: must be an integer >= {low}")
        self.every_n_steps, self.num_rows, self.print_rows, self.max_chars = (
            every_n_steps,
            num_rows,
            print_rows,
            max_chars,
        )
        self.last_logged: int | None = None
        self.last_rows: list[dict] = []
        self.path: Path | None = None

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # trainer.log_dir is a broadcast under DDP/FSDP: every rank reads it here, not rank 0 alone in _write
        self.path = Path(trainer.log_dir or trainer.default_root_dir) / "completions.jsonl"

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        samples = getattr(pl_module, "last_samples", None)
        if samples is None or samples.step == self.last_logged or samples.step % self.every_n_steps:
            return
        self.last_logged = samples.step
        self.last_rows = samples.rows(self.num_rows)
        self._write(trainer, self.last_rows)

    @rank_zero_only
    def _write(self, trainer: L.Trainer, rows: list[dict]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        step = rows[0]["step"] if rows else trainer.global_step
        for logger in trainer.loggers:
            kind = type(logger).__name__
            if kind == "TensorBoardLogger":
                shown = [r | {"answer": readable_answer(r["answer"])} for r in rows]
                logger.experiment.add_text("completions", markdown_table(shown, self.max_chars), global_step=step)
            elif kind == "WandbLogger":
                logger.log_table(key="completions", columns=list(rows[0]), data=[list(r.values()) for r in rows])

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.print_rows or not self.last_rows:
            return
        rows = self.last_rows[: self.print_rows]
        lines = [f"\nsample completions at RL step {rows[0]['step']} (all logged samples: {self.path}):"]
        for r in rows:
            lines.append(
                f"  reward {r['reward']:.3f} | answer {_cell(readable_answer(r['answer']), 60)!r} | "
                f"{_tail(r['prompt'], 80)!r} -> "
                f"{_cell(r['completion'], self.max_chars)!r}"
            )
        # print, not logging: vLLM reconfigures the logging module (as rl/evaluation.py's summary line notes)
        rank_zero_only(print)("\n".join(lines), flush=True)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_logged": self.last_logged}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_logged = state_dict.get("last_logged")
