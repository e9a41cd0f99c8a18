"""Prompts from any table: a JSONL / JSON / Parquet / CSV file or a `datasets` name, with your keys and template.

:class:`TableSource` is the one general prompt source: each row becomes a record
``{"prompt", "answer", **extra fields}``. ``prompt`` is the row's ``prompt_key`` text put through
:func:`~logra_lightning.data.template.render_prompt` (the tokenizer's chat template when the policy's
tokenizer has one and ``use_chat_template``, else the plain ``template``; an optional ``system``
prompt either way); ``answer`` is the ``answer_key`` text (``""`` without one); the other columns
(``extra_keys``, default all of them) ride along and reach a reward that names them
(:mod:`~logra_lightning.rewards.fields`). The GSM8K and MATH sources
(:mod:`~logra_lightning.data.math`) are configurations of it.

File format follows the extension: ``.jsonl`` (one object per line; blank lines skipped),
``.json`` (a list of objects, or JSON lines), ``.parquet`` and ``.csv`` (via pyarrow; in a CSV
the prompt and answer columns stay text, the others get inferred types). With ``from_hub=True``,
``path`` is a `datasets` name (``pip install 'logra-lightning[datasets]'``) loaded from the local
cache only: nothing is downloaded at run time.

Bad data stops ``load()`` with :class:`~logra_lightning.errors.DataError` naming the file and
line (JSON arrays, Parquet and CSV: the record/row number): invalid JSON, non-UTF-8 bytes, a
missing key (with the keys present and the argument to set), an empty prompt, an empty file.
We raise rather than skip because a silently shrinking dataset is harder to notice than an
error. The one thing skipped is a prompt longer than ``max_prompt_chars`` (counted in
``source.stats["skipped_too_long"]``, one warning per load), since long problems are a property
of the data, not a defect.

In a config::

    data:
      train:
        class_path: logra_lightning.data.TableSource
        init_args: {path: problems.parquet, prompt_key: question, answer_key: solution, system: "Be brief."}

Example::

    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "tasks.jsonl")
    >>> _ = open(path, "w").write(json.dumps({"question": "2+3?", "solution": 5, "level": 1}) + "\\n")
    >>> TableSource(path, prompt_key="question", answer_key="solution", template="Q: {question}\\nA:").load()
    [{'prompt': 'Q: 2+3?\\nA:', 'answer': '5', 'question': '2+3?', 'solution': 5, 'level': 1}]
    >>> TableSource(path, prompt_key="problem").load()
    Traceback (most recent call last):
    ...
    logra_lightning.errors.DataError: ...tasks.jsonl:1: missing field 'problem' (fields present: ...); set prompt_key...
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from logra_lightning._util import environment
from logra_lightning.data.source import PromptSource
from logra_lightning.data.template import check_template, render_prompt
from logra_lightning.errors import ConfigError, DataError

FORMATS = (".jsonl", ".json", ".parquet", ".csv")
# keys of the record itself: a column of the same name is not copied over them
OWN_KEYS = ("prompt", "answer")


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
    # the local cache only: nothing is downloaded at run time (unless the user set these otherwise)
    with environment({}, {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}):
        import datasets  # checked in __init__

        try:
            rows = datasets.load_dataset(name, config, split=split)
        except Exception as err:  # noqa: BLE001 - not cached, unknown name, bad split: all mean "use a local file"
            raise DataError(
                f"{name}: could not load split {split!r} from the local `datasets` cache (loaded offline; "
                f"{type(err).__name__}: {' '.join(str(err).split())[:200]}); download it where the Hub is "
                "reachable (datasets.load_dataset), or save it as .jsonl/.parquet and pass that file as path"
            ) from None
    for i, row in enumerate(rows, start=1):
        yield f"{name}[{split}]: row {i}", row


def _iter_csv(path: Path, text_columns: tuple[str, ...] = ()) -> Iterator[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    # the prompt and answer columns stay text ("007" is not 7); the other columns get pyarrow's inferred types
    options = pcsv.ConvertOptions(column_types={c: pa.string() for c in text_columns if c})
    try:
        table = pcsv.read_csv(path, convert_options=options)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several types for a malformed file
        raise DataError(
            f"{path}: not a readable CSV file ({type(err).__name__}: {' '.join(str(err).split())})"
        ) from None
    for i, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}: row {i + 1}", row  # row 1 is the header


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


class TableSource(PromptSource):
    """Prompt source reading any table (a ``class_path`` target; see the module notes).

    Args:
        path: a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, or a `datasets` name with ``from_hub=True``.
        prompt_key: the column holding the problem text (the template's ``{question}``).
        answer_key: the column holding the reference answer (``None``: no answer; records get ``""``).
        extra_keys: the columns kept in each record for the reward (``None``: every column but ``prompt``
            and ``answer``; ``[]``: none). A listed column that a row lacks is an error.
        split: the `datasets` split (``from_hub`` only).
        from_hub: ``path`` is a `datasets` name, loaded from the local cache (offline).
        hub_config: the `datasets` config name (``"main"`` for ``openai/gsm8k``).
        template: user-message template with a ``{question}`` placeholder.
        system: optional system prompt.
        use_chat_template: use the tokenizer's chat template when it has one (the data module hands the
            policy's tokenizer over before loading).
        max_prompt_chars: skip (and count) prompts longer than this many characters.
        limit: keep only the first ``limit`` records.

    Raises:
        DataError: the file is missing (at creation) or malformed, or lacks a key (at ``load``).
        ConfigError: an unknown file extension, a template without ``{question}``, a non-positive limit,
            or ``from_hub`` without ``datasets`` installed.
    """

    def __init__(
        self,
        path: str,
        prompt_key: str = "prompt",
        answer_key: str | None = "answer",
        extra_keys: list[str] | None = None,
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
                raise ConfigError(
                    f"{name}(from_hub=True) needs the `datasets` package: pip install datasets "
                    "(or pip install 'logra-lightning[datasets]')"
                )
        else:
            p = Path(path)
            if not p.is_file():
                raise DataError(
                    f"{path}: data file not found ({name}.path); to load a `datasets` name from the local cache "
                    "set from_hub=True"
                )
            if p.suffix.lower() not in FORMATS:
                raise ConfigError(f"{name}.path={path!r}: unknown format {p.suffix!r}; use one of {FORMATS}")
        self.path, self.split, self.from_hub, self.hub_config = path, split, from_hub, hub_config
        self.prompt_key, self.answer_key, self.extra_keys = prompt_key, answer_key, extra_keys
        self.template, self.system, self.use_chat_template = template, system, use_chat_template
        self.max_prompt_chars, self.limit = max_prompt_chars, limit
        self.tokenizer = None  # set by whoever owns the tokenizer, before load(), to use its chat template
        self.stats: dict[str, int] = {}

    def rows(self) -> Iterator[tuple[str, object]]:
        """``(where, row)`` pairs from the file or the cache, ``where`` being ``"path:line"`` or similar."""
        if self.from_hub:
            return _iter_hub(self.path, self.hub_config, self.split)
        path = Path(self.path)
        if path.suffix.lower() == ".csv":
            return _iter_csv(path, (self.prompt_key, self.answer_key))
        return {".jsonl": _iter_jsonl, ".json": _iter_json, ".parquet": _iter_parquet}[path.suffix.lower()](path)

    def _question_and_answer(self, row: dict, where: str) -> tuple[str, str]:
        """The problem text and the reference answer of a row."""
        question = _text_field(row, self.prompt_key, where, "prompt_key")
        answer = "" if self.answer_key is None else _text_field(row, self.answer_key, where, "answer_key")
        return question, answer

    def _extra_fields(self, row: dict, where: str, question: str) -> dict[str, Any]:
        """The row's fields the record keeps for the reward."""
        if self.extra_keys is None:
            return {k: v for k, v in row.items() if k not in OWN_KEYS}
        missing = [k for k in self.extra_keys if k not in row]
        if missing:
            raise DataError(
                f"{where}: missing field(s) {missing} of extra_keys (fields present: {sorted(row)}); "
                "remove them from extra_keys or add them to the data"
            )
        return {k: row[k] for k in self.extra_keys}

    def load(self) -> list[dict[str, Any]]:
        records, too_long = [], 0
        for where, row in self.rows():
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            question, answer = self._question_and_answer(row, where)
            prompt = render_prompt(question, self.tokenizer, self.template, self.system, self.use_chat_template)
            if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
                too_long += 1
                continue
            records.append({"prompt": prompt, "answer": answer, **self._extra_fields(row, where, question)})
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
