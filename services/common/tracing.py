"""OpenTelemetry traces: setup per service, W3C trace context over gRPC, per-request spans.

One trace per request, across the four services:

    gateway    POST /v1/...            FastAPI's own span (parent: the client's `traceparent`
                                       header, else a new trace); see `fastapi_telemetry`
    scheduler    scheduler.request     (parent from the gRPC metadata `traceparent`)
                   scheduler.step      one per speculation step of the request
    draft          draft.request       (parent from ProposeItem.traceparent; ends on release)
                     draft.step
    verifier       verifier.request    (parent from VerifyItem.traceparent; ends on release)
                     verifier.step

`setup_tracing(role)` exports over OTLP/gRPC when OTEL_EXPORTER_OTLP_ENDPOINT (or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; the SDK reads the other standard variables itself
(OTEL_SERVICE_NAME, default specserve-<role>; OTEL_RESOURCE_ATTRIBUTES; OTEL_TRACES_SAMPLER and
its argument; OTEL_BSP_*; OTEL_EXPORTER_OTLP_HEADERS, _INSECURE, _TIMEOUT, ...). Unset, no
provider is installed: `RequestSpans` then does nothing at all. Spans leave through a
BatchSpanProcessor, so a slow or absent collector costs dropped spans, never a failed request.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

log = logging.getLogger(__name__)

DEFAULT_EXPORT_TIMEOUT_S = 2.0  # unless OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT says otherwise
TRUE = ("1", "true", "yes", "on")


def _endpoint() -> str | None:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def setup_tracing(role: str):
    """Install the OTLP exporter for this process when an endpoint is configured; returns the
    SDK TracerProvider (call .shutdown() before exit to flush), or None when tracing is off."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() in TRUE or not _endpoint() \
            or os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: f"specserve-{role}"}
    provider = TracerProvider(resource=Resource.create(attrs))  # sampler from OTEL_TRACES_SAMPLER
    timeout = None
    if not (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")):
        timeout = DEFAULT_EXPORT_TIMEOUT_S
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(timeout=timeout)))
    trace.set_tracer_provider(provider)
    log.info("tracing: OTLP/gRPC to %s as %s", _endpoint(), provider.resource.attributes.get(SERVICE_NAME))
    return provider


def tracing_enabled() -> bool:
    from opentelemetry.sdk.trace import TracerProvider

    return isinstance(trace.get_tracer_provider(), TracerProvider)


def extract_metadata(metadata: Iterable[tuple[str, str]] | None) -> otel_context.Context:
    """The trace context carried by gRPC invocation metadata (an empty context when none)."""
    return propagate.extract({k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)})


def inject_metadata() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata (`traceparent`, `tracestate`); [] when none."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return sorted(carrier.items())


def traceparent_context(traceparent: str) -> otel_context.Context:
    return propagate.extract({"traceparent": traceparent})


def _ns(perf_s: float) -> int:
    """A time.perf_counter() reading as wall-clock nanoseconds (what spans carry)."""
    return time.time_ns() - int((time.perf_counter() - perf_s) * 1e9)


class RequestSpans:
    """The open span of each request a service holds, keyed by request id, and the step spans
    under it. Every method is a no-op when tracing is off or the request is not sampled."""

    def __init__(self, name: str):
        self.tracer = trace.get_tracer(name) if tracing_enabled() else None
        self.spans: dict[str, trace.Span] = {}

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def start(self, req_id: str, name: str, parent: otel_context.Context | None = None,
              kind: SpanKind = SpanKind.SERVER, attributes: dict | None = None) -> None:
        """Open `req_id`'s span (if it has none yet) under `parent`."""
        if self.tracer is None or req_id in self.spans:
            return
        span = self.tracer.start_span(name, context=parent, kind=kind,
                                      attributes={"specserve.request_id": req_id, **(attributes or {})})
        if span.is_recording():
            self.spans[req_id] = span

    def start_remote(self, req_id: str, name: str, traceparent: str, attributes: dict | None = None) -> None:
        """Open `req_id`'s span under a W3C traceparent from a step message (once per request)."""
        if self.tracer is not None and traceparent and req_id not in self.spans:
            self.start(req_id, name, traceparent_context(traceparent), attributes=attributes)

    def traceparent(self, req_id: str) -> str:
        """The W3C traceparent of `req_id`'s span, for the workers; "" when it has none."""
        span = self.spans.get(req_id)
        if span is None:
            return ""
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get("traceparent", "")

    def first(self, req_id: str, offset: int) -> str:
        """The traceparent for a step item: only on a request's first item to a replica (offset 0,
        also after a resync), "" otherwise."""
        return "" if offset or not self.spans else self.traceparent(req_id)

    def set(self, req_id: str, attributes: dict) -> None:
        span = self.spans.get(req_id)
        if span is not None:
            span.set_attributes(attributes)

    def step(self, req_id: str, name: str, start_perf: float, end_perf: float, attributes: dict) -> None:
        """A finished child span of `req_id`'s span from start_perf to end_perf (perf_counter s)."""
        parent = self.spans.get(req_id)
        if parent is None:
            return
        span = self.tracer.start_span(name, context=trace.set_span_in_context(parent), kind=SpanKind.INTERNAL,
                                      start_time=_ns(start_perf), attributes=attributes)
        span.end(end_time=_ns(end_perf))

    def end(self, req_id: str, error: str = "", attributes: dict | None = None) -> None:
        span = self.spans.pop(req_id, None)
        if span is None:
            return
        if attributes:
            span.set_attributes(attributes)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def end_all(self) -> None:
        for rid in list(self.spans):
            self.end(rid)


UNTRACED_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapes: no spans


def fastapi_telemetry() -> dict:
    """FastAPI's native OpenTelemetry settings for the gateway app: FastAPI itself opens the
    SERVER span of each HTTP request (parent: the `traceparent` header, else a new trace) from the
    global provider `setup_tracing` installs, keeps it current for the whole response (an SSE
    stream included) and ends it after the last byte; without a provider it does nothing. No
    spans for health checks and scrapes, and none per FastAPI phase (dependencies, endpoint)."""
    return {"operation_spans": False, "exclude": lambda scope: scope.get("path") in UNTRACED_PATHS}
