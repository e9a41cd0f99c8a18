"""logra_lightning: memory-efficient RL post-training of LLMs with low-rank gradient sketches (LoGRA).

The pieces: :class:`PolicyGradientModule` (GRPO-style RL, manual optimization),
:class:`~logra_lightning.optim.LoGRA` (Adam on low-rank gradient sketches), and
callbacks in :mod:`logra_lightning.callbacks` (predicted-KL step control, low-rank
weight sync to vLLM, memory monitoring). ``logra fit --config ...`` runs them.
"""

__version__ = "0.1.0"
__all__ = ["PolicyGradientModule", "__version__"]


def __getattr__(name: str):
    # Lazy: `logra plan` and the pure-math modules should not pay for importing Lightning.
    if name == "PolicyGradientModule":
        from logra_lightning.rl.module import PolicyGradientModule

        return PolicyGradientModule
    raise AttributeError(f"module 'logra_lightning' has no attribute {name!r}")
