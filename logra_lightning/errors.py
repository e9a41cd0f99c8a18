"""The project's own error types: bad configs and bad data fail with these, never deep library tracebacks."""


class LograError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(LograError, ValueError):
    """A config value is out of range or a combination is invalid; the message names the key and value."""


class DataError(LograError, ValueError):
    """A data file is missing, empty or malformed; the message names the file and line."""


class TrainingError(LograError, RuntimeError):
    """Training stopped on purpose (a failed component, too many skipped steps); its message names the step, the fix."""


class CheckpointError(LograError, OSError):
    """Writing a checkpoint failed; the previous checkpoint at that path is left as it was."""
