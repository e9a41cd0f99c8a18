"""Score completions with a reasoning-gym dataset's own ``score_answer`` (the environment's verifier).

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ (Apache-2.0, ``pip install reasoning-gym``)
generates problems procedurally, ``reasoning_gym.create_dataset(name, seed=, size=, **config)``, and scores an
answer with ``dataset.score_answer(answer, entry)`` in ``[0, 1]`` (some datasets give partial credit, e.g.
``len(reference) / len(answer)`` when the reference is contained in a longer answer). Scoring needs the whole
*entry* (its ``metadata``), not only the reference string, and a reward here sees only the record's ``answer``
string. So :class:`~logra_lightning.data.ReasoningGymSource` writes the entry's *address* as that string
(:func:`encode_reference`: dataset, config, seed, size, index, and the reference answer for people reading
logs), and this reward rebuilds the entry from it (datasets are deterministic in ``(config, seed, index)``;
a rebuilt entry whose answer differs from the recorded one is an error, never a silent mis-score).

**How the answer is taken from a completion** (``extract``):

* ``"tag"`` (default; reasoning-gym's convention): the text inside the *last* ``<answer>...</answer>``
  (``reasoning_gym.utils.extract_answer``: stripped, may span lines); no tag pair -> ``None``, which scores 0.
* ``"completion"``: the whole completion, stripped of surrounding whitespace (for prompts that say
  "answer with only the result").
* ``"first_line"``: the first non-empty line, stripped, with one trailing ``.`` removed (a model asked for a
  bare answer that then explains itself, ``"7.\\nThe sum of ..."``, is graded on ``7``).
* ``"last_number"``: the last number in the completion (``-?digits[.digits]``, thousands commas removed first),
  the "flexible" extraction of GSM8K evaluations: a model that works the problem out in words and ends on the
  result (``"5 - 9 = -4."``) is graded on that result; no number -> ``None``.
* ``"first_word"``: the first whitespace-separated word once surrounding quotes, brackets and punctuation
  (:data:`PUNCTUATION`) are stripped from it, for one-word answers after a prompt that ends in an answer
  prefix (``... The answer is`` -> ``' "2". Because ...'`` is graded on ``2``); words that strip to nothing
  are skipped.

Example::

    >>> ref = encode_reference("basic_arithmetic", {"max_terms": 2, "max_digits": 1}, seed=3, size=10, index=0)
    >>> entry = make_dataset("basic_arithmetic", {"max_terms": 2, "max_digits": 1}, seed=3, size=10)[0]
    >>> reward = ReasoningGymReward()
    >>> reward(["q"] * 3, [f"<answer>{entry['answer']}</answer>", entry["answer"], "<answer>-999</answer>"], [ref] * 3)
    [1.0, 0.0, 0.0]
    >>> ReasoningGymReward(extract="first_line")(["q"], [entry["answer"] + ".\\nBecause ..."], [ref])
    [1.0]
    >>> ReasoningGymReward(extract="first_word")(["q"], [f' "{entry["answer"]}". Because ...'], [ref])
    [1.0]
    >>> ReasoningGymReward(extract="last_number")(["q"], [f"First 1,000 - 999, so it is {entry['answer']}."], [ref])
    [1.0]
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from logra_lightning.errors import ConfigError

INSTALL = "pip install reasoning-gym"
REFERENCE_TAG = "reasoning_gym"  # the key that marks a record's answer as a reasoning-gym address


def _rg():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"reasoning-gym is not installed: {INSTALL}") from None
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset name the installed reasoning-gym registers (sorted)."""
    return sorted(_rg().factory.DATASETS)


def check_dataset(name: str, config: Mapping[str, Any] | None = None, what: str = "dataset") -> None:
    """Raise a ``ConfigError`` for an unknown dataset ``name`` (listing the valid ones) or an unknown config key.

    Example::

        >>> check_dataset("basic_arithmetic", {"max_terms": 2})
        >>> check_dataset("basic_arithmetics")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        logra_lightning.errors.ConfigError: dataset='basic_arithmetics': not a reasoning-gym dataset; ...
    """
    datasets = _rg().factory.DATASETS
    if name not in datasets:
        raise ConfigError(f"{what}={name!r}: not a reasoning-gym dataset; choose one of {sorted(datasets)}")
    fields = {f.name for f in dataclasses.fields(datasets[name][1])} - {"seed", "size"}
    unknown = sorted(set(config or {}) - fields)
    if unknown:
        raise ConfigError(
            f"{what}={name!r}: unknown config keys {unknown}; {name} takes {sorted(fields)} (seed and size are "
            "set by the source)"
        )


def make_dataset(name: str, config: Mapping[str, Any] | None, seed: int, size: int):
    """``reasoning_gym.create_dataset(name, seed=seed, size=size, **config)``, with config errors as ``ConfigError``.

    Its first item is drawn once, so a config that reasoning-gym accepts but cannot generate from fails here.
    """
    check_dataset(name, config)
    try:
        ds = _rg().create_dataset(name, seed=seed, size=size, **dict(config or {}))
        ds[0]  # some configs pass validate() and fail only when an item is drawn (operators without weights)
    except (AssertionError, ValueError, TypeError, IndexError, KeyError) as err:  # validate() asserts
        raise ConfigError(
            f"dataset={name!r} config={dict(config or {})}: rejected by reasoning-gym ({type(err).__name__}: {err})"
        ) from None
    return ds


@lru_cache(maxsize=64)
def _cached_dataset(name: str, config_json: str, seed: int, size: int):
    return make_dataset(name, json.loads(config_json), seed, size)


def encode_reference(
    name: str, config: Mapping[str, Any] | None, seed: int, size: int, index: int, answer: str | None = None
) -> str:
    """The ``answer`` string of a record: where its entry lives (JSON), and the reference answer to read.

    Example::

        >>> encode_reference("chain_sum", {"max_terms": 2}, seed=0, size=5, index=3, answer="7")
        '{"reasoning_gym": "chain_sum", "config": {"max_terms": 2}, "seed": 0, "size": 5, "index": 3, "answer": "7"}'
    """
    ref = {REFERENCE_TAG: name, "config": dict(config or {}), "seed": seed, "size": size, "index": index}
    return json.dumps(ref | ({"answer": answer} if answer is not None else {}))


def readable_answer(answer: Any) -> Any:
    """The reference answer a record's ``answer`` carries: ``answer`` itself unless it is a reasoning-gym reference.

    Example::

        >>> readable_answer(encode_reference("chain_sum", {}, seed=0, size=5, index=3, answer="7"))
        '7'
        >>> readable_answer("12")
        '12'
    """
    ref = _reference(answer)
    return str(ref["answer"]) if ref is not None and "answer" in ref else answer


def _reference(answer: Any) -> dict | None:
    """The reasoning-gym address an answer holds (:func:`encode_reference`'s JSON), or ``None``."""
    if not isinstance(answer, str):
        return None
    try:
        ref = json.loads(answer)
    except json.JSONDecodeError:
        return None
    return ref if isinstance(ref, dict) and REFERENCE_TAG in ref else None


def entry_of(reference: str) -> tuple[Any, dict]:
    """``(dataset, entry)`` addressed by a reference string from :func:`encode_reference`.

    Raises:
        ValueError: the string is not such a reference, or the rebuilt entry's answer differs from the
            recorded one (the installed reasoning-gym generates other problems than the one that wrote it).
    """
    ref = _reference(reference)
    if ref is None:
        raise ValueError(
            f"answer {reference[:80]!r} is not a reasoning-gym reference; use ReasoningGymReward with "
            "logra_lightning.data.ReasoningGymSource records"
        )
    name = ref[REFERENCE_TAG]
    ds = _cached_dataset(name, json.dumps(ref["config"], sort_keys=True), ref["seed"], ref["size"])
    entry = ds[ref["index"]]
    if "answer" in ref and ref["answer"] != entry["answer"]:
        raise ValueError(
            f"{name}[{ref['index']}] rebuilt with answer {entry['answer']!r}, recorded {ref['answer']!r}: "
            "the installed reasoning-gym differs from the one that wrote the records"
        )
    return ds, entry


def _first_line(completion: str) -> str:
    line = next((ln.strip() for ln in completion.splitlines() if ln.strip()), "")
    return line[:-1].rstrip() if line.endswith(".") else line


PUNCTUATION = ".,;:!?\"'`*()[]{}"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


def _last_number(completion: str) -> str | None:
    found = NUMBER.findall(THOUSANDS.sub("", completion))
    return found[-1] if found else None


def _first_word(completion: str) -> str | None:
    return next((w.strip(PUNCTUATION) for w in completion.split() if w.strip(PUNCTUATION)), None)


def _tag(completion: str, tag: str = "answer") -> str | None:
    from reasoning_gym.utils import extract_answer

    return extract_answer(completion, tag_name=tag)


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "tag": _tag,
    "completion": lambda c: c.strip(),
    "first_line": _first_line,
    "first_word": _first_word,
    "last_number": _last_number,
}


class ReasoningGymReward:
    """The dataset's own ``score_answer`` on the answer taken from each completion (module doc: ``extract``).

    Works with any dataset and config: everything it needs is in the records' ``answer`` strings, which
    :class:`~logra_lightning.data.ReasoningGymSource` writes. Scores are in ``[0, 1]``; a sample counts
    as correct in ``reward/accuracy`` and ``val/accuracy`` at ``model.correct_reward`` (1.0 by default).

    Args:
        extract: ``"tag"`` (text in the last ``<answer>...</answer>``), ``"completion"`` (all of it),
            ``"first_line"`` (first non-empty line without a trailing ``.``), ``"first_word"`` (first word
            without surrounding quotes and punctuation) or ``"last_number"`` (last number in the completion).
        tag: the tag name for ``extract="tag"``.

    Raises:
        ConfigError: an unknown ``extract``, or reasoning-gym not installed.

    In a config::

        model:
          reward:
            class_path: logra_lightning.rewards.ReasoningGymReward
            init_args: {extract: first_line}
    """

    def __init__(self, extract: str = "tag", tag: str = "answer") -> None:
        if extract not in EXTRACTORS:
            raise ConfigError(f"ReasoningGymReward.extract={extract!r}: allowed values are {sorted(EXTRACTORS)}")
        if not (isinstance(tag, str) and tag.strip()):
            raise ConfigError(f"ReasoningGymReward.tag={tag!r}: must be a non-empty string")
        _rg()
        self.extract, self.tag = extract, tag

    def answer_of(self, completion: str) -> str | None:
        """The answer this reward grades in ``completion`` (``None``: none found, which scores 0)."""
        return _tag(completion, self.tag) if self.extract == "tag" else EXTRACTORS[self.extract](completion)

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        out = []
        for completion, reference in zip(completions, answers, strict=True):
            ds, entry = entry_of(reference)
            out.append(float(ds.score_answer(self.answer_of(completion), entry)))
        return out
