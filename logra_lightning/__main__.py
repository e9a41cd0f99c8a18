"""``python -m logra_lightning ...`` is the ``logra`` command."""

from logra_lightning.cli import main

if __name__ == "__main__":
    main()
