"""A callback for benchmarks: the held-out greedy completions before and after RL, to see *what* RL changed.

``benchmarks/real_model_tasks.py`` adds it to ``logra fit``. At the start of training and at the end of the
fit it decodes the data module's held-out prompts greedily through the module's rollout engine (the path
``val/accuracy`` takes) and writes ``answers.json`` into the run's log directory::

    {"before": {"answers": [...], "scores": [...]}, "after": {...}, "references": [...]}

``answers`` are what the module's reward reads from each completion (its ``answer_of``, when it has one;
else the stripped completion), ``scores`` the reward. From them the benchmark reports the share of the most
common answer before and after, beside the majority-answer baseline of the held-out set: RL that only
learned to repeat one frequent answer shows up there.

Example::

    >>> cb = HeldOutAnswers()
    >>> cb.record
    {}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from typing_extensions import override

from logra_lightning.rollout import SamplingConfig

FILE = "answers.json"


def _reference(answer: str) -> str:
    try:
        return json.loads(answer)["answer"]
    except (ValueError, KeyError, TypeError):
        return answer


class HeldOutAnswers(L.Callback):
    """Write the held-out greedy answers before and after RL to ``<log_dir>/answers.json``.

    Logged metrics:
        none (the answers go to ``<log_dir>/answers.json``).
    """

    def __init__(self) -> None:
        self.record: dict[str, Any] = {}

    def _answers(self, pl_module: L.LightningModule) -> dict[str, list] | None:
        records = getattr(pl_module.trainer.datamodule, "val_records", None)
        if not records or pl_module.engine is None:
            return None
        hp = pl_module.hparams
        sampling = SamplingConfig(max_new_tokens=hp.eval_max_new_tokens or hp.max_new_tokens, temperature=0.0)
        tok, reward = pl_module.tokenizer, pl_module.reward_fn
        out = pl_module.engine.generate([tok.encode(r["prompt"]) for r in records], n=1, sampling=sampling)
        read = getattr(reward, "answer_of", lambda text: text.strip())
        scores = reward([r["prompt"] for r in records], out.texts, [r["answer"] for r in records])
        self.record["references"] = [_reference(r["answer"]) for r in records]
        return {"answers": [read(t) for t in out.texts], "scores": [float(s) for s in scores], "texts": out.texts}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and "before" not in self.record:
            self.record["before"] = self._answers(pl_module)

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not trainer.log_dir:
            return
        self.record["after"] = self._answers(pl_module)
        Path(trainer.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(trainer.log_dir) / FILE).write_text(json.dumps(self.record, indent=1))
