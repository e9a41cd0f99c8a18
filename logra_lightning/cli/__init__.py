"""The ``logra`` command (:func:`~logra_lightning.cli.main.main`)."""

from logra_lightning.cli.main import main

__all__ = ["main"]
