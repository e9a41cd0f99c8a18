"""The project's own error types: bad configs and bad data fail with these, never deep library tracebacks."""


class LograError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(LograError, ValueError):
    """A config value is out of range or a combination is invalid; the message names the key and value."""


class DataError(LograError, ValueError):
    """A data file is missing, empty or malformed; the message names the file and line."""
