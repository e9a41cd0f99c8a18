"""The ``logra`` command: :func:`~logra_lightning.cli.main.main` for the console, :func:`~logra_lightning.cli.main.run`
from Python."""

from logra_lightning.cli.main import main, run

__all__ = ["main", "run"]
