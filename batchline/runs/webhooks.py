"""Sending webhooks at least once: the part shared by the API's batch deliveries (``batchline/api/deliveries.py``)
and the job config's run webhooks (``streams/webhooks.py``).

A delivery is one event for one endpoint, a :class:`DeliveryRecord` keyed by its ``webhook-id`` (the same on every
attempt) on a compacted topic its owner names. It is written ``pending`` before the first attempt and again after
each attempt (its count and next time), and ends ``delivered`` (a 2xx), ``failed`` (no 2xx within ``retry_for_s``)
or ``dropped`` (its endpoint is gone). A sender killed at any point resumes from the topic: an attempt whose outcome
was not written is made again, with the same ``webhook-id`` (receivers deduplicate by it).

:class:`Sender` holds the pending deliveries and makes the attempts on a thread pool, at most one per endpoint at a
time, so a slow or dead endpoint holds one thread and never delays another endpoint's deliveries. Retries back off
exponentially with jitter: ``retry_initial_s * 2**(attempts-1)``, at most ``retry_max_s``, each delay drawn between
half and all of it. Signatures: :mod:`batchline.runs.signing`.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import httpx
from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation
from pydantic import BaseModel, ConfigDict
from pydantic_settings import BaseSettings, SettingsConfigDict

from batchline.runs.signing import SigningSecret, signed_headers

log = logging.getLogger(__name__)
ERROR_TEXT = 200  # characters of an attempt's error kept on its record


class WebhookSettings(BaseSettings):
    """How deliveries are retried (environment, prefix ``BATCHLINE_WEBHOOK_``)."""

    model_config = SettingsConfigDict(env_prefix="BATCHLINE_WEBHOOK_", frozen=True)
    retry_initial_s: float = 5.0  # the first retry's delay (before jitter); each next one doubles
    retry_max_s: float = 3600.0  # the longest delay between two attempts
    retry_for_s: float = 72 * 3600.0  # a delivery without a 2xx this long after its event ends failed
    timeout_s: float = 10.0  # an attempt without an answer by then failed (and is retried)
    workers: int = 16  # attempts at once (one per endpoint at most)


class DeliveryRecord(BaseModel):
    """One event for one endpoint, keyed by its ``webhook-id``: ``pending`` until a 2xx (``delivered``), the retry
    window passed (``failed``) or its endpoint is gone (``dropped``)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    v: int = 1
    id: str
    endpoint_id: str
    tenant: str
    event_id: str
    event_type: str
    body: str
    created_at: float
    state: Literal["pending", "delivered", "failed", "dropped"] = "pending"
    attempts: int = 0
    next_at: float = 0.0
    last_status: int | None = None
    last_error: str | None = None
    ended_at: float | None = None


def webhook_id(event: str, endpoint_id: str) -> str:
    """The ``webhook-id`` of an event's delivery to an endpoint: derived, so planning it again finds it."""
    return "wh_" + hashlib.sha256(f"{event}/{endpoint_id}".encode()).hexdigest()[:24]


def backoff(settings: WebhookSettings, attempts: int, rng: random.Random) -> float:
    """Seconds before the next attempt after ``attempts`` failed ones: exponential, capped, with jitter."""
    delay = min(settings.retry_max_s, settings.retry_initial_s * 2 ** max(0, attempts - 1))
    return delay * rng.uniform(0.5, 1.0)


Target = tuple[str, list[SigningSecret]]  # where a delivery goes (its endpoint's URL) and the secrets it signs with
Resolve = Callable[[DeliveryRecord], Target | None]  # None: the endpoint is gone


class Sender:
    """The pending deliveries of one owner and their attempts. Called from the owner's one thread (``load``,
    ``plan``, ``round``); the pool's threads only make HTTP requests and hand back their outcome."""

    def __init__(self, write: Callable[[DeliveryRecord], None], settings: WebhookSettings | None = None) -> None:
        """``write``: puts a delivery record on the owner's topic and waits for it (raises if it cannot)."""
        self.write = write
        self.settings = settings or WebhookSettings()
        self.pending: dict[str, DeliveryRecord] = {}
        self.known: set[str] = set()  # webhook ids planned (in any state)
        self.oldest_pending: float | None = None  # replaced each round: read by the metrics thread
        self.active = False  # set by the owner: only the active one reports an age
        self._busy: dict[str, tuple[str, Future[tuple[int | None, str | None]]]] = {}  # endpoint -> (delivery, attempt)
        self._rng = random.Random()
        self._pool = ThreadPoolExecutor(self.settings.workers, thread_name_prefix="webhook")
        self._http = httpx.Client(timeout=self.settings.timeout_s)
        meter = metrics.get_meter("batchline.webhooks")
        self.ended = meter.create_counter("batchline_webhook_deliveries", description="Deliveries ended, by outcome")
        self.attempts = meter.create_counter("batchline_webhook_attempts", description="Attempts, by result")

        def oldest(_: CallbackOptions) -> list[Observation]:
            since = self.oldest_pending
            return [Observation(time.time() - since if since is not None and self.active else 0.0)]

        meter.create_observable_gauge(
            "batchline_webhook_oldest_undelivered_seconds",
            [oldest],
            description="Age of the oldest delivery without a 2xx yet (0 when none, or on a process standing by)",
        )

    def load(self, records: Iterable[DeliveryRecord]) -> None:
        """What the owner's topic holds: the deliveries planned, and those still pending."""
        records = list(records)
        self.known = {d.id for d in records}
        self.pending = {d.id: d for d in records if d.state == "pending"}

    def plan(self, delivery: DeliveryRecord) -> None:
        """A new delivery (ignored when its webhook id was planned before): written, then attempted."""
        if delivery.id in self.known:
            return
        self.write(delivery)
        self.known.add(delivery.id)
        self.pending[delivery.id] = delivery

    def round(self, resolve: Resolve) -> None:
        """Record the attempts that ended, start those due (``resolve`` says where each goes)."""
        self._collect()
        now = time.time()
        for delivery in sorted(self.pending.values(), key=lambda d: d.next_at):
            if delivery.next_at > now or delivery.endpoint_id in self._busy:
                continue
            target = resolve(delivery)
            if target is None:
                self._end(delivery, "dropped", last_error="the endpoint was deleted")
                continue
            url, secrets = target
            headers = signed_headers(secrets, delivery.id, int(now), delivery.body.encode())
            future = self._pool.submit(self._attempt, url, delivery.body.encode(), headers)
            self._busy[delivery.endpoint_id] = (delivery.id, future)
        self.oldest_pending = min((d.created_at for d in self.pending.values()), default=None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def _attempt(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[int | None, str | None]:
        """One POST (on a pool thread): the status it answered, or why there was none."""
        try:
            return self._http.post(url, content=body, headers=headers).status_code, None
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"[:ERROR_TEXT]

    def _collect(self) -> None:
        for endpoint_id, (delivery_id, future) in list(self._busy.items()):
            if not future.done():
                continue
            del self._busy[endpoint_id]
            delivery = self.pending.get(delivery_id)
            if delivery is None:
                continue
            status, error = future.result()
            self.attempts.add(1, {"result": f"{status // 100}xx" if status else "error"})
            attempts = delivery.attempts + 1
            if status is not None and 200 <= status < 300:
                self._end(delivery, "delivered", attempts=attempts, last_status=status)
            elif time.time() - delivery.created_at >= self.settings.retry_for_s:
                self._end(delivery, "failed", attempts=attempts, last_status=status, last_error=error)
            else:
                again = time.time() + backoff(self.settings, attempts, self._rng)
                update = {"attempts": attempts, "next_at": again, "last_status": status, "last_error": error}
                self.write(delivery := delivery.model_copy(update=update))
                self.pending[delivery.id] = delivery
                log.info("webhook %s to %s: attempt %d answered %s; next in %.1fs", delivery.id,
                         endpoint_id, attempts, status or error, again - time.time())  # fmt: skip

    def _end(self, delivery: DeliveryRecord, state: str, **update: object) -> None:
        ended = delivery.model_copy(update={"state": state, "ended_at": time.time(), **update})
        self.write(ended)
        self.pending.pop(delivery.id, None)
        self.ended.add(1, {"outcome": state})
        log.info("webhook %s (%s) to %s: %s after %d attempts", ended.id, ended.event_type, ended.endpoint_id,
                 state, ended.attempts)  # fmt: skip
