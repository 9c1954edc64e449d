"""A local HTTP server of images for the fetch tests (``images.fetch``), on 127.0.0.1 in threads of the test
process: good images, a 404, a 500, a redirect, a body that is not an image, one that streams past any limit
without a Content-Length, and one that stalls until the test lets it go. It records every path asked for."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.images import png

STALL_CAP_S = 30.0  # a stalled answer is let go at the latest after this (the test's end lets it go sooner)


class ImageServer:
    def __init__(self, server: ThreadingHTTPServer, release: threading.Event) -> None:
        self.server = server
        self.release = release
        self.asked: list[str] = []

    @property
    def base(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def url(self, path: str) -> str:
        return f"{self.base}{path}"


def _handler(images: dict[str, bytes], state: dict[str, Any]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            state["asked"].append(self.path)
            name = self.path.rsplit("/", 1)[-1]
            if name in images:
                self._send(200, "image/png", images[name])
            elif name == "boom.png":
                self._send(500, "text/plain", b"server error")
            elif name == "moved.png":
                self.send_response(302)
                self.send_header("Location", "/img/red.png")
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif name == "short.png":  # the connection closes 10 bytes into a body of 5,000
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", "5000")
                self.end_headers()
                self.wfile.write(png("red")[:10])
                self.close_connection = True
            elif name == "page.png":
                self._send(200, "text/html", b"<html>not an image</html>")
            elif name == "endless.png":  # no Content-Length: only reading tells the size
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                chunk = b"\x89PNG" + b"\0" * (64 << 10)
                try:
                    for _ in range(2000):  # 128 MB at most, were it read to the end
                        self.wfile.write(chunk)
                except OSError:  # the worker hung up at its limit
                    return
            elif name == "stall.png":
                state["release"].wait(STALL_CAP_S)
                self._send(200, "image/png", png("red"))
            else:
                self._send(404, "text/plain", b"not found")

        def _send(self, status: int, media_type: str, body: bytes) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", media_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:  # the client gave up (a timeout)
                pass

    return Handler


@contextmanager
def image_server(images: dict[str, bytes]) -> Iterator[ImageServer]:
    """Serve ``images`` (name -> PNG bytes) under any path ending in the name, and the special names above."""
    release = threading.Event()
    state: dict[str, Any] = {"asked": [], "release": release}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(images, state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="image-server", daemon=True)
    thread.start()
    shown = ImageServer(server, release)
    shown.asked = state["asked"]
    try:
        yield shown
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)
