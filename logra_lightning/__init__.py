"""logra_lightning: memory-efficient RL post-training of LLMs with low-rank gradient sketches (LoGRA).

The pieces: :class:`PolicyGradientModule` (GRPO-style RL, manual optimization),
:class:`~logra_lightning.optim.LoGRA` (Adam on low-rank gradient sketches), and
callbacks in :mod:`logra_lightning.callbacks` (predicted-KL step control, low-rank
weight sync to vLLM, memory monitoring). ``logra fit --config ...`` runs them.
"""

from logra_lightning.module import PolicyGradientModule

__version__ = "0.1.0"
__all__ = ["PolicyGradientModule", "__version__"]
