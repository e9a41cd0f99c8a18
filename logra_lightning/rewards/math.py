"""Math rewards: pull the final answer out of a completion and check it with math-verify.

A reward here is a ``class_path`` target in configs, called as
``reward(prompts, completions, answers) -> list[float]``. The answer is taken from a
completion in this order (the first kind present wins, and within a kind the last one):

1. ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces allowed;
2. a GSM8K line ``#### 42``;
3. a phrase ``The (final) answer is ...`` / ``Answer: ...``;
4. optionally, the last number in the text (``last_number_fallback``).

A completion that opens a ``\\boxed{`` and never closes it (cut off at the token
limit) has no answer: its last number is a fragment, not a claim.

Equivalence is decided by ``math_verify.verify`` on both strings parsed with
``math_verify.parse``, so ``\\frac{1}{2}``, ``0.5``, ``1/2`` and ``50\\%`` agree, and
units, ``\\$`` and thousands separators are ignored.

Run the tests with ``.venv/bin/pytest tests/test_math_rewards.py``.

Example::

    >>> reward = MathVerifyReward(format_weight=0.1)
    >>> reward(["q", "q"], ["so it is \\\\boxed{\\\\dfrac{1}{2}}", "I think 0.4"], ["0.5", "0.5"])
    [1.1, 0.0]

Departures from calling ``math_verify.parse`` on the whole completion:

1) We extract the answer ourselves and hand math-verify only that string, wrapped as
   ``\\boxed{...}``. math-verify's own extraction misses GSM8K's ``#### 42``, does not
   find a bare ``\\dfrac{1}{2}`` outside ``$...$``, fails on ``7.`` (trailing period)
   and turns several ``\\boxed{}`` into a set; our rules are the ones listed above.
2) A plain word answer (``Monday``, ``yes``) is wrapped as ``\\text{...}``: math-verify
   parses a bare word as a product of one-letter symbols, so ``yes`` becomes
   ``E*s*y`` and anagrams compare equal.
3) When math-verify cannot parse one side at all, we fall back to comparing the
   normalized strings, so a text answer can still be matched.
4) math-verify times out with ``signal.alarm``, which only works in the main thread;
   elsewhere we run it without a timeout rather than fail.
"""

from __future__ import annotations

import math
import re
import threading
from functools import lru_cache

from math_verify import parse, verify

from logra_lightning.errors import ConfigError

_BOX_OPENERS = ("\\boxed", "\\fbox")
_GSM8K_RE = re.compile(r"####\s*([^\n]+)")
_PHRASE_RE = re.compile(
    r"(?:final answer|the answer)\s*(?:is|:)\s*:?\s*(.+)|\banswer\s*:\s*(.+)",
    re.IGNORECASE,
)
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_WORD_RE = re.compile(r"[A-Za-z][A-Za-z '\-]*[A-Za-z]")
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|textit)\s*\{([^{}]*)\}")


def extract_boxed(text: str) -> list[str]:
    """Contents of every complete ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``, in order.

    Nested braces are balanced; a box cut off before its closing brace (a truncated
    completion) is skipped. ``\\boxed 5`` (no braces) yields ``"5"``.

    Example::

        >>> extract_boxed(r"\\boxed{\\frac{1}{2}} then \\boxed{3} and \\boxed{4")
        ['\\\\frac{1}{2}', '3']
    """
    found = []
    i = 0
    while True:
        starts = [(text.find(op, i), op) for op in _BOX_OPENERS]
        starts = [(s, op) for s, op in starts if s >= 0]
        if not starts:
            return found
        start, op = min(starts)
        j = start + len(op)
        if j < len(text) and text[j] == " ":
            # `\boxed 5`: the argument is the next token
            m = re.match(r" +([^\s$]+)", text[j:])
            if m:
                found.append(m.group(1))
            i = j
            continue
        if j >= len(text) or text[j] != "{":
            i = j
            continue
        depth = 0
        for k in range(j, len(text)):
            if text[k] == "{":
                depth += 1
            elif text[k] == "}":
                depth -= 1
                if depth == 0:
                    found.append(text[j + 1 : k].strip())
                    break
        else:
            return found  # unbalanced: the rest of the text is inside an open box
        i = k + 1


def _clean(answer: str) -> str:
    """Trim what surrounds an answer in prose: ``**``, ``$...$``, ``\\(...\\)``, trailing punctuation."""
    answer = answer.strip().strip("*").strip().rstrip(".,;:! ")
    answer = re.sub(r"^\$+|\$+$", "", answer).strip()
    answer = re.sub(r"^\\[(\[]|\\[)\]]$", "", answer).strip()
    return answer.rstrip(".,;:! ")


def extract_answer(text: str, last_number_fallback: bool = True) -> str | None:
    """The final answer in a completion, or ``None`` when there is none.

    Args:
        text: the completion.
        last_number_fallback: when no boxed / ``####`` / "answer is" answer is
            present, return the last number in the text.

    Example::

        >>> extract_answer("3 apples and 4 pears: 7 fruits.\\n#### 7")
        '7'
        >>> extract_answer("The answer is $\\\\frac{3}{4}$.")
        '\\\\frac{3}{4}'
        >>> extract_answer("no digits here") is None
        True
    """
    boxed = [b for b in extract_boxed(text) if b]
    if boxed:
        return boxed[-1]
    if any(op + "{" in text for op in _BOX_OPENERS):
        return None  # a box left open: the completion was cut off before its answer
    hashes = _GSM8K_RE.findall(text)
    if hashes:
        answer = _clean(hashes[-1])
        if answer:
            return answer
    phrases = [a or b for a, b in _PHRASE_RE.findall(text)]
    for phrase in reversed(phrases):
        # the phrase runs to the end of its sentence: a period followed by space/end
        answer = _clean(re.split(r"\.(?:\s|$)", phrase.strip(), maxsplit=1)[0])
        if answer:
            return answer
    if last_number_fallback:
        numbers = _NUMBER_RE.findall(text)
        if numbers:
            return numbers[-1]
    return None


def has_answer_format(text: str) -> bool:
    """True when the completion states its answer in a checkable format: a complete ``\\boxed{}`` or a ``####`` line."""
    return any(extract_boxed(text)) or any(_clean(a) for a in _GSM8K_RE.findall(text))


def _as_latex(answer: str) -> str:
    answer = _clean(answer)
    if _WORD_RE.fullmatch(answer) and len(answer) >= 2 and not answer.startswith("\\"):
        return f"\\text{{{answer}}}"
    return answer


def _normalized_text(answer: str) -> str:
    answer = _TEXT_CMD_RE.sub(r"\1", _clean(answer))
    answer = re.sub(r"\\[,!;: ]|\\\$|[\s{}]", "", answer)
    return answer.lower()


@lru_cache(maxsize=8192)
def _parse(answer: str, timeout_seconds: int | None) -> tuple:
    # cached: a group of G samples and its reference share strings like "42"
    return tuple(parse(f"\\boxed{{{_as_latex(answer)}}}", parsing_timeout=timeout_seconds))


def answers_match(prediction: str, reference: str, timeout_seconds: int | None = 5) -> bool:
    """Whether an extracted answer is mathematically equivalent to the reference.

    Args:
        prediction: the model's answer (e.g. from :func:`extract_answer`), not the whole completion.
        reference: the reference answer (``"42"``, ``"\\frac{1}{2}"``, ``"\\text{Monday}"``).
        timeout_seconds: limit for each math-verify parse / comparison (main thread only).

    Example::

        >>> answers_match("\\\\dfrac{1}{2}", "0.5"), answers_match("-3", "3")
        (True, False)
    """
    if threading.current_thread() is not threading.main_thread():
        timeout_seconds = None
    gold, pred = _parse(reference, timeout_seconds), _parse(prediction, timeout_seconds)
    if gold and pred and verify(list(gold), list(pred), timeout_seconds=timeout_seconds):
        return True
    return _normalized_text(prediction) == _normalized_text(reference) != ""


def _check_batch(completions: list[str], answers: list[str]) -> None:
    if len(completions) != len(answers):
        raise ValueError(f"got {len(completions)} completions but {len(answers)} reference answers")
    for c, a in zip(completions, answers):
        if not isinstance(c, str) or not isinstance(a, str):
            raise TypeError(f"completions and answers must be str, got {type(c).__name__} and {type(a).__name__}")
        if not a.strip():
            raise ValueError("empty reference answer: check the data source's answer field")


def math_verify_score(
    completion: str,
    answer: str,
    format_weight: float = 0.0,
    last_number_fallback: bool = True,
    timeout_seconds: int | None = 5,
) -> float:
    """Per-sample reward: 1.0 if the extracted answer matches, plus ``format_weight`` for a boxed/``####`` answer.

    Raises:
        TypeError: a non-string completion or answer.
        ValueError: an empty reference answer.
    """
    _check_batch([completion], [answer])
    predicted = extract_answer(completion, last_number_fallback=last_number_fallback)
    correct = predicted is not None and answers_match(predicted, answer, timeout_seconds)
    return float(correct) + (format_weight if format_weight and has_answer_format(completion) else 0.0)


class MathVerifyReward:
    """1.0 when the completion's final answer is equivalent to the reference (math-verify), else 0.0.

    An optional format bonus rewards answers the grader can find without guessing
    (``\\boxed{}`` or ``####``), so the reward ranges over ``[0, 1 + format_weight]``.

    Args:
        format_weight: added when the completion has a boxed or ``####`` answer (right or wrong).
        last_number_fallback: grade the last number in the text when no explicit answer is present.
        timeout_seconds: math-verify limit per parse and per comparison; ``None`` for no limit.

    Raises:
        ConfigError: a negative or non-finite ``format_weight``, or a non-positive timeout.

    Example::

        >>> reward = MathVerifyReward(format_weight=0.1)
        >>> reward(["q"], ["... so 12 in all. #### 12"], ["12"])
        [1.1]

    In a config::

        model:
          reward:
            class_path: logra_lightning.rewards.math.MathVerifyReward
            init_args: {format_weight: 0.1}
    """

    def __init__(self, format_weight: float = 0.0, last_number_fallback: bool = True, timeout_seconds: int | None = 5):
        if not (math.isfinite(format_weight) and format_weight >= 0):
            raise ConfigError(f"MathVerifyReward.format_weight={format_weight}: must be a finite number >= 0")
        if timeout_seconds is not None and not (isinstance(timeout_seconds, int) and timeout_seconds > 0):
            raise ConfigError(f"MathVerifyReward.timeout_seconds={timeout_seconds!r}: use a positive integer or null")
        self.format_weight = float(format_weight)
        self.last_number_fallback = last_number_fallback
        self.timeout_seconds = timeout_seconds

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        _check_batch(completions, answers)
        return [
            math_verify_score(c, a, self.format_weight, self.last_number_fallback, self.timeout_seconds)
            for c, a in zip(completions, answers)
        ]


def _as_number(answer: str) -> float | None:
    text = re.sub(r"\\\$|\$|,|\\%|%|\\!|\s", "", _TEXT_CMD_RE.sub("", _clean(answer)))
    frac = re.fullmatch(r"(-?)\\d?frac\{(-?\d+)\}\{(\d+)\}", text)
    if frac:
        return (-1 if frac.group(1) else 1) * int(frac.group(2)) / int(frac.group(3)) if int(frac.group(3)) else None
    if re.fullmatch(r"-?\d+/\d+", text):
        num, den = text.split("/")
        return int(num) / int(den) if int(den) else None
    try:
        return float(text)
    except ValueError:
        return None


class ExtractedMatchReward:
    """1.0 when the extracted answer equals the reference as a number (or as text), else 0.0.

    No SymPy: fast, and safe in any thread. Numbers compare after dropping ``$``,
    thousands separators, ``%`` and ``\\text{...}`` units (``"1,000"``, ``"$1000.00"``
    and ``"1000 \\text{ dollars}"`` all equal ``1000``), with a relative tolerance;
    anything else compares as lower-cased text without spaces. Suited to GSM8K, where
    answers are integers; use :class:`MathVerifyReward` for LaTeX answers.

    Args:
        format_weight: added when the completion has a boxed or ``####`` answer.
        last_number_fallback: grade the last number when no explicit answer is present.
        rel_tol: relative tolerance of the numeric comparison.

    Raises:
        ConfigError: a negative ``format_weight`` or ``rel_tol``.

    Example::

        >>> ExtractedMatchReward()(["q", "q"], ["#### 1,000", "The answer is $999."], ["1000", "1000"])
        [1.0, 0.0]
    """

    def __init__(self, format_weight: float = 0.0, last_number_fallback: bool = True, rel_tol: float = 1e-6):
        for key, value in (("format_weight", format_weight), ("rel_tol", rel_tol)):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"ExtractedMatchReward.{key}={value}: must be a finite number >= 0")
        self.format_weight, self.rel_tol = float(format_weight), rel_tol
        self.last_number_fallback = last_number_fallback

    def match(self, prediction: str, reference: str) -> bool:
        p, r = _as_number(prediction), _as_number(reference)
        if p is not None and r is not None:
            return math.isclose(p, r, rel_tol=self.rel_tol, abs_tol=1e-12)
        return _normalized_text(prediction) == _normalized_text(reference) != ""

    def __call__(self, prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        _check_batch(completions, answers)
        out = []
        for c, a in zip(completions, answers):
            predicted = extract_answer(c, last_number_fallback=self.last_number_fallback)
            score = float(predicted is not None and self.match(predicted, a))
            out.append(score + (self.format_weight if self.format_weight and has_answer_format(c) else 0.0))
        return out
