"""Process-wide OpenTelemetry set-up: a tracer provider and a meter provider with the configured exporters.

Spans: ``none`` (default: spans are not recorded; their contexts still propagate, flagged not sampled),
``console`` or ``otlp`` (OTLP/HTTP to ``telemetry.otlp_endpoint``). Metrics: collected for ``/metrics`` by
OpenTelemetry's Prometheus exporter when the process serves a metrics port, and pushed over OTLP/HTTP when the
exporter is ``otlp`` (every 60 s, or ``OTEL_METRIC_EXPORT_INTERVAL`` ms). Both providers flush at exit, so a
process that stops cleanly sends its last spans and its final counter values.
"""

from __future__ import annotations

import logging

from opentelemetry import metrics, trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from prometheus_client import CollectorRegistry

from batchline.config import TelemetryConfig

log = logging.getLogger(__name__)
# batchline's own registry, not prometheus_client's global one: /metrics shows what OpenTelemetry collected only.
PROMETHEUS_REGISTRY = CollectorRegistry()


def setup_telemetry(
    config: TelemetryConfig, service: str, extra: SpanExporter | None = None, prometheus: bool = False
) -> TracerProvider:
    """Tracer and meter providers for this process with the configured exporters (``extra`` is for tests);
    ``prometheus``: collect the metrics for ``/metrics`` (see :mod:`batchline.telemetry.server`)."""
    resource = Resource.create({"service.name": service})
    # With nowhere to send spans, none is recorded: a worker would otherwise build four SDK spans per micro-batch
    # (attributes, links) only to drop them - 9 % of its loop with the engine out of the way. Span contexts (and
    # the traceparent on every result) still exist, flagged not sampled; OTEL_TRACES_SAMPLER applies otherwise.
    sampler = ALWAYS_OFF if config.exporter == "none" and extra is None else None
    provider = TracerProvider(resource=resource, sampler=sampler)
    readers: list[MetricReader] = []
    if config.exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif config.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(f"{config.otlp_endpoint}/v1/traces")))
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(f"{config.otlp_endpoint}/v1/metrics")))
    if extra is not None:
        provider.add_span_processor(SimpleSpanProcessor(extra))
    if prometheus:
        readers.append(PrometheusMetricReader(registry=PROMETHEUS_REGISTRY))
    metrics.set_meter_provider(MeterProvider(metric_readers=readers, resource=resource))
    trace.set_tracer_provider(provider)
    return provider
