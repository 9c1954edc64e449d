"""Blocking librdkafka calls run on a thread of their own, so that one that never returns can be given up."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from batchline.exceptions import BatchlineError

T = TypeVar("T")
HANG_GRACE_S = 10.0  # a call still blocked this long past its own timeout is hung (see BoundedCalls): abandoned


class CallHung(BatchlineError):
    """A transactional call still blocked :data:`HANG_GRACE_S` past its own timeout: its producer is abandoned."""


class BoundedCalls:
    """Runs one producer's blocking transactional calls on a daemon thread of their own, so the caller waits at most
    the call's timeout plus :data:`HANG_GRACE_S`. librdkafka 2.16 may block such a call for good whatever timeout it
    is given: ``send_offsets_to_transaction`` after a connection reset or behind a blackhole waits in
    ``rd_kafka_txn_op_req0`` for a coordinator request that never times out (an open librdkafka bug:
    ``send_offsets_to_transaction()`` ignores its timeout, the coordinator request's own is never checked; when it
    is fixed this thread can go, see docs/architecture.md "Threads"). A call that hangs keeps its thread: the runner
    is abandoned with its producer (see :meth:`~batchline.kafka.producer_lifecycle.ProducerLifecycle.recreate`),
    and a daemon thread never holds the process's exit.

    Hand-off: the caller's thread puts one call in ``_call`` and waits on ``_done``; the runner's thread runs it
    and stores its outcome. One call at a time (the producer's owner is one thread)."""

    def __init__(self, name: str) -> None:
        self._ready = threading.Event()
        self._done = threading.Event()
        self._call: Callable[[], Any] | None = None
        self._outcome: tuple[bool, Any] = (True, None)
        self.hung = False
        self.closed = False
        self._thread = threading.Thread(target=self._run, name=f"txn-calls {name}", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[float], T], timeout: float) -> T:
        """``fn(timeout)`` on the runner's thread; its result or its exception, or :class:`CallHung`."""
        if self.hung:
            raise CallHung("an earlier call of this producer is still blocked")
        if self.closed:
            raise CallHung("the calls of this producer were closed")
        self._done.clear()
        self._call = lambda: fn(timeout)
        self._ready.set()
        if not self._done.wait(timeout + HANG_GRACE_S):
            self.hung = True
            raise CallHung(f"a transactional call still blocked {timeout + HANG_GRACE_S:.0f}s after it began")
        (ok, value), self._outcome = self._outcome, (True, None)  # held no longer than the call
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """End the runner's thread once it is idle (never waited for): a hung one ends if its call ever returns.
        Its last call and outcome are not kept, so nothing here keeps a retired producer alive."""
        self.closed = True
        self._call = None
        self._ready.set()

    def _run(self) -> None:
        while True:
            self._ready.wait()
            self._ready.clear()
            call, self._call = self._call, None
            if call is None:  # closed
                return
            try:
                self._outcome = (True, call())
            except BaseException as exc:  # handed to the caller's thread, raised there
                self._outcome = (False, exc)
            del call  # the closure holds the producer it called: not kept while idle
            self._done.set()
