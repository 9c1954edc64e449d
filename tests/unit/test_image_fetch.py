"""Remote images a job allows (``[images.fetch]``), against a real HTTP server on 127.0.0.1 (the standard library's,
in threads): each answer ends as what docs/requests.md#remote-images says (bytes checked like a data URL's, a named
``invalid_input``, or a ``transient`` failure for the retry tiers); a URL outside the allowed prefixes is refused
by name and never asked for; the fetch runs off the calling thread and a record waiting on it holds its batch."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, Message

from batchline.config import ImageFetchConfig
from batchline.exceptions import ConfigError
from consumers.batcher import Batcher
from consumers.fetch import ImageFetcher
from consumers.intake import Intake, image_limits
from consumers.work import Failure
from tests.support.image_server import ImageServer, image_server
from tests.support.images import chat, png
from tests.unit.helpers import config

FIELD = "messages[0].content[1].image_url.url"
MAX_IMAGE_BYTES = 100_000
WAIT_S = 20.0


@pytest.fixture
def server() -> Any:
    with image_server({"red.png": png("red"), "blue.png": png("blue")}) as running:
        yield running


def _config(server: ImageServer, timeout_s: float = 5.0) -> Any:
    return config(
        **{
            "images.fetch.allow": [f"{server.base}/img/"],
            "images.fetch.timeout_s": timeout_s,
            "limits.max_image_bytes": MAX_IMAGE_BYTES,
        }
    )


def _fetcher(server: ImageServer, timeout_s: float = 5.0, wake: Any = lambda: None) -> ImageFetcher:
    cfg = _config(server, timeout_s)
    return ImageFetcher(cfg.images.fetch, image_limits(cfg), wake)


def _failure(got: Any) -> Failure:
    assert isinstance(got, Failure), got
    assert got.message.startswith(f"{FIELD}: "), got.message
    return got


def test_an_allowed_image_is_fetched_and_checked(server: ImageServer) -> None:
    assert _fetcher(server).fetch(FIELD, server.url("/img/red.png")) == ("image/png", png("red"))


@pytest.mark.parametrize(
    ("path", "failure_class", "error_type", "says"),
    [
        ("/img/missing.png", "invalid_input", "ImageFetchFailed", "answered 404"),
        ("/img/moved.png", "invalid_input", "ImageFetchFailed", "redirects are not followed"),
        ("/img/page.png", "invalid_input", "UnsupportedMediaType", "'text/html'"),
        ("/img/endless.png", "invalid_input", "ImageTooLarge", f"> limits.max_image_bytes {MAX_IMAGE_BYTES}"),
        ("/img/boom.png", "transient", "ImageFetchFailed", "answered 500"),
        ("/img/stall.png", "transient", "ImageFetchFailed", "timed out"),
        ("/img/short.png", "transient", "ImageFetchFailed", "IncompleteRead"),
        ("/img/a b.png", "invalid_input", "InvalidImageURL", "cannot GET"),
    ],
)
def test_each_failed_fetch_ends_as_its_class_naming_the_part(
    server: ImageServer, path: str, failure_class: str, error_type: str, says: str
) -> None:
    got = _failure(_fetcher(server, timeout_s=1.0).fetch(FIELD, server.url(path)))
    assert (got.failure_class, got.error_type) == (failure_class, error_type), got
    assert says in got.message, got.message


def test_a_body_over_the_limit_is_cut_off_as_it_streams(server: ImageServer) -> None:
    """The endless body would be 128 MB: the fetch stops reading just past the limit, not at the end."""
    got = _failure(_fetcher(server).fetch(FIELD, server.url("/img/endless.png")))
    read = int(got.message.split(": ", 1)[1].split(" ", 1)[0])
    assert MAX_IMAGE_BYTES < read <= MAX_IMAGE_BYTES + (64 << 10) + 8, got.message


def test_a_refused_connection_is_transient(server: ImageServer) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: nothing listens there
    cfg = config(**{"images.fetch.allow": [f"http://127.0.0.1:{port}/"]})
    got = _failure(
        ImageFetcher(cfg.images.fetch, image_limits(cfg), lambda: None).fetch(FIELD, f"http://127.0.0.1:{port}/a.png")
    )
    assert (got.failure_class, got.error_type) == ("transient", "ImageFetchFailed"), got


def _admit(cfg: Any, fetcher: ImageFetcher | None, url: str) -> Any:
    payload = json.dumps({"id": "r-1", "messages": chat(url)}).encode()
    msg = Message(topic="unit.requests", partition=0, offset=5, key=b"k", value=payload,
                  timestamp=(TIMESTAMP_CREATE_TIME, 1))  # fmt: skip
    intake = Intake(cfg, lambda text: len(text.split()), None, fetcher)
    item = intake.admit(msg)
    intake.start_fetch(item)
    return item


def test_a_url_outside_the_allowed_prefixes_is_refused_by_name_and_never_asked_for(server: ImageServer) -> None:
    cfg = _config(server)
    fetcher = ImageFetcher(cfg.images.fetch, image_limits(cfg), lambda: None)
    outside = [server.url("/private/red.png"), server.url("/img/../private/red.png"), "https://example.com/img/a.png"]
    for url in outside:
        item = _admit(cfg, fetcher, url)
        assert item.failure is not None and item.failure.error_type == "RemoteImage", (url, item.failure)
        assert item.failure.message.startswith(
            f"{FIELD}: remote image URLs are fetched only from the prefixes of the job's images.fetch.allow"
        )
        assert item.fetching is None
    assert server.asked == []
    # with no fetch allowed (the default), every remote URL is refused by name
    refused = _admit(config(), None, server.url("/img/red.png"))
    assert refused.failure is not None and refused.failure.error_type == "RemoteImage"


def test_intake_starts_the_fetch_off_its_thread_and_the_batcher_holds_the_record_until_it_ends(
    server: ImageServer,
) -> None:
    cfg = _config(server, timeout_s=10.0)
    woken = threading.Event()
    fetcher = ImageFetcher(cfg.images.fetch, image_limits(cfg), woken.set)
    stalled = _admit(cfg, fetcher, server.url("/img/stall.png"))  # returns at once: the server is stalling
    assert stalled.failure is None and stalled.waiting
    batcher = Batcher(cfg.batching.model_copy(update={"linger_ms": 0}))
    batcher.extend([stalled])
    assert batcher.waiting() and not batcher.ready() and batcher.take(force=True) == []
    server.release.set()
    assert woken.wait(WAIT_S), "the fetch's end wakes the loop"
    assert not batcher.waiting() and batcher.ready()
    assert batcher.take() == [stalled]
    assert stalled.fetching is not None
    messages = stalled.fetching.result()
    part = messages[0].parts[1]
    assert (part.type, part.media_type, part.data) == ("image", "image/png", png("red"))
    fetcher.close()


@pytest.mark.parametrize(
    "prefix",
    ["http://images.example.com", "ftp://images.example.com/", "https://user@images.example.com/", "/img/"],
)
def test_a_prefix_must_name_a_scheme_a_host_and_a_path(prefix: str) -> None:
    with pytest.raises(ConfigError, match=r"images\.fetch\.allow"):
        config(**{"images.fetch.allow": [prefix]})


def test_fetching_is_off_by_default() -> None:
    assert ImageFetchConfig().allow == ()
    assert config().images.fetch.allow == ()


def test_the_batch_api_takes_a_remote_image_only_where_the_models_job_fetches_it() -> None:
    """The API's line validation answers as the job's workers would: a remote URL under the job's prefixes is
    carried to the worker (which fetches it), any other fails its line by name at once."""
    from batchline.api.settings import ModelRoute
    from batchline.api.validate import validate
    from tests.support.bodies import CHAT, RESPONSES, base_body, line

    allowing = config(**{"images.fetch.allow": ["https://images.example.com/scans/"]})
    routes = {"m": ModelRoute.of("m", allowing), "plain": ModelRoute.of("plain", config())}
    ok, outside = "https://images.example.com/scans/a.png", "https://images.example.com/other/a.png"

    def chat_line(rid: str, model: str, url: str) -> bytes:
        return line(rid, CHAT, base_body(CHAT, model) | {"messages": chat(url)})

    def responses_line(rid: str, model: str, url: str) -> bytes:
        content = [{"type": "input_text", "text": "what?"}, {"type": "input_image", "image_url": url}]
        return line(rid, RESPONSES, base_body(RESPONSES, model) | {"input": [{"role": "user", "content": content}]})

    checked = validate(enumerate([chat_line("a", "m", ok), chat_line("b", "m", outside)], 1), CHAT, routes)
    assert [(e.line, e.code, e.param) for e in checked.errors] == [
        (2, "unsupported_parameter", "body.messages[0].content[1].image_url.url")
    ]
    assert "images.fetch.allow" in checked.errors[0].message
    plain = validate(enumerate([chat_line("a", "plain", ok)], 1), CHAT, routes)
    assert [(e.code, e.param) for e in plain.errors] == [
        ("unsupported_parameter", "body.messages[0].content[1].image_url.url")
    ]
    answers = validate(
        enumerate([responses_line("a", "m", ok), responses_line("b", "m", outside)], 1), RESPONSES, routes
    )
    assert [(e.line, e.param) for e in answers.errors] == [(2, "body.input[0].content[1].image_url")]


def test_a_fetch_that_raised_fails_its_record_as_transient_and_the_engine_thread_goes_on() -> None:
    from concurrent.futures import Future

    from consumers.fetch import fetch_result

    raised: Future[Any] = Future()
    raised.set_exception(RuntimeError("a bug"))
    cancelled: Future[Any] = Future()
    cancelled.cancel()
    for future in (raised, cancelled):
        got = fetch_result(future)
        assert isinstance(got, Failure) and (got.failure_class, got.error_type) == ("transient", "ImageFetchFailed")
