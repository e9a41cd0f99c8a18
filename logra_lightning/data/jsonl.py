"""Prompt/answer pairs from a JSONL file: one ``{"prompt": ..., "answer": ...}`` object per line.

Blank lines are skipped; anything else that is not such an object (or has a ``null``
field) is an error naming the file and line, raised before any model is built. A path that
is a directory or cannot be read (permissions) fails with the path and what to do.

Example::

    >>> import json, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "d.jsonl")
    >>> _ = open(path, "w").write(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\\n")
    >>> JSONLSource(path).load()
    [{'prompt': '2+2=', 'answer': '4'}]
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from logra_lightning.data.source import PromptSource
from logra_lightning.errors import DataError


def check_data_file(path: str | Path, key: str = "") -> None:
    """``path`` must be an existing, readable file (not a directory).

    Raises:
        DataError: ``"<path>: <what>"``, with ``key`` (the config key) when given.
    """
    path = Path(path)
    where = f" ({key})" if key else ""
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.jsonl"))[:3]
        hint = f"; it holds {', '.join(inside)}" if inside else ""
        raise DataError(f"{path}: is a directory, not a data file{where}; give the .jsonl file{hint}")
    if not path.is_file():
        raise DataError(f"{path}: data file not found{where}")
    if not os.access(path, os.R_OK):
        raise DataError(f"{path}: cannot be read (permissions){where}; fix them with chmod or copy the file")


def read_jsonl_records(path: str | Path, fields: tuple[str, ...]) -> list[dict]:
    """Parse ``path`` as JSONL objects that each have ``fields`` (values turned into ``str``).

    Raises:
        DataError: missing, unreadable or empty file, a directory, non-UTF-8 bytes, invalid
            JSON, a non-object line, a missing or null field; the message is ``"<path>:<line>: <what>"``.
    """
    path = Path(path)
    check_data_file(path)
    records = []
    try:
        fh = path.open("rb")
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror}); check its permissions") from None
    with fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            missing = [f for f in fields if f not in obj]
            if missing:
                raise DataError(f"{path}:{lineno}: missing field(s) {missing}; each line needs {list(fields)}")
            null = [f for f in fields if obj[f] is None]
            if null:
                raise DataError(
                    f"{path}:{lineno}: field(s) {null} are null; each line needs a value for {list(fields)}"
                )
            records.append({**obj, **{f: str(obj[f]) for f in fields}})
    if not records:
        raise DataError(f"{path}: no records (the file is empty)")
    return records


class JSONLSource(PromptSource):
    """Prompt source reading ``{"prompt", "answer"}`` JSONL (a ``class_path`` target in configs).

    Args:
        path: the JSONL file. Checked for existence when the source is created.

    Raises:
        DataError: the file does not exist (at creation) or is malformed (at ``load``).
    """

    def __init__(self, path: str) -> None:
        check_data_file(path, "JSONLSource.path")
        self.path = path

    def load(self) -> list[dict]:
        return read_jsonl_records(self.path, ("prompt", "answer"))
