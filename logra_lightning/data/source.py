"""The prompt-source base class (subclass it and pick yours in a config by ``class_path``)."""


class PromptSource:
    """Base class of prompt sources: subclasses take plain init args and implement :meth:`load`."""

    def load(self) -> list[dict]:
        """Return records ``{"prompt": str, "answer": str, ...}``."""
        raise NotImplementedError
