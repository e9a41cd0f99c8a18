"""Calling a reward function with the fields it asks for (TRL's convention, plus this library's positional one).

A reward gets, per completion, ``prompts``, ``completions`` and ``answers`` (lists of equal length)
and every other field of the prompt's record under its own name (``difficulty``, ``tests``, ...; a
field of the data file that the source keeps, see :class:`~logra_lightning.data.TableSource`). Which
of them a function receives follows from its signature:

1. a parameter named after a field (``completions``, ``answers``, ``difficulty``) gets that field;
2. ``**kwargs`` gets every field no other parameter took (TRL's ``def reward(completions, **kwargs)``);
3. a function that names none of ``prompts``, ``completions``, ``answers`` gets them as its first three
   positional parameters, as every reward of this library always has (``lambda p, c, a: ...``);
4. a parameter with a default may be left out; one without a default that nothing fills is an error
   (:class:`~logra_lightning.errors.ConfigError` naming the function, the parameter and the fields there are).

Example::

    >>> def short_and_right(completions, answers, max_len, unit="chars"):  # max_len: a field of each record
    ...     return [float(c == a and len(c) <= m) for c, a, m in zip(completions, answers, max_len)]
    >>> call_reward(short_and_right, ["1+1="] * 2, ["2", "22"], ["2", "22"], {"max_len": [5, 1], "level": [1, 1]})
    [1.0, 0.0]
    >>> call_reward(lambda p, c, a: [len(c[0])], ["q"], ["abc"], ["x"], {"level": [3]})
    [3]
    >>> call_reward(lambda completions, **kw: [kw["level"][0]], ["q"], ["c"], ["a"], {"level": [3]})
    [3]
    >>> call_reward(lambda completions, level_name: [1.0], ["q"], ["c"], ["a"], {"level": [3]})
    Traceback (most recent call last):
    ...
    logra_lightning.errors.ConfigError: reward <lambda>: parameter 'level_name' is not a field of the records ...
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from logra_lightning.errors import ConfigError

BASE = ("prompts", "completions", "answers")


def reward_name(fn: Callable) -> str:
    """A reward's name for messages and ``reward/<name>``: its ``name`` attribute, function or class name."""
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return str(name)


@dataclass(frozen=True)
class Binding:
    """How to call one function: data names passed positionally, ``(parameter, data name)`` by keyword."""

    positional: tuple[str, ...]
    keyword: tuple[tuple[str, str], ...]
    rest: bool  # ``**kwargs``: every field not otherwise passed


def _parameters(fn: Callable) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the positional convention
        return [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in BASE]


def bind(fn: Callable, names: Iterable[str]) -> Binding:
    """The :class:`Binding` of ``fn`` for data with these ``names`` (rules 1-4 of the module notes).

    Raises:
        ConfigError: a required parameter nothing fills, or a function that takes no completions.
    """
    names = tuple(names)
    params = _parameters(fn)
    named = {p.name for p in params} & set(BASE)
    positional, keyword, rest = [], [], False
    slots = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    legacy = list(BASE) if not named else []
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            rest = True
        elif p.kind is p.VAR_POSITIONAL:
            positional += legacy[len(positional) :]  # (*args): the three lists, as before
            legacy = []
        elif legacy and p in slots and len(positional) < len(BASE):
            positional.append(legacy[len(positional)])
        elif p.name in names:
            if p.kind is p.POSITIONAL_ONLY:
                positional.append(p.name)
            else:
                keyword.append((p.name, p.name))
        elif p.default is p.empty:
            raise ConfigError(
                f"reward {reward_name(fn)}: parameter {p.name!r} is not a field of the records (fields: "
                f"{', '.join(names)}); rename it after one of them, give it a default, or keep that key in the "
                "data (a TableSource keeps the keys listed in extra_keys)"
            )
    taken = set(positional) | {n for _, n in keyword}
    if "completions" not in taken and not rest:
        raise ConfigError(
            f"reward {reward_name(fn)}: takes no completions; a reward is called as "
            "reward(prompts, completions, answers, **fields) and returns one float per completion"
        )
    return Binding(tuple(positional), tuple(keyword), rest)


def check_takes_completions(fn: Callable) -> None:
    """Fail now (not at the first step) on a function that cannot take completions; fields are checked at the call.

    Raises:
        ConfigError: ``fn``'s signature takes no completions.
    """
    bind(fn, BASE + tuple(p.name for p in _parameters(fn)))


@lru_cache(maxsize=256)
def _cached_bind(fn: Callable, names: tuple[str, ...]) -> Binding:
    return bind(fn, names)


def call_reward(
    fn: Callable,
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
    fields: dict[str, Sequence] | None = None,
):
    """``fn``'s rewards for the batch, called with the fields its signature asks for (see the module notes)."""
    data = {"prompts": prompts, "completions": completions, "answers": answers, **(fields or {})}
    try:
        binding = _cached_bind(fn, tuple(data))
    except TypeError:  # an unhashable callable: bind every time
        binding = bind(fn, tuple(data))
    kwargs = {param: data[name] for param, name in binding.keyword}
    if binding.rest:
        taken = set(binding.positional) | set(kwargs)
        kwargs.update({k: v for k, v in data.items() if k not in taken})
    return fn(*(data[name] for name in binding.positional), **kwargs)
