"""Rewards a user writes: ``model.reward`` as a file path with a function name, a dotted path, or several of them.

What ``model.reward`` accepts (:func:`~logra_lightning.rewards.weighted.as_reward` reads it;
:func:`one_reward` turns one value into a callable):

* ``my_reward.py:score`` — the function (or callable class, built without arguments) ``score``
  in that file; a relative path starts at the working directory (verl's ``custom_reward_function``);
* ``my_reward.score`` — a dotted import path; ``logra`` puts the working directory on ``sys.path``
  (as ``trl`` does), so a module beside the config is found;
* a ``class_path`` block (``logra_lightning.rewards.MathVerifyReward``) or any callable, as before;
* a list of these — their sum, each logged as ``reward/<name>``; for weights use
  :class:`~logra_lightning.rewards.WeightedRewards`.

The function is called with the record's fields it asks for (:mod:`~logra_lightning.rewards.fields`)
and returns one float per completion; a sample it raises on or returns ``None`` / NaN for gets
reward 0 and counts in ``reward/errors`` (:mod:`logra_lightning.rl.faults`). In a config::

    model:
      reward: my_reward.py:score        # def score(completions, answers, difficulty): ...

Example::

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "my_reward.py")
    >>> _ = open(path, "w").write("def score(completions, answers):\\n    return [float(c == a) for c, a in "
    ...                           "zip(completions, answers)]\\n")
    >>> reward = one_reward(path + ":score")
    >>> reward.name, reward(["1+1="], ["2"], ["2"])
    ('score', [1.0])
    >>> one_reward(path + ":scor")
    Traceback (most recent call last):
    ...
    logra_lightning.errors.ConfigError: model.reward=...:scor: ...my_reward.py has no 'scor' (it defines: score)
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from logra_lightning.errors import ConfigError
from logra_lightning.rewards.fields import call_reward, check_takes_completions


def _where(spec: str) -> str:
    return f"model.reward={spec}"


def _defined(module: Any) -> str:
    names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_") and not inspect.ismodule(v)]
    own = [n for n in names if getattr(vars(module)[n], "__module__", None) == module.__name__]
    return ", ".join(sorted(own or names)[:8]) or "no callables"


def _load_file(spec: str, path: str, name: str) -> Any:
    file = Path(path).expanduser()
    if not file.is_file():
        where = "" if file.is_absolute() else f" (relative paths start at {os.getcwd()})"
        raise ConfigError(f"{_where(spec)}: reward file {path} not found{where}")
    # One module per file (named after its absolute path), registered so that pickling the function works
    module_name = "logra_user_reward_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        loader_spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as err:
            del sys.modules[module_name]
            raise ConfigError(f"{_where(spec)}: importing {path} failed ({type(err).__name__}: {err})") from err
    if not hasattr(module, name):
        raise ConfigError(f"{_where(spec)}: {path} has no {name!r} (it defines: {_defined(module)})")
    return getattr(module, name)


def _load_dotted(spec: str) -> Any:
    module_name, _, name = spec.rpartition(".")
    if not module_name:
        raise ConfigError(
            f"{_where(spec)}: not a reward; give path/to/file.py:function, a dotted path module.function, "
            "or a class_path block"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"{_where(spec)}: cannot import {module_name!r} ({err}); for a file write {module_name}.py:{name}, "
            f"or run from the folder that holds it (the working directory, {os.getcwd()}, is on sys.path)"
        ) from None
    if not hasattr(module, name):
        raise ConfigError(f"{_where(spec)}: module {module_name} has no {name!r} (it defines: {_defined(module)})")
    return getattr(module, name)


def load_reward(spec: str) -> Callable:
    """The callable that ``spec`` names (``path/file.py:name`` or ``module.name``); a class is built without arguments.

    Raises:
        ConfigError: file or module missing, no such name, not callable, a class that needs arguments.
    """
    if spec.lstrip().startswith(("{", "[")):  # a class_path block that jsonargparse could not build
        raise ConfigError(
            f"{_where(spec)}: this class_path block does not build a reward; check the class name (importable "
            "from the working directory) and its init_args"
        )
    path, sep, name = spec.rpartition(":")
    obj = _load_file(spec, path, name) if sep and path.endswith(".py") else _load_dotted(spec)
    if inspect.isclass(obj):
        try:
            obj = obj()
        except TypeError as err:
            raise ConfigError(
                f"{_where(spec)}: the class {obj.__name__} needs arguments ({err}); give it as "
                "{class_path: ..., init_args: {...}} instead"
            ) from None
    if not callable(obj):
        raise ConfigError(f"{_where(spec)}: {type(obj).__name__} {name!r} is not callable; name a function")
    return obj


class RewardFunction:
    """A reward given by name (file or dotted path), called with the record fields it asks for.

    Pickles as its ``spec`` (a spawned process loads the file again).

    Args:
        spec: ``path/to/file.py:function`` or ``module.function``.
        name: the name in ``reward/<name>`` (default: the function's).

    Raises:
        ConfigError: see :func:`load_reward`; a signature that cannot take completions.
    """

    def __init__(self, spec: str, name: str | None = None) -> None:
        self.spec = spec
        self.fn = load_reward(spec)
        self.name = name or getattr(self.fn, "__name__", None) or type(self.fn).__name__
        check_takes_completions(self.fn)

    def __call__(self, prompts, completions, answers, **fields):
        return call_reward(self.fn, prompts, completions, answers, fields)

    def __reduce__(self):
        return (RewardFunction, (self.spec, self.name))

    def __repr__(self) -> str:
        return f"RewardFunction({self.spec!r})"


def one_reward(reward: Callable | str | None) -> Callable:
    """One ``model.reward`` value as a callable: default exact match, a spec string loaded, a class built.

    Raises:
        ConfigError: a spec that does not load (see :func:`load_reward`), or a value that is not a reward.
    """
    from logra_lightning.rewards.base import ExactMatchReward

    if reward is None:
        return ExactMatchReward()
    if isinstance(reward, str):
        return RewardFunction(reward)
    if inspect.isclass(reward):
        reward = reward()
    if not callable(reward):
        raise ConfigError(f"model.reward={reward!r}: not a reward function (a {type(reward).__name__})")
    check_takes_completions(reward)
    return reward
