"""``python -m logra_lightning.builtin [NAME ...]``: build (or find in the cache) built-in policies; print each path.

With no name, builds ``arithmetic-tiny`` (the demo's base policy). Each model's ``warmup.json``
holds its warm-up summary (held-out accuracy, steps, seconds).
"""

import json
import sys
from pathlib import Path

from logra_lightning.builtin.registry import BUILTIN_PREFIX, resolve_model


def main(names: list[str]) -> None:
    for name in names or ["arithmetic-tiny"]:
        path = resolve_model(name if name.startswith(BUILTIN_PREFIX) else BUILTIN_PREFIX + name)
        summary = json.loads((Path(path) / "warmup.json").read_text())
        print(path)
        print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
