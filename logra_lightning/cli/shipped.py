"""The configs and callback snippets shipped in the package, found by name: ``logra configs``.

``configs/*.yaml`` and ``callbacks/*.yaml`` are package data (``logra_lightning/configs`` and
``logra_lightning/callback_snippets``, links to those folders in a clone, real folders in a wheel),
so every documented command works after ``pip install`` too::

    logra configs                                  # the configs and snippets, each with its one-line purpose
    logra configs cp smollm2_chain_sum my.yaml     # a copy to edit
    logra fit --config smollm2_chain_sum           # by name; a path works as before
    logra fit --config my.yaml --trainer.callbacks+=memory_monitor

A value that is an existing file is used as it is. Otherwise a bare name (``smollm2_chain_sum``,
``smollm2_chain_sum.yaml``) or the documented relative path (``configs/smollm2_chain_sum.yaml``,
``callbacks/memory_monitor.yaml``) names the shipped file; anything else is left for the file
check to report (with the closest shipped names).

Example::

    >>> "arithmetic_tiny" in shipped("configs") and "memory_monitor" in shipped("callbacks")
    True
    >>> purpose(shipped("configs")["arithmetic_tiny_adamw"])
    'RL on the built-in tiny arithmetic policy with dense AdamW (the baseline LoGRA is compared to).'
    >>> resolve("configs/arithmetic_tiny.yaml", "configs") == str(shipped("configs")["arithmetic_tiny"])
    True
    >>> close_names("arithmetic_tiny_adam", "configs")[0]
    'arithmetic_tiny_adamw'
"""

from __future__ import annotations

import difflib
import shutil
import sys
import textwrap
from importlib import resources
from pathlib import Path

from logra_lightning.errors import ConfigError

# kind -> the package-data folder holding it
FOLDERS = {"configs": "configs", "callbacks": "callback_snippets"}


def folder(kind: str) -> Path:
    """The shipped folder of ``kind`` (``"configs"`` or ``"callbacks"``)."""
    return Path(str(resources.files("logra_lightning") / FOLDERS[kind]))


def shipped(kind: str) -> dict[str, Path]:
    """``{name: path}`` of the shipped ``*.yaml`` files of ``kind``, sorted by name."""
    return {p.stem: p for p in sorted(folder(kind).glob("*.yaml"))}


def purpose(path: Path) -> str:
    """The opening comment of a YAML file up to its first command line (every shipped one opens with its purpose)."""
    words = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#") or line.startswith(("#  ", "# Logs:")):  # "#   logra fit ...": the command
            break
        words.append(line.lstrip("#").strip())
    return " ".join(words)


def close_names(value: str, kind: str) -> list[str]:
    """Up to three shipped names of ``kind`` closest to ``value``."""
    stem = Path(value).name.removesuffix(".yaml")
    return difflib.get_close_matches(stem, list(shipped(kind)), n=3, cutoff=0.5)


def shipped_path(value: str, kind: str) -> Path | None:
    """The shipped file ``value`` names (a bare name, ``name.yaml`` or ``<kind>/name.yaml``), or ``None``."""
    path = Path(value)
    if path.suffix not in ("", ".yaml") or (len(path.parts) > 1 and path.parent.as_posix() != kind):
        return None
    return shipped(kind).get(path.name.removesuffix(".yaml"))


def resolve(value: str, kind: str) -> str:
    """``value`` if it is an existing file, else the shipped file it names, else ``value`` unchanged."""
    if Path(value).expanduser().is_file():
        return value
    found = shipped_path(value, kind)
    return str(found) if found is not None else value


def unknown_name_hint(value: str, kind: str) -> str:
    """``"; shipped configs close to it: a, b (logra configs lists them all)"`` or a pointer to the list."""
    near = close_names(value, kind)
    what = "configs" if kind == "configs" else "callback snippets"
    if near:
        return f"; shipped {what} close to it: {', '.join(near)} (`logra configs` lists them all)"
    return f"; `logra configs` lists the shipped {what}"


def resolve_config(value: str) -> str:
    """A ``--config`` value as a path: the file, or the shipped config it names.

    Raises:
        ConfigError: neither a file nor a shipped name (the close names listed).
    """
    resolved = resolve(value, "configs")
    missing = not Path(resolved).expanduser().exists()
    if missing and (close_names(value, "configs") or not value.endswith((".yml", ".yaml", "/"))):
        raise ConfigError(
            f"--config {value}: no such file, and no shipped config of that name{unknown_name_hint(value, 'configs')}"
        )
    return resolved  # another missing *.yaml path is the file check's to report (it lists the folder)


def resolve_argv(argv: list[str]) -> list[str]:
    """``argv`` with ``--config NAME`` and ``--trainer.callbacks+=NAME`` turned into the shipped files' paths.

    Raises:
        ConfigError: ``--config`` names neither a file nor a shipped config (the message lists close names).
    """
    out = list(argv)
    for i, arg in enumerate(out):
        for flag, fix in (
            ("--config", resolve_config),
            ("-c", resolve_config),
            ("--trainer.callbacks+", lambda v: resolve(v, "callbacks")),
        ):
            if arg == flag and i + 1 < len(out):
                out[i + 1] = fix(out[i + 1])
            elif arg.startswith(flag + "="):
                out[i] = f"{flag}={fix(arg[len(flag) + 1 :])}"
    return out


def _listing() -> str:
    lines = []
    for kind, how in (
        ("configs", "logra fit --config NAME"),
        ("callbacks", "--trainer.callbacks+=NAME"),
    ):
        files = shipped(kind)
        width = max(map(len, files), default=0)
        lines.append(f"{kind} ({how}; logra configs cp NAME DST copies one to edit):")
        for name, path in files.items():
            text = textwrap.wrap(purpose(path), 118 - width, break_on_hyphens=False) or [""]
            lines += [f"  {name:<{width}}  {text[0]}", *(f"  {'':<{width}}  {t}" for t in text[1:])]
        lines.append("")
    return "\n".join(lines)


def copy(name: str, dst: str) -> Path:
    """Copy the shipped config or snippet ``name`` to ``dst`` (a file, or a folder to put it in).

    Raises:
        ConfigError: an unknown name (with the close ones), or ``dst`` exists as a file.
    """
    src = shipped_path(name, "configs") or shipped_path(name, "callbacks")
    if src is None:
        kind = "configs" if close_names(name, "configs") or not close_names(name, "callbacks") else "callbacks"
        raise ConfigError(
            f"logra configs cp {name}: no shipped config or callback snippet of that name"
            + unknown_name_hint(name, kind)
        )
    target = Path(dst).expanduser()
    if target.is_dir():
        target = target / src.name
    if target.exists():
        raise ConfigError(f"logra configs cp {name} {dst}: {target} exists; remove it or choose another name")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, target)
    return target


USAGE = """usage: logra configs              list the shipped configs and callback snippets with their purpose
       logra configs cp NAME DST   copy one (to the file DST, or into the folder DST) to edit
"""


def main(argv: list[str]) -> int:
    """``logra configs [ls | cp NAME DST]``; returns the exit status (a :class:`ConfigError` for a bad name)."""
    if not argv or argv == ["ls"]:
        print(_listing(), end="")
        return 0
    if argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if argv[0] == "cp" and len(argv) == 3:
        target = copy(argv[1], argv[2])
        print(f"copied {argv[1]} to {target}; run it with: logra fit --config {target}")
        return 0
    print("logra configs: error: expected `logra configs` or `logra configs cp NAME DST`", file=sys.stderr)
    print(USAGE, end="", file=sys.stderr)
    return 2
