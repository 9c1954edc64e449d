"""A userspace TCP fault proxy between Kafka clients and the broker: latency, connection resets, a blackhole.

The kernel here has no ``netem``, so a slow or lossy link is made in the test process: :class:`FaultProxy` relays
bytes both ways (an asyncio loop on a thread of its own) and, on demand,

- delays every chunk by ``latency_s`` in each direction, pipelined and in order (a long link, not a slow one);
- :meth:`reset_all` closes every open connection with a TCP RST on both sides (SO_LINGER 0);
- :meth:`blackhole`: new connections are accepted and never answered (what they send is read and dropped), and
  the open ones stop moving bytes, which wait in the proxy - the link is gone, TCP does not notice. When the
  blackhole is lifted, the held bytes flow on and the never-answered connections are closed.

The broker must advertise the proxy (tansu's ``--advertised-listener-url``, :class:`EmbeddedBroker`'s
``advertised``): every connection a client makes after bootstrap then goes through it too. Frame-aware proxies
build on it (:meth:`FaultProxy.client_frame`: tests/integration/size_limit_proxy.py answers some requests itself;
:meth:`FaultProxy.hold` keeps one back: tests/integration/test_takeover.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType

from batchline.kafka.broker import free_port

READY_TIMEOUT_S = 15.0
CHUNK = 1 << 16


@dataclass(eq=False)
class _Link:
    """One client connection and its upstream: the writers to close, the tasks to cancel."""

    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class FaultProxy:
    def __init__(self, upstream_port: int, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host, self.port, self.upstream_port = host, port or free_port(), upstream_port
        self.latency_s = 0.0
        self.accepted = 0  # connections accepted
        self.resets = 0  # connections reset by reset_all()
        self.unanswered = 0  # connections accepted inside a blackhole
        self._open = threading.Event()  # set while bytes may move (no blackhole)
        self._open.set()
        self._links: set[_Link] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- faults (any thread) ---------------------------------------------------------------------------
    def blackhole(self, on: bool) -> None:
        if on:
            self._open.clear()
        else:
            self._open.set()

    def reset_all(self) -> int:
        """Reset every open connection (RST to the client and to the broker); how many there were."""
        return int(asyncio.run_coroutine_threadsafe(self._reset_all(), self._loop).result(READY_TIMEOUT_S))

    # -- frames ----------------------------------------------------------------------------------------
    def client_frame(self, frame: bytes) -> bytes | None:
        """A reply to send the client instead of passing ``frame`` (a request without its size prefix) on; None
        passes it. Here: always None. Only called when a subclass sets ``frames``."""
        return None

    async def hold(self, frame: bytes) -> None:
        """Awaited before ``frame`` (a request without its size prefix) is passed on: a subclass may keep it back
        (a request held in the network) while the link's other connections go on. Here: returns at once."""

    def passed_frame(self, frame: bytes) -> None:
        """Called once ``frame`` (a request without its size prefix) was written to the broker, before the next
        one is read: a fault may start here, with the request delivered and its response not yet. Here: nothing."""

    frames = False  # read the client's stream as Kafka frames (client_frame, passed_frame) rather than as bytes

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        serve = asyncio.start_server(self._serve, self.host, self.port)
        self._server = asyncio.run_coroutine_threadsafe(serve, self._loop).result(READY_TIMEOUT_S)
        return self

    def stop(self) -> None:
        self._open.set()

        async def shutdown() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(READY_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # -- the relay (the loop's thread) -----------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        link = _Link(writer)
        self._links.add(link)
        try:
            if not self._open.is_set():  # accepted, never answered: what the client sends is dropped
                self.unanswered += 1
                drain = asyncio.ensure_future(self._drop(reader))
                while not self._open.is_set():
                    await asyncio.sleep(0.05)
                drain.cancel()
                return
            up_reader, link.upstream = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            lock = asyncio.Lock()  # replies of the broker and of client_frame share the client's stream
            to_client = self._pipe(up_reader, writer, lock)
            to_broker = self._frames(reader, link.upstream, writer, lock) if self.frames else None
            link.tasks = [
                asyncio.ensure_future(to_client),
                asyncio.ensure_future(to_broker or self._pipe(reader, link.upstream, None)),
            ]
            await asyncio.wait(link.tasks, return_when=asyncio.FIRST_COMPLETED)
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            for task in link.tasks:
                task.cancel()
            self._links.discard(link)
            _close(writer)
            if link.upstream is not None:
                _close(link.upstream)

    async def _drop(self, reader: asyncio.StreamReader) -> None:
        while await reader.read(CHUNK):
            pass

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, lock: asyncio.Lock | None) -> None:
        """Bytes from ``src`` to ``dst``, each chunk ``latency_s`` later, in order, held while in a blackhole."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                await self._when_open(due)
                if lock is None:
                    dst.write(data)
                    await dst.drain()
                else:
                    async with lock:
                        dst.write(data)
                        await dst.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await src.read(CHUNK):
                queue.put_nowait((time.monotonic() + self.latency_s, data))
            while not queue.empty() and not sender.done():  # end of stream: what was read still goes out
                await asyncio.sleep(0.01)
        finally:
            sender.cancel()

    async def _frames(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, client: asyncio.StreamWriter, lock: asyncio.Lock
    ) -> None:
        """The client's requests frame by frame: each passed on, or answered by :meth:`client_frame`."""
        while True:
            size = struct.unpack(">i", await src.readexactly(4))[0]
            frame = await src.readexactly(size)
            reply = self.client_frame(frame)
            await self._when_open(time.monotonic() + self.latency_s)
            if reply is None:
                await self.hold(frame)
                dst.write(struct.pack(">i", size) + frame)
                await dst.drain()
                self.passed_frame(frame)
            else:
                async with lock:
                    client.write(reply)
                    await client.drain()

    async def _when_open(self, due: float) -> None:
        while True:
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if self._open.is_set():
                return
            await asyncio.sleep(0.05)

    async def _reset_all(self) -> int:
        links = list(self._links)
        for link in links:
            for writer in (link.client, link.upstream):
                if writer is not None:
                    _rst(writer)
            for task in link.tasks:
                task.cancel()
        self.resets += len(links)
        return len(links)


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError, RuntimeError):
        writer.close()


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST rather than a FIN: the peer sees 'connection reset'."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    _close(writer)
