"""OpenTelemetry for batchline: spans to the messaging conventions, the worker's metrics."""

from batchline.telemetry.setup import WorkerMetrics, link_from_traceparent, setup_telemetry, traceparent_of

__all__ = ["WorkerMetrics", "link_from_traceparent", "setup_telemetry", "traceparent_of"]
