"""GSM8K- and MATH-shaped prompt sources, read from JSONL, JSON, Parquet or (on request) the Hub.

Each source is a ``class_path`` target whose ``load()`` returns records
``{"prompt": str, "answer": str, "question": str}``: ``prompt`` is the question put
through :func:`~logra_lightning.data.template.render_prompt` (the tokenizer's chat
template when ``source.tokenizer`` is set and has one), ``answer`` is the short
reference answer the reward compares against, ``question`` the raw problem text.

- GSM8K (``{"question", "answer"}``): the reference is what follows the last ``####``
  of the worked answer (``"... so 18 in all.\\n#### 18"`` -> ``"18"``); a one-line
  answer without ``####`` is taken whole.
- MATH (``{"problem", "solution"}``, optional ``"answer"``): the reference is the
  ``answer`` field when present, else the last ``\\boxed{...}`` of the solution.

File format follows the extension: ``.jsonl`` (one object per line; blank lines
skipped), ``.json`` (a list of objects, or JSON lines), ``.parquet`` (via pyarrow).
A Hugging Face dataset name (``openai/gsm8k``) is loaded with ``datasets`` only when
``from_hub=True``; tests never do this.

Bad data stops ``load()`` with :class:`~logra_lightning.errors.DataError` naming the
file and line (JSON arrays and Parquet: the record/row number): invalid JSON,
non-UTF-8 bytes, a missing or non-string field, a MATH solution without a boxed
answer, an empty file. We raise rather than skip because a silently shrinking
dataset is harder to notice than an error. The one thing skipped is a prompt longer
than ``max_prompt_chars`` (counted in ``source.stats["skipped_too_long"]``, one
warning per load), since long problems are a property of the data, not a defect.

Example::

    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "gsm8k.jsonl")
    >>> _ = open(path, "w").write(json.dumps({"question": "2 cats and 3 dogs: pets?", "answer": "2+3=5\\n#### 5"}))
    >>> GSM8KSource(path, template="Q: {question}\\nA:").load()
    [{'prompt': 'Q: 2 cats and 3 dogs: pets?\\nA:', 'answer': '5', 'question': '2 cats and 3 dogs: pets?'}]
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from logra_lightning.data.source import PromptSource
from logra_lightning.data.template import check_template, render_prompt
from logra_lightning.errors import ConfigError, DataError
from logra_lightning.rewards.math import extract_boxed

FORMATS = (".jsonl", ".json", ".parquet")


def _decode(raw: bytes, path: Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}:{lineno}: not valid UTF-8 ({err.reason} at byte {err.start} of the line)") from None


def _iter_jsonl(path: Path) -> Iterator[tuple[str, object]]:
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = _decode(raw, path, lineno)
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: invalid JSON ({err.msg} at column {err.colno})") from None


def _iter_json(path: Path) -> Iterator[tuple[str, object]]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 ({err.reason})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # several top-level values: JSON lines saved as .json
            yield from _iter_jsonl(path)
            return
        raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg} at column {err.colno})") from None
    if isinstance(doc, dict):
        yield f"{path}:1", doc
        return
    if not isinstance(doc, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(doc).__name__}")
    for i, row in enumerate(doc, start=1):
        yield f"{path}: record {i}", row


def _iter_parquet(path: Path) -> Iterator[tuple[str, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: not a readable Parquet file ({type(err).__name__}: {err})") from None
    for i, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}: row {i}", row


def _iter_hub(name: str, config: str | None, split: str) -> Iterator[tuple[str, object]]:
    import datasets  # checked in __init__

    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as err:  # noqa: BLE001 - offline, unknown name, bad split: all mean "use a local file"
        raise DataError(
            f"{name}: could not load split {split!r} from the Hugging Face Hub ({type(err).__name__}: {err}); "
            "download the data where the Hub is reachable and pass the local .jsonl/.parquet file as path"
        ) from None
    for i, row in enumerate(rows, start=1):
        yield f"{name}[{split}]: row {i}", row


def _text_field(row: dict, field: str, where: str, arg: str) -> str:
    if field not in row:
        raise DataError(
            f"{where}: missing field {field!r} (fields present: {sorted(row)}); set {arg} to the name your file uses"
        )
    value = row[field]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field {field!r} is empty")
    return value


def gsm8k_final_answer(answer: str) -> str | None:
    """The reference answer in a GSM8K worked answer: the text after the last ``####``.

    A one-line answer without ``####`` (``"42"``) is returned whole; a multi-line one
    without it gives ``None``.

    Example::

        >>> gsm8k_final_answer("3*4=12 eggs\\n#### 12"), gsm8k_final_answer(" 7 "), gsm8k_final_answer("a\\nb")
        ('12', '7', None)
    """
    if "####" in answer:
        final = answer.rsplit("####", 1)[1].strip()
        return final or None
    answer = answer.strip()
    return answer if "\n" not in answer else None


class _MathFileSource(PromptSource):
    """Shared loading, templating and filtering of the math sources (see the module docstring).

    A subclass adds the names of the fields it reads and turns a row into ``(question, answer)``
    (:meth:`_question_and_answer`); everything else is these arguments, passed on as ``**kwargs``
    (jsonargparse follows them here, so ``logra fit --help`` lists them under the subclass).

    Args:
        path: a ``.jsonl`` / ``.json`` / ``.parquet`` file, or a Hub name with ``from_hub=True``.
        split: Hub split (``from_hub`` only).
        from_hub: load ``path`` with ``datasets.load_dataset`` (needs network access).
        hub_config: Hub config name (``"main"`` for ``openai/gsm8k``).
        template: user-message template with a ``{question}`` placeholder.
        system: optional system prompt.
        use_chat_template: use the tokenizer's chat template when it has one.
        max_prompt_chars: skip (and count) prompts longer than this many characters.
        limit: keep only the first ``limit`` records.
    """

    def __init__(
        self,
        path: str,
        *,
        split: str = "train",
        from_hub: bool = False,
        hub_config: str | None = None,
        template: str = "{question}",
        system: str | None = None,
        use_chat_template: bool = True,
        max_prompt_chars: int | None = None,
        limit: int | None = None,
    ) -> None:
        name = type(self).__name__
        check_template(template)
        for key, value in (("max_prompt_chars", max_prompt_chars), ("limit", limit)):
            if value is not None and not (isinstance(value, int) and value > 0):
                raise ConfigError(f"{name}.{key}={value!r}: use a positive integer or null")
        if from_hub:
            if importlib.util.find_spec("datasets") is None:
                raise ConfigError(f"{name}(from_hub=True) needs the `datasets` package: pip install datasets")
        else:
            p = Path(path)
            if not p.is_file():
                raise DataError(
                    f"{path}: data file not found ({name}.path); to load a Hub dataset by name set from_hub=True"
                )
            if p.suffix.lower() not in FORMATS:
                raise ConfigError(f"{name}.path={path!r}: unknown format {p.suffix!r}; use one of {FORMATS}")
        self.path, self.split, self.from_hub, self.hub_config = path, split, from_hub, hub_config
        self.template, self.system, self.use_chat_template = template, system, use_chat_template
        self.max_prompt_chars, self.limit = max_prompt_chars, limit
        self.tokenizer = None  # set by whoever owns the tokenizer, before load(), to use its chat template
        self.stats: dict[str, int] = {}

    def _question_and_answer(self, row: dict, where: str) -> tuple[str, str]:
        raise NotImplementedError

    def rows(self) -> Iterator[tuple[str, object]]:
        """``(where, row)`` pairs from the file or the Hub, ``where`` being ``"path:line"`` or similar."""
        if self.from_hub:
            return _iter_hub(self.path, self.hub_config, self.split)
        path = Path(self.path)
        return {".jsonl": _iter_jsonl, ".json": _iter_json, ".parquet": _iter_parquet}[path.suffix.lower()](path)

    def load(self) -> list[dict[str, str]]:
        records, too_long = [], 0
        for where, row in self.rows():
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            question, answer = self._question_and_answer(row, where)
            prompt = render_prompt(question, self.tokenizer, self.template, self.system, self.use_chat_template)
            if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
                too_long += 1
                continue
            records.append({"prompt": prompt, "answer": answer, "question": question})
            if self.limit is not None and len(records) == self.limit:
                break
        self.stats = {"loaded": len(records), "skipped_too_long": too_long}
        if not records:
            why = "the file is empty"
            if too_long:
                why = f"all {too_long} prompts exceed max_prompt_chars={self.max_prompt_chars}"
            raise DataError(f"{self.path}: no records ({why})")
        if too_long:
            rank_zero_warn(
                f"{type(self).__name__}({self.path}): skipped {too_long} prompts longer than "
                f"max_prompt_chars={self.max_prompt_chars}; kept {len(records)}"
            )
        return records


class GSM8KSource(_MathFileSource):
    """Grade-school word problems whose worked answers end in ``#### <number>``.

    Args:
        path: a ``.jsonl`` / ``.json`` / ``.parquet`` file, or a Hub name with ``from_hub=True``.
        question_field: field holding the problem text.
        answer_field: field holding the worked answer (``... #### 42``) or the bare answer.
        **kwargs: ``split``, ``from_hub``, ``hub_config``, ``template``, ``system``,
            ``use_chat_template``, ``max_prompt_chars``, ``limit``: see :class:`_MathFileSource`.

    Raises:
        DataError: the file is missing (at creation) or malformed (at ``load``).
        ConfigError: an unknown file extension, a template without ``{question}``,
            a non-positive limit, or ``from_hub`` without ``datasets`` installed.

    Example::

        >>> source = GSM8KSource("tests/data/gsm8k_tiny.jsonl",  # doctest: +SKIP
        ...                      template="{question}\\nEnd with '#### <answer>'.", max_prompt_chars=2000)
        >>> dm = PromptDataModule(source, batch_size=8)  # doctest: +SKIP
        >>> Trainer(max_steps=20).fit(module, datamodule=dm)  # doctest: +SKIP
    """

    def __init__(
        self, path: str, question_field: str = "question", answer_field: str = "answer", **kwargs: Any
    ) -> None:
        super().__init__(path, **kwargs)
        self.question_field, self.answer_field = question_field, answer_field

    def _question_and_answer(self, row: dict, where: str) -> tuple[str, str]:
        question = _text_field(row, self.question_field, where, "question_field")
        final = gsm8k_final_answer(_text_field(row, self.answer_field, where, "answer_field"))
        if final is None:
            raise DataError(f"{where}: field {self.answer_field!r} has no final '#### <answer>' line")
        return question, final


class MATHSource(_MathFileSource):
    """Competition problems whose solutions put the final answer in ``\\boxed{...}``.

    Args:
        path: a ``.jsonl`` / ``.json`` / ``.parquet`` file, or a Hub name with ``from_hub=True``.
        problem_field: field holding the problem text.
        solution_field: field holding the worked solution.
        answer_field: field holding the short answer, used instead of the boxed one when
            present and non-empty; rows need either this or a boxed solution.
        **kwargs: ``split``, ``from_hub``, ``hub_config``, ``template``, ``system``,
            ``use_chat_template``, ``max_prompt_chars``, ``limit``: see :class:`_MathFileSource`.

    Raises:
        DataError: the file is missing (at creation) or malformed (at ``load``),
            including a solution with no ``\\boxed{}`` answer and no answer field.
        ConfigError: as for :class:`GSM8KSource`.

    Example::

        >>> source = MATHSource("tests/data/math_tiny.jsonl",  # doctest: +SKIP
        ...                     template="{question}\\nPut the final answer in \\\\boxed{}.")
        >>> Trainer(max_steps=20).fit(module, datamodule=PromptDataModule(source))  # doctest: +SKIP
    """

    def __init__(
        self,
        path: str,
        problem_field: str = "problem",
        solution_field: str = "solution",
        answer_field: str = "answer",
        **kwargs: Any,
    ) -> None:
        super().__init__(path, **kwargs)
        self.problem_field, self.solution_field, self.answer_field = problem_field, solution_field, answer_field

    def _question_and_answer(self, row: dict, where: str) -> tuple[str, str]:
        question = _text_field(row, self.problem_field, where, "problem_field")
        if row.get(self.answer_field) not in (None, ""):
            return question, _text_field(row, self.answer_field, where, "answer_field").strip()
        boxed = [b for b in extract_boxed(_text_field(row, self.solution_field, where, "solution_field")) if b]
        if not boxed:
            raise DataError(
                f"{where}: no \\boxed{{...}} answer in {self.solution_field!r} and no {self.answer_field!r} field"
            )
        return question, boxed[-1]
