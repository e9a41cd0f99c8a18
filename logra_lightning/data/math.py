"""GSM8K- and MATH-shaped prompt sources: :class:`~logra_lightning.data.table.TableSource` set up for their fields.

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

Reading (JSONL, JSON, Parquet, CSV or a cached `datasets` name), templating, the
``max_prompt_chars`` filter and the errors (file and line) are :class:`TableSource`'s; a
GSM8K answer without a final ``####`` line and a MATH solution without a boxed answer
are errors too.

Example::

    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "gsm8k.jsonl")
    >>> _ = open(path, "w").write(json.dumps({"question": "2 cats and 3 dogs: pets?", "answer": "2+3=5\\n#### 5"}))
    >>> GSM8KSource(path, template="Q: {question}\\nA:").load()
    [{'prompt': 'Q: 2 cats and 3 dogs: pets?\\nA:', 'answer': '5', 'question': '2 cats and 3 dogs: pets?'}]
"""

from __future__ import annotations

from typing import Any

from logra_lightning.data.table import FORMATS, TableSource, _text_field
from logra_lightning.errors import DataError
from logra_lightning.rewards.math import extract_boxed

__all__ = ["FORMATS", "GSM8KSource", "MATHSource", "gsm8k_final_answer"]


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


class _MathFileSource(TableSource):
    """A :class:`TableSource` whose subclass turns a row into ``(question, answer)`` and keeps ``question``.

    A subclass adds the names of the fields it reads (:meth:`_question_and_answer`); everything else is
    these arguments, passed on as ``**kwargs`` (jsonargparse follows them here, so ``logra fit --help``
    lists them under the subclass).

    Args:
        path: a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, or a `datasets` name with ``from_hub=True``.
        split: `datasets` split (``from_hub`` only).
        from_hub: load ``path`` with ``datasets.load_dataset`` from the local cache (offline).
        hub_config: `datasets` config name (``"main"`` for ``openai/gsm8k``).
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
        super().__init__(
            path,
            split=split,
            from_hub=from_hub,
            hub_config=hub_config,
            template=template,
            system=system,
            use_chat_template=use_chat_template,
            max_prompt_chars=max_prompt_chars,
            limit=limit,
        )

    def _extra_fields(self, row: dict, where: str, question: str) -> dict[str, Any]:
        return {"question": question}


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
