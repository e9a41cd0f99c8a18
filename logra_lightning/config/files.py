"""The ``--config`` files of a command line, checked before jsonargparse parses them.

:func:`check_config_files` runs from :func:`~logra_lightning.cli.main` before parsing: every
``--config`` file exists, is readable, is valid YAML (the error names ``file:line:column``) and
holds a mapping whose ``trainer:``/``model:``/``data:`` sections are mappings; jsonargparse's own
messages for these are a traceback-like dump. (Step 4 of :mod:`logra_lightning.config.checks`.)

Example::

    >>> config_file_args(["fit", "--config", "a.yaml", "--config=b.yaml", "-c", "c.yaml"])
    ['a.yaml', 'b.yaml', 'c.yaml']
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from logra_lightning.errors import ConfigError


def config_file_args(argv: Sequence[str]) -> list[str]:
    """The values of ``--config`` / ``-c`` in ``argv`` (``--config X`` and ``--config=X``)."""
    found = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith("--config="):
            found.append(arg.split("=", 1)[1])
    return found


def _unique_key_loader():
    """A ``yaml.SafeLoader`` that rejects a key given twice in one mapping (``safe_load`` keeps the last silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {key!r} (first on line {seen[key] + 1}); keep one of them",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def check_config_file(path: str) -> None:
    """``path`` must be a readable YAML file holding a mapping.

    Raises:
        ConfigError: ``--config <path>: <what>``; a YAML error names ``<path>:<line>:<column>``.
    """
    import yaml

    file = Path(path).expanduser()
    if not file.exists():
        near = sorted(p.name for p in file.parent.glob("*.yaml")) if file.parent.is_dir() else []
        hint = f"; {file.parent} has: {', '.join(near[:8])}" if near else ""
        raise ConfigError(f"--config {path}: no such file (relative paths start at {Path.cwd()}){hint}")
    if file.is_dir():
        raise ConfigError(f"--config {path}: is a directory; give the YAML file, e.g. {path.rstrip('/')}/<name>.yaml")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = file.read_bytes()[: err.start].count(b"\n") + 1
        raise ConfigError(f"--config {path}:{line}: not UTF-8 text ({err.reason}); is it a YAML file?") from None
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot be read ({err.strerror}); check its permissions") from None
    try:
        doc = yaml.load(text, Loader=_unique_key_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        what = " ".join(str(x) for x in (err.context, err.problem) if x)
        hint = (
            ""
            if isinstance(err, yaml.constructor.ConstructorError)
            else ("; tabs and unbalanced quotes or brackets are the usual causes")
        )
        raise ConfigError(f"--config {path}{where}: not valid YAML ({what}){hint}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path}: not valid YAML ({' '.join(str(err).split())})") from None
    if doc is None:
        raise ConfigError(f"--config {path}: the file is empty; see configs/ for complete examples")
    if not isinstance(doc, dict):
        raise ConfigError(
            f"--config {path}: holds a YAML {type(doc).__name__}, not a mapping of sections (trainer:, model:, data:)"
        )
    for section in ("trainer", "model", "data"):
        value = doc.get(section)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(
                f"--config {path}: section {section}: holds a {type(value).__name__} ({value!r:.40}), not "
                f"a mapping; put its keys on indented lines under '{section}:'"
            )


def check_config_files(argv: Sequence[str]) -> None:
    """Run :func:`check_config_file` on every ``--config`` value in ``argv``."""
    for path in config_file_args(argv):
        check_config_file(path)
