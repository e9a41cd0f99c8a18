"""Lightning callbacks of logra_lightning (usable in any Lightning project).

* :class:`KLStepControl` — predicted-KL step control (needs ``kl_probe_logits`` on the module);
* :class:`LowRankWeightSync` — low-rank weight sync to a rollout engine (``pl_module.engine``);
* :class:`MemoryMonitor` — memory per phase and exact params/grads/optimizer-state bytes;
* :class:`ExportPolicy` — the trained policy as a Hugging Face directory at the end of fit;
* :class:`StepProgressBar` — a progress bar in RL steps with reward and accuracy (``logra fit``'s default);
* :class:`LogCompletions` — sample completions to ``completions.jsonl``, TensorBoard and W&B (``logra fit``'s default).

They live in ``logra_lightning.callbacks``, not a top-level ``callbacks`` package, which
would collide with other projects' modules of that name.
"""

from logra_lightning.callbacks.completions import LogCompletions
from logra_lightning.callbacks.export import ExportPolicy
from logra_lightning.callbacks.kl_control import KLStepControl, SupportsKLProbe
from logra_lightning.callbacks.memory import MemoryMonitor
from logra_lightning.callbacks.progress import StepProgressBar
from logra_lightning.callbacks.weight_sync import LowRankWeightSync

__all__ = [
    "ExportPolicy",
    "KLStepControl",
    "LogCompletions",
    "LowRankWeightSync",
    "MemoryMonitor",
    "StepProgressBar",
    "SupportsKLProbe",
]
