"""A webhook receiver on 127.0.0.1 (the standard library's HTTP server): it records every request it gets and answers
each path as the test scripts it (a list of statuses to answer in turn, then 200; or a gate to wait on)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

GATE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Delivery:
    path: str
    headers: dict[str, str]
    body: bytes
    answered: int


@dataclass
class Receiver:
    """``script[path]``: statuses answered in turn (then 200); ``gates[path]``: set before a request there answers."""

    script: dict[str, list[int]] = field(default_factory=dict)
    gates: dict[str, threading.Event] = field(default_factory=dict)
    got: list[Delivery] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None

    def url(self, path: str) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def at(self, path: str) -> list[Delivery]:
        with self.lock:
            return [d for d in self.got if d.path == path]

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                gate = receiver.gates.get(self.path)
                if gate is not None:
                    gate.wait(GATE_TIMEOUT_S)
                with receiver.lock:
                    queue = receiver.script.get(self.path, [])
                    status = queue.pop(0) if queue else 200
                    receiver.got.append(Delivery(self.path, {k.lower(): v for k, v in self.headers.items()}, body,
                                                 status))  # fmt: skip
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, name="receiver", daemon=True).start()
        return self

    def stop(self) -> None:
        for gate in self.gates.values():
            gate.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
