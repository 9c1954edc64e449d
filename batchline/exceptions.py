"""The platform's exceptions. Every error batchline raises derives from :class:`BatchlineError`."""

from __future__ import annotations


class BatchlineError(Exception):
    """Root of every batchline error."""


class ConfigError(BatchlineError):
    """A job config, flag or environment value is invalid. The message is one line for the operator."""


class BrokerError(BatchlineError):
    """The embedded broker could not start or stop."""


class TopicError(BatchlineError):
    """Topics could not be created or described."""


class InputFileError(BatchlineError):
    """A file given to submit/replay cannot be read."""
