"""Remote images a job allows (``[images.fetch]``): fetched before their record reaches the engine, never on the
worker's loop thread.

Where and on which thread: ``Intake.start_fetch`` (the loop thread, once the record is admitted and known to run
on this worker) starts a record's fetches on this module's own pool of ``images.fetch.concurrency`` threads and
returns at once; the record waits in the batcher, which hands no batch
past a record whose fetches are not done (``Batcher.take_counted``), and each finished fetch wakes the loop. The
engine thread (``Feeder._admit``) reads the finished result: the record's messages with each fetched image as
bytes (as an Avro record carries them, so the engines never see the URL), or the failure that ends it. A slow
server costs its own record's place in the order of commits, never the loop's polling nor the engine's running
batch.

What a fetch may do: GET the URL directly (no proxy from the environment, no redirect followed: a redirect could
leave the allowed prefixes), read at most ``limits.max_image_bytes`` as the body streams (a larger body is cut off,
not read to its end), all within ``images.fetch.timeout_s``. Failure classes (docs/architecture.md's table): a 4xx
answer (but 408 and 429), a redirect, a body over the limit, one that is not an image of the accepted types, or one
that does not decode ends the record as ``invalid_input`` naming the part; a timeout, a 5xx, 408 or 429 answer or a
connection that fails is ``transient`` (the retry tiers try again later).
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from batchline.config import ImageFetchConfig
from consumers.work import Failure
from schemas.images import ImageLimits, fetched_problem, remote_parts
from schemas.models import ContentPart

log = logging.getLogger(__name__)
CHUNK = 64 << 10
TRANSIENT_STATUS = (408, 429)
Fetched = tuple[Any, ...] | Failure  # the messages, each fetched image as bytes; or why the record ends


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any) -> None:
        return None  # urllib then raises the 3xx as an HTTPError


class ImageFetcher:
    """Owns the fetch threads. ``start`` (loop thread) returns a future per record with images to fetch; its
    result is read on the engine thread once done. ``wake`` is called as each record's fetches end."""

    def __init__(self, config: ImageFetchConfig, limits: ImageLimits, wake: Any) -> None:
        self.limits = limits
        self.timeout_s = config.timeout_s
        self.wake = wake
        self._pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="image-fetch")
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())
        self._closed = threading.Event()

    def start(self, messages: Sequence[Any]) -> Future[Fetched] | None:
        """The fetch of ``messages``' allowed remote images, begun; None when it has none."""
        parts = remote_parts(messages, self.limits)
        if not parts or self._closed.is_set():
            return None
        future = self._pool.submit(self._fetch_all, tuple(messages), parts)
        future.add_done_callback(lambda _: self.wake())
        return future

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _fetch_all(self, messages: tuple[Any, ...], parts: list[tuple[str, Any]]) -> Fetched:
        fetched: dict[int, ContentPart] = {}
        for path, part in parts:
            got = self.fetch(f"{path}.image_url.url", str(part.url))
            if isinstance(got, Failure):
                return got
            media_type, data = got
            fetched[id(part)] = ContentPart(type="image", data=data, media_type=media_type, detail=part.detail)
        return tuple(
            message.model_copy(update={"parts": [fetched.get(id(p), p) for p in message.parts]})
            if message.parts and any(id(p) in fetched for p in message.parts)
            else message
            for message in messages
        )

    def fetch(self, field: str, url: str) -> tuple[str, bytes] | Failure:
        """``(media type, bytes)`` of the image at ``url``, checked as a data URL's would be; or the failure."""
        deadline = time.monotonic() + self.timeout_s
        limit = self.limits.max_bytes
        request = urllib.request.Request(url, headers={"User-Agent": "batchline", "Accept": "image/*"})
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                declared = response.headers.get_content_type()
                length = response.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > limit:
                    return _too_large(field, f"{length} bytes (Content-Length)", limit)
                body = bytearray()
                while chunk := response.read1(CHUNK):
                    body += chunk
                    if len(body) > limit:  # cut off: the rest is never read
                        return _too_large(field, f"{len(body)} bytes and more (streamed)", limit)
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the body took over {self.timeout_s:g}s")
                if length is not None and length.isdigit() and len(body) < int(length):  # read1 does not raise it
                    raise http.client.IncompleteRead(bytes(body), int(length) - len(body))
        except urllib.error.HTTPError as exc:
            transient = exc.code >= 500 or exc.code in TRANSIENT_STATUS
            why = f"GET {url} answered {exc.code} {exc.reason}"
            if exc.code < 400:
                why += " (redirects are not followed)"
            return Failure("transient" if transient else "invalid_input", "ImageFetchFailed", f"{field}: {why}")
        except (ValueError, http.client.InvalidURL) as exc:  # a URL urllib cannot ask for
            return Failure("invalid_input", "InvalidImageURL", f"{field}: cannot GET {url!r}: {exc}"[:500])
        except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as exc:
            # refused, reset, timed out, or a body cut short (IncompleteRead): the server may do better later
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else repr(exc)
            return Failure("transient", "ImageFetchFailed", f"{field}: GET {url} failed: {reason}"[:500])
        problem = fetched_problem(field, declared, bytes(body), self.limits)
        if problem is not None:
            return Failure("invalid_input", problem.error_type, problem.message)
        return declared, bytes(body)


def fetch_result(future: Future[Fetched]) -> Fetched:
    """A finished fetch's result (engine thread). A fetch that raised instead (a bug) or was cancelled fails its
    record as ``transient``, logged: the worker goes on."""
    try:
        return future.result(timeout=0)
    except Exception as exc:
        log.exception("an image fetch raised")
        return Failure("transient", "ImageFetchFailed", f"the image fetch failed: {exc!r}"[:500])


def _too_large(field: str, size: str, limit: int) -> Failure:
    return Failure("invalid_input", "ImageTooLarge", f"{field}: {size} > limits.max_image_bytes {limit}")
