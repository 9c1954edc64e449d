"""The platform's exceptions. Every error batchline raises derives from :class:`BatchlineError`.

Each class carries the process exit code the CLI ends with (:class:`ExitCode`, docs/cli.md's table "Failures and
exit codes"), and its message is one line for the operator: what failed, where (the bootstrap address, the
topic, the path), and what to check. The CLI prints ``error: <message>`` and exits with ``exit_code``.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """The documented exit codes of every ``batchline`` command."""

    OK = 0
    FAILED = 1  # the work did not complete (e.g. the demo found records without an outcome), or another failure
    USAGE = 2  # a bad flag or argument, an unreadable input file, an output path that cannot be written
    BROKER = 3  # no Kafka broker answers at the bootstrap address, or the broker was lost for too long mid-run
    TOPIC = 4  # a topic the command needs does not exist (never created, or deleted mid-run)
    CONFIG = 5  # the job config or a setting is unreadable or invalid
    ENGINE = 6  # the engine cannot start: the model directory is not a model, a missing extra
    NOT_FOUND = 7  # the run named does not exist, or there is nothing to replay
    INTERNAL = 70  # a bug: an unexpected exception (the traceback is shown with BATCHLINE_DEBUG=1)
    INTERRUPTED = 130  # Ctrl-C


class BatchlineError(Exception):
    """Root of every batchline error."""

    exit_code: int = int(ExitCode.FAILED)  # a class default; an instance may carry its own


class UsageError(BatchlineError):
    """A flag, argument or file given on the command line cannot be used."""

    exit_code = ExitCode.USAGE


class InputFileError(UsageError):
    """A file given to submit/replay cannot be read."""


class ConfigError(BatchlineError):
    """A job config, flag or environment value is invalid. The message is one line for the operator."""

    exit_code = ExitCode.CONFIG


class BrokerError(BatchlineError):
    """The embedded broker could not start or stop."""


class BrokerUnreachable(BatchlineError):
    """No Kafka broker answers at ``bootstrap`` (refused, unresolvable, timed out, or not speaking Kafka)."""

    exit_code = ExitCode.BROKER

    def __init__(self, bootstrap: str, reason: str) -> None:
        super().__init__(
            f"no Kafka broker reachable at {bootstrap} ({reason}): check that the broker is running and that "
            "--bootstrap / BATCHLINE_BOOTSTRAP names it"
        )
        self.bootstrap = bootstrap
        self.reason = reason


class BrokerLost(BrokerUnreachable):
    """The broker went away mid-run and did not come back within the configured bound.

    Raised by :class:`batchline.kafka.liveness.BrokerLiveness`. Nothing after the last committed batch was
    committed; the next owner of the partitions re-reads it from the committed offsets.
    """

    def __init__(self, bootstrap: str, waited_s: float, reason: str) -> None:
        BatchlineError.__init__(
            self,
            f"lost the Kafka broker at {bootstrap} for {waited_s:.0f}s ({reason}), more than "
            "BATCHLINE_BROKER_LOSS_TIMEOUT_S: nothing uncommitted was marked done; check the broker and "
            "--bootstrap / BATCHLINE_BOOTSTRAP, then restart",
        )
        self.bootstrap = bootstrap
        self.reason = reason
        self.waited_s = waited_s


class KafkaOperationError(BatchlineError):
    """A Kafka call failed although the broker answers (authorization, delivery, an unexpected error code)."""

    def __init__(self, bootstrap: str, what: str, reason: str) -> None:
        super().__init__(f"{what} failed at {bootstrap}: {reason}")
        self.bootstrap = bootstrap


class TopicError(BatchlineError):
    """Topics could not be created or described."""

    exit_code = ExitCode.TOPIC


class MissingTopicError(TopicError):
    """Topics a command needs do not exist at ``bootstrap``: ``batchline topics create JOB`` first."""

    def __init__(self, bootstrap: str, job: str, missing: list[str], deleted: bool = False) -> None:
        what = "was deleted" if deleted and len(missing) == 1 else "were deleted" if deleted else "does not exist"
        if not deleted and len(missing) > 1:
            what = "do not exist"
        super().__init__(
            f"topic {', '.join(missing)} {what} at {bootstrap}: run `batchline topics create {job}` "
            "(or check --bootstrap and the job name)"
        )
        self.bootstrap = bootstrap
        self.job = job
        self.missing = missing


class ModelError(BatchlineError):
    """The engine's model cannot be used: the path is not a model directory. Checked before anything loads."""

    exit_code = ExitCode.ENGINE


class NotFoundError(BatchlineError):
    """The run (or other named thing) does not exist, or there is nothing to act on."""

    exit_code = ExitCode.NOT_FOUND
