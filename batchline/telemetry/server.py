"""The probe and scrape port: ``/metrics`` (Prometheus text), ``/healthz`` and ``/readyz``.

``/metrics`` is what OpenTelemetry's Prometheus exporter (``PrometheusMetricReader``) collects into
:data:`batchline.telemetry.setup.PROMETHEUS_REGISTRY`, rendered by ``prometheus_client``; the probes answer 200 or
503 with the reason in the body. A small threaded ``http.server`` on a daemon thread: it dies with the process.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from batchline.exceptions import ConfigError
from batchline.telemetry.health import Health, Verdict
from batchline.telemetry.setup import PROMETHEUS_REGISTRY

log = logging.getLogger(__name__)
METRICS_PATH = "/metrics"
HEALTH_PATH = "/healthz"
READY_PATH = "/readyz"
DEFAULT_HOST = "0.0.0.0"  # probes come from the kubelet, scrapes from Prometheus: not only from localhost


class ProbeServer:
    """Serves ``/metrics``, ``/healthz`` and ``/readyz`` until :meth:`stop`."""

    def __init__(self, port: int, health: Health, host: str = DEFAULT_HOST, registry: CollectorRegistry | None = None):
        handler = _handler(health, registry or PROMETHEUS_REGISTRY)
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror})") from None
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="probe-server", daemon=True)

    def start(self) -> ProbeServer:
        self._thread.start()
        log.info("serving %s, %s and %s on port %d", METRICS_PATH, HEALTH_PATH, READY_PATH, self.port)
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_probes(port: int | None, health: Health, host: str = DEFAULT_HOST) -> ProbeServer | None:
    """Start the probe server on ``port`` (``--metrics-port``); None when no port is given."""
    return None if port is None else ProbeServer(port, health, host).start()


def _handler(health: Health, registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == METRICS_PATH:
                try:
                    body = generate_latest(registry)
                except Exception as exc:  # e.g. the SDK's collection timeout: one line, not a dropped connection
                    log.warning("metrics collection failed: %s", exc)
                    self._send(500, f"metrics collection failed: {exc}\n".encode(), "text/plain; charset=utf-8")
                    return
                self._send(200, body, CONTENT_TYPE_LATEST)
            elif path == HEALTH_PATH:
                self._verdict(health.live())
            elif path == READY_PATH:
                self._verdict(health.ready())
            else:
                self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain; charset=utf-8")

        def _verdict(self, verdict: Verdict) -> None:
            self._send(200 if verdict.ok else 503, f"{verdict.reason}\n".encode(), "text/plain; charset=utf-8")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: not for the log
            log.debug("%s %s", self.address_string(), format % args)

    return Handler
