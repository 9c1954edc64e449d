"""The CLI's one failure handler: every exception that ends a command becomes one line and an exit code.

batchline's own errors carry their exit code (:class:`batchline.exceptions.ExitCode`). Errors of the libraries
underneath are translated here, in one place: a librdkafka error that escaped a call (the broker went away
between the preflight probe and the call), a timeout, a click usage error. Anything else is a bug: one line,
exit 70, and the traceback only with ``BATCHLINE_DEBUG=1``.
"""

from __future__ import annotations

import os
import traceback

from confluent_kafka import KafkaError, KafkaException

from batchline.exceptions import (
    BatchlineError,
    BrokerUnreachable,
    ExitCode,
    KafkaOperationError,
    TopicError,
)
from batchline.kafka.liveness import DOWN_CODES

_TOPIC_CODES = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION})


def as_batchline_error(exc: BaseException, bootstrap: str) -> BatchlineError | None:
    """``exc`` as one of batchline's errors (which carry the exit code), or None if it is not understood."""
    if isinstance(exc, BatchlineError):
        return exc
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        err: KafkaError = exc.args[0]
        if err.code() in DOWN_CODES:
            return BrokerUnreachable(bootstrap, err.str())
        if err.code() in _TOPIC_CODES:
            return TopicError(f"{err.str()} at {bootstrap}: run `batchline topics create JOB` first")
        return KafkaOperationError(bootstrap, "a Kafka call", f"{err.name()}: {err.str()}")
    if isinstance(exc, TimeoutError):
        return BrokerUnreachable(bootstrap, "a request timed out")
    return None


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def _click_kinds(exc: BaseException) -> set[str]:
    # typer vendors its own copy of click: its exceptions are matched by module and class name, not by import.
    return {cls.__name__ for cls in type(exc).__mro__ if "click" in cls.__module__}


def report(exc: BaseException, bootstrap: str) -> int:
    """Print ``exc`` as one line on stderr and return the exit code."""
    kinds = _click_kinds(exc)
    if "NoArgsIsHelpError" in kinds:
        exc.show()  # type: ignore[attr-defined]  # no arguments at all: the help text, as click prints it
        return ExitCode.USAGE
    if "UsageError" in kinds:
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "batchline"
        _print(f"{exc.format_message()} (see `{where} --help`)")  # type: ignore[attr-defined]
        return ExitCode.USAGE
    if "ClickException" in kinds:
        _print(exc.format_message())  # type: ignore[attr-defined]
        return int(getattr(exc, "exit_code", ExitCode.FAILED))
    if isinstance(exc, KeyboardInterrupt) or "Abort" in kinds:
        _print("interrupted")
        return ExitCode.INTERRUPTED
    error = as_batchline_error(exc, bootstrap)
    if error is not None:
        _print(str(error))
        return int(error.exit_code)
    if os.environ.get("BATCHLINE_DEBUG"):
        traceback.print_exception(exc)
    _print(f"unexpected {type(exc).__name__}: {exc} (a bug: rerun with BATCHLINE_DEBUG=1 and report the traceback)")
    return ExitCode.INTERNAL


def _print(message: str) -> None:
    from rich.text import Text

    from batchline.cli.common import console

    # soft_wrap: one line however narrow the terminal; colour only on a terminal.
    console.print(Text.assemble(("error:", "red"), " ", one_line(message)), soft_wrap=True)
