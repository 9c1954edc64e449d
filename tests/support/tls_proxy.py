"""A TLS terminator in front of the embedded broker, as a load balancer or Kafka's own SSL listener would be.

Clients speak TLS to the proxy (mutual TLS when ``require_client_cert``); the proxy speaks plain Kafka protocol
to the broker. The broker advertises the proxy's port, so every connection a client makes after bootstrap goes
through TLS too. Threads in the test process: one accepts, one per connection copies both ways (one thread
owns each TLS session: OpenSSL objects must not be shared between threads). Each refused handshake is recorded.
"""

from __future__ import annotations

import selectors
import socket
import ssl
import threading
from types import TracebackType

from tests.support.pki import Pki

HANDSHAKE_TIMEOUT_S = 10.0
IO_TIMEOUT_S = 30.0
TICK_S = 0.2  # how often idle threads look at the stop flag
JOIN_TIMEOUT_S = 10.0
CHUNK = 1 << 16


class TlsProxy:
    def __init__(self, port: int, upstream_port: int, pki: Pki, require_client_cert: bool) -> None:
        self.port = port
        self.upstream_port = upstream_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(pki.server_cert, pki.server_key)
        if require_client_cert:
            self.context.load_verify_locations(cafile=pki.ca)
            self.context.verify_mode = ssl.CERT_REQUIRED
        self.accepted = 0  # TLS sessions established
        self.client_subjects: set[str] = set()  # CNs of the client certificates presented
        self.refused: list[str] = []  # why each handshake the proxy refused failed
        self.aborted: list[str] = []  # handshakes the client gave up
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TlsProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(TICK_S)
        self._listener = listener
        self._spawn(self._accept_loop, "tls-proxy-accept")
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in list(self._threads):
            thread.join(JOIN_TIMEOUT_S)
        if self._listener is not None:
            self._listener.close()

    def _spawn(self, target: object, name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            self._spawn(self._serve, "tls-proxy-conn", conn)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        tls = self.context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        try:
            tls.do_handshake()
        except (ssl.SSLEOFError, ConnectionError, TimeoutError) as exc:
            with self._lock:  # the client went away mid-handshake (a process exiting): not a refusal
                self.aborted.append(f"{type(exc).__name__}: {exc}")
            tls.close()
            return
        except (ssl.SSLError, OSError) as exc:
            with self._lock:
                self.refused.append(f"{type(exc).__name__}: {exc}")
            tls.close()
            return
        with self._lock:
            self.accepted += 1
            peer = tls.getpeercert()
            if peer:
                self.client_subjects.update(v for rdn in peer["subject"] for k, v in rdn if k == "commonName")
        try:
            with tls, socket.create_connection(("127.0.0.1", self.upstream_port), IO_TIMEOUT_S) as upstream:
                tls.settimeout(IO_TIMEOUT_S)
                self._copy(tls, upstream)
        except OSError:
            pass  # either side went away: the connection ends, as it would behind a real terminator

    def _copy(self, tls: ssl.SSLSocket, upstream: socket.socket) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(tls, selectors.EVENT_READ)
            selector.register(upstream, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in selector.select(TICK_S):
                    if key.fileobj is tls:
                        data = tls.recv(CHUNK)
                        while data and tls.pending():
                            data += tls.recv(tls.pending())
                        target: socket.socket = upstream
                    else:
                        data, target = upstream.recv(CHUNK), tls
                    if not data:
                        return
                    target.sendall(data)

    def __enter__(self) -> TlsProxy:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
