"""OpenTelemetry for batchline: spans to the messaging conventions, metrics, and the health a cluster acts on.

- :func:`setup_telemetry`: the process's tracer and meter providers and their exporters (``setup``).
- :class:`WorkerMetrics` (``metrics``), :func:`watch_streams` (``streams_metrics``): the instruments, names in the
  table in docs/operations.md ("Metrics and probes"); ``feeds`` holds the observable instruments they share, ``lag``
  reads consumer lag; :func:`watch_threads` observes the process's Python threads.
- :class:`Health`: liveness and readiness (``health``); :func:`serve_probes`: ``/metrics``, ``/healthz`` and
  ``/readyz`` on ``--metrics-port`` (``server``).
- :func:`link_from_traceparent`, :func:`traceparent_of`: W3C trace context in Kafka headers (``traces``).
"""

from batchline.telemetry.feeds import watch_threads
from batchline.telemetry.health import Health
from batchline.telemetry.metrics import WorkerMetrics
from batchline.telemetry.server import serve_probes
from batchline.telemetry.setup import setup_telemetry
from batchline.telemetry.streams_metrics import StreamsMetrics, watch_streams
from batchline.telemetry.traces import link_from_traceparent, traceparent_of

__all__ = [
    "Health",
    "StreamsMetrics",
    "WorkerMetrics",
    "link_from_traceparent",
    "serve_probes",
    "setup_telemetry",
    "traceparent_of",
    "watch_streams",
    "watch_threads",
]
