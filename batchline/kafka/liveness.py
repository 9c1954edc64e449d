"""Is the broker there? A bounded probe for commands, and a loss detector for long-running processes.

- :func:`probe` is what every command runs before it touches Kafka: a TCP connect to the bootstrap servers and
  one metadata request, bounded by ``KafkaSettings.probe_timeout_s``. It returns the names of the existing
  topics, or raises :class:`BrokerUnreachable` naming the address and what to check.
- :class:`BrokerLiveness` decides when a worker has lost its broker for good. It is fed by librdkafka's
  ``error_cb`` (the client factory gives every client an ``error_cb`` that forwards to the detectors of its
  bootstrap address, :func:`client_error_cb`), and by failed commit/consume calls (:meth:`~BrokerLiveness.failed`).
  A background thread probes the broker (every second while it is suspected down, every few seconds otherwise);
  what a process builds that must know whether the broker is down gets the detector's :attr:`~BrokerLiveness.down`
  passed explicitly (a :data:`BrokerDown`: the transactional producer, the group sampler);
  any successful round trip (a probe, a committed transaction: :meth:`~BrokerLiveness.ok`) clears the suspicion.
  :meth:`~BrokerLiveness.check`, called from the worker loop, never blocks: it raises :class:`BrokerLost` once the
  broker has been down for ``KafkaSettings.broker_loss_timeout_s``, and :class:`MissingTopicError` when a watched
  topic has disappeared (two probes in a row), so a worker never runs on against a deleted topic.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from batchline.config import KafkaSettings
from batchline.exceptions import BrokerLost, BrokerUnreachable, MissingTopicError

log = logging.getLogger(__name__)
# librdkafka errors that say the broker cannot be reached (rather than that one request failed).
DOWN_CODES = frozenset(
    {
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._TRANSPORT,
        KafkaError._RESOLVE,
        KafkaError._TIMED_OUT,
        KafkaError._MSG_TIMED_OUT,
    }
)
SUSPECT_PROBE_INTERVAL_S = 1.0  # probe period while the broker is suspected down
WATCH_PROBE_INTERVAL_S = 5.0  # probe period otherwise (also how soon a deleted topic is noticed)

Listener = Callable[[KafkaError], None]
_detectors: dict[str, list[BrokerLiveness]] = {}
_detectors_lock = threading.Lock()


def client_error_cb(bootstrap: str) -> Listener:
    """The ``error_cb`` the client factory gives each client of ``bootstrap``: forwards to its detectors."""

    def on_error(err: KafkaError) -> None:
        with _detectors_lock:
            targets = list(_detectors.get(bootstrap, ()))
        for detector in targets:
            detector.on_error(err)

    return on_error


BrokerDown = Callable[[], bool]  # whether the broker is suspected down now (BrokerLiveness.down), given to its readers


def never_down() -> bool:
    """The :data:`BrokerDown` of a component run without a liveness detector (unit tests, one-shot tools)."""
    return False


def _addresses(bootstrap: str) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for part in bootstrap.split(","):
        address = part.strip().split("://")[-1]
        host, sep, port = address.rpartition(":")
        if sep and port.isdigit():
            out.append((host.strip("[]") or "localhost", int(port)))
    return out


def tcp_reason(bootstrap: str, timeout_s: float) -> str | None:
    """None if any bootstrap server accepts a TCP connection within ``timeout_s``, else why none did."""
    addresses = _addresses(bootstrap)
    if not addresses:
        return "not a host:port list"
    reasons: list[str] = []
    deadline = time.monotonic() + timeout_s
    for host, port in addresses:
        try:
            socket.create_connection((host, port), max(0.1, deadline - time.monotonic())).close()
            return None
        except socket.gaierror:
            reasons.append(f"cannot resolve {host}")
        except TimeoutError:
            reasons.append(f"no answer from {host}:{port} within {timeout_s:g}s")
        except OSError as exc:
            reasons.append(f"{exc.strerror or exc}".lower())
    return "; ".join(dict.fromkeys(reasons))


def metadata(kafka: KafkaSettings, timeout_s: float | None = None, admin: Any = None) -> Any:
    """The cluster's metadata (topics, cluster id) at ``kafka.bootstrap``, or :class:`BrokerUnreachable` within the
    timeout (``kafka.probe_timeout_s`` by default)."""
    from batchline.kafka.client import make_admin

    timeout = kafka.probe_timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout
    reason = tcp_reason(kafka.bootstrap, timeout)
    if reason is not None:
        raise BrokerUnreachable(kafka.bootstrap, reason)
    client = admin if admin is not None else make_admin(kafka)
    try:
        return client.list_topics(timeout=max(0.2, deadline - time.monotonic()))
    except KafkaException as exc:
        raise BrokerUnreachable(
            kafka.bootstrap,
            f"it accepts connections but answered no metadata request within {timeout:g}s: {exc.args[0].str()}; "
            "check BATCHLINE_SECURITY_PROTOCOL and the TLS/SASL settings",
        ) from None


def probe(kafka: KafkaSettings, timeout_s: float | None = None, admin: Any = None) -> set[str]:
    """The names of the topics at ``kafka.bootstrap``, or :class:`BrokerUnreachable` within the timeout."""
    meta = metadata(kafka, timeout_s, admin)
    return {name for name, topic in meta.topics.items() if topic.error is None}


class BrokerLiveness:
    """Turns broker errors and probes into one decision: keep retrying, or give up with :class:`BrokerLost`."""

    def __init__(
        self,
        kafka: KafkaSettings,
        job: str = "",
        watch: Iterable[str] = (),
        probe_fn: Callable[[], set[str]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kafka = kafka
        self.bootstrap = kafka.bootstrap
        self.timeout_s = kafka.broker_loss_timeout_s
        self.job = job
        self.watch = list(watch)
        self.clock = clock
        self._probe_fn = probe_fn
        self._admin: Any = None
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._reason = ""
        self._missing: list[str] = []
        self._missing_streak = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -- inputs ----------------------------------------------------------------------------------
    def on_error(self, err: KafkaError) -> None:
        """librdkafka's error_cb (and consume errors): broker-down codes start the clock."""
        if err.code() in DOWN_CODES:
            self.failed(err.str())

    def failed(self, reason: str) -> None:
        """A call that needed the broker failed: the broker is suspected down from now (if not already)."""
        with self._lock:
            if self._down_since is None:
                self._down_since = self.clock()
                self._reason = reason
                log.warning("broker at %s suspected down: %s", self.bootstrap, reason)
                self._wake.set()  # probe now rather than at the next watch interval

    def ok(self) -> None:
        """A round trip to the broker succeeded: it is up."""
        with self._lock:
            if self._down_since is not None:
                log.info("broker at %s answers again after %.1fs", self.bootstrap, self.clock() - self._down_since)
            self._down_since = None

    # -- decision --------------------------------------------------------------------------------
    @property
    def down(self) -> bool:
        """Whether the broker is currently suspected down (a failure with no success since)."""
        with self._lock:
            return self._down_since is not None

    def is_down(self) -> bool:
        """:attr:`down` as a :data:`BrokerDown`, to pass to what must know."""
        return self.down

    def check(self) -> None:
        """Raise :class:`BrokerLost` after the bound, :class:`MissingTopicError` for a deleted topic; never blocks."""
        with self._lock:
            since, reason, missing = self._down_since, self._reason, list(self._missing)
        if missing:
            raise MissingTopicError(self.bootstrap, self.job, missing, deleted=True)
        if since is not None and self.clock() - since >= self.timeout_s:
            raise BrokerLost(self.bootstrap, self.clock() - since, reason)

    def probe_once(self) -> None:
        """One probe: success clears the suspicion and records missing watched topics; failure suspects."""
        try:
            topics = self._probe()
        except BrokerUnreachable as exc:
            self.failed(exc.reason)
            return
        self.ok()
        gone = [t for t in self.watch if t not in topics]
        with self._lock:
            self._missing_streak = self._missing_streak + 1 if gone else 0
            self._missing = gone if self._missing_streak >= 2 else []

    def _probe(self) -> set[str]:
        if self._probe_fn is not None:
            return self._probe_fn()
        if self._admin is None:
            from batchline.kafka.client import make_admin

            self._admin = make_admin(self.kafka)
        return probe(self.kafka, min(self.kafka.probe_timeout_s, 2.0), admin=self._admin)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> BrokerLiveness:
        """Listen to the errors of every client of this bootstrap address and start probing."""
        with _detectors_lock:
            _detectors.setdefault(self.bootstrap, []).append(self)
        self._thread = threading.Thread(target=self._loop, name="broker-liveness", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        with _detectors_lock:
            if self in _detectors.get(self.bootstrap, []):
                _detectors[self.bootstrap].remove(self)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.probe_once()
            interval = SUSPECT_PROBE_INTERVAL_S if self.down else WATCH_PROBE_INTERVAL_S
            self._wake.wait(interval)
            self._wake.clear()
