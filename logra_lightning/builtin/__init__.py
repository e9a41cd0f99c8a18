"""The built-in policies (``builtin:<name>``), built and warmed up locally, and cached.

:func:`resolve_model` turns a model spec into something ``transformers`` loads;
:data:`BUILTIN_MODELS` lists the built-ins (:mod:`~logra_lightning.builtin.registry`).
"""

from logra_lightning.builtin.registry import BUILTIN_MODELS, BUILTIN_PREFIX, cache_dir, is_built, resolve_model

__all__ = ["BUILTIN_MODELS", "BUILTIN_PREFIX", "cache_dir", "is_built", "resolve_model"]
