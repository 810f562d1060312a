"""Traces across the four services: one HTTP request is one trace, exported over OTLP/gRPC.

The collector is in-process: a real gRPC `TraceService` (opentelemetry-proto) that keeps every
span it is sent. The services are real processes pointed at it with OTEL_EXPORTER_OTLP_ENDPOINT.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.common.tracing import RequestSpans
from tests import tiny
from tests.integration.stack import Stack, free_port, stack_env

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
ROLES = ("gateway", "scheduler", "draft", "verifier")


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps (service name, span) pairs."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans.extend((service, span) for span in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[tuple[str, object]]:
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id.hex() == trace_id]

    def stop(self) -> None:
        self.server.stop(grace=None).wait()


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value"))
    return out


@pytest.fixture(scope="module")
def traced(tmp_path_factory, home):
    """Collector + the four services exporting to it quickly (OTEL_BSP_SCHEDULE_DELAY=100 ms)."""
    collector = Collector()
    root = tmp_path_factory.mktemp("traced")
    target = tiny.make_checkpoint(root / "target", seed=1)
    draft = tiny.make_checkpoint(root / "draft", seed=2, noise_from=target, noise_std=0.08)
    env = stack_env(home, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector.port}",
                    OTEL_BSP_SCHEDULE_DELAY="100", OTEL_TRACES_SAMPLER="parentbased_always_on")
    for name in [k for k in env if k.startswith("OTEL_SERVICE_NAME")]:
        env.pop(name)
    st = Stack(root, env)
    try:
        verifier = st.start("verifier", "--target", str(target), "--metrics-port", "0")
        drafter = st.start("draft", "--target", str(target), "--draft", str(draft), "--metrics-port", "0")
        st.wait_healthy(verifier)
        st.wait_healthy(drafter)
        sched = st.start("scheduler", "--target", str(target), "--draft-addrs", drafter.addr,
                         "--verifier-addrs", verifier.addr, "--draft-length", "3", "--tree-size", "5",
                         "--metrics-port", "0")
        st.wait_healthy(sched)
        http_port = free_port()
        gateway = st.start("gateway", "--target", str(target), "--scheduler-addrs", sched.addr,
                           "--http-port", str(http_port))
        st.wait_healthy(gateway)
        yield collector, f"http://127.0.0.1:{http_port}"
    finally:
        st.stop_all()
        collector.stop()


def wait_for_spans(collector: Collector, trace_id: str, names: set[str], timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = collector.trace(trace_id)
        if names <= {s.name for _, s in spans}:
            time.sleep(0.5)  # let the last export batches land too
            return collector.trace(trace_id)
        time.sleep(0.1)
    got = sorted((svc, s.name) for svc, s in collector.trace(trace_id))
    raise AssertionError(f"missing spans {names - {s.name for _, s in collector.trace(trace_id)}}; got {got}")


def test_one_http_request_is_one_trace_across_all_four_services(traced):
    collector, url = traced
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
                   json={"prompt": "w5 w6 w7 w8 w5 w6", "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    spans = wait_for_spans(collector, CLIENT_TRACE, {"POST /v1/completions", "scheduler.request", "scheduler.step",
                                                     "draft.request", "draft.step", "verifier.request",
                                                     "verifier.step"})
    assert {svc for svc, _ in spans} == {f"specserve-{role}" for role in ROLES}
    by_name: dict[str, list] = {}
    for svc, s in spans:
        by_name.setdefault(s.name, []).append((svc, s))
    for name in ("POST /v1/completions", "scheduler.request", "draft.request", "verifier.request"):
        assert len(by_name[name]) == 1, (name, len(by_name[name]))
    (_, http_span), = by_name["POST /v1/completions"]
    (_, sched), = by_name["scheduler.request"]
    (draft_svc, draft_req), = by_name["draft.request"]
    (verifier_svc, verifier_req), = by_name["verifier.request"]
    # The client's traceparent is the parent of the gateway's span, and so on down.
    assert http_span.parent_span_id.hex() == CLIENT_SPAN
    assert attrs(http_span)["http.response.status_code"] == 200
    assert sched.parent_span_id == http_span.span_id
    assert (draft_svc, verifier_svc) == ("specserve-draft", "specserve-verifier")
    assert draft_req.parent_span_id == sched.span_id
    assert verifier_req.parent_span_id == sched.span_id
    # One scheduler step span per step, with the speculation attributes, adding up to the usage.
    steps = [s for _, s in by_name["scheduler.step"]]
    assert all(s.parent_span_id == sched.span_id for s in steps)
    assert len(steps) == usage["steps"]
    step_attrs = [attrs(s) for s in steps]
    for a in step_attrs:
        assert {"specserve.draft_length", "specserve.tree_size", "specserve.accepted_tokens",
                "specserve.draft_ms", "specserve.verify_ms"} <= set(a)
        assert 0 <= a["specserve.accepted_tokens"] <= a["specserve.tree_size"]
    assert sum(a["specserve.accepted_tokens"] for a in step_attrs) == usage["accepted_tokens"]
    assert sum(a["specserve.tree_size"] for a in step_attrs) == usage["drafted_tokens"]
    assert sum(a["specserve.output_tokens"] for a in step_attrs) == usage["completion_tokens"] == 16
    assert attrs(sched)["specserve.finish_reason"] == "length"
    # Worker step spans sit under the worker's request span; the verifier verified every step.
    assert all(s.parent_span_id == draft_req.span_id for _, s in by_name["draft.step"])
    verifier_steps = [s for _, s in by_name["verifier.step"]]
    assert all(s.parent_span_id == verifier_req.span_id for s in verifier_steps)
    assert len(verifier_steps) == usage["steps"]
    assert sum(attrs(s)["specserve.accepted_tokens"] for s in verifier_steps) == usage["accepted_tokens"]
    # Every span ended inside its parent's time.
    for child, parent in [(sched, http_span), (draft_req, sched), (verifier_req, sched)]:
        assert parent.start_time_unix_nano <= child.start_time_unix_nano


def test_a_request_without_traceparent_starts_a_new_trace(traced):
    collector, url = traced
    before = {s.trace_id for _, s in collector.spans}
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={"prompt": "w9 w10", "max_tokens": 4})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        new = {s.trace_id.hex() for _, s in collector.spans if s.name == "POST /v1/completions"} - \
              {t.hex() for t in before}
        if new:
            break
        time.sleep(0.1)
    (trace_id,) = new
    spans = wait_for_spans(collector, trace_id, {"scheduler.request", "verifier.request"})
    (http_span,) = [s for _, s in spans if s.name == "POST /v1/completions"]
    assert http_span.parent_span_id == b""  # a root span


def test_a_dead_collector_never_fails_a_request(traced):
    collector, url = traced
    collector.stop()
    for _ in range(2):
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={"prompt": "w11 w12", "max_tokens": 6})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1


def test_tracing_is_off_without_an_endpoint():
    """This test process installs no tracer provider: request spans are not even created."""
    assert not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    spans = RequestSpans("specserve.test")
    assert not spans.enabled
    spans.start("r1", "x.request")
    assert spans.spans == {} and spans.traceparent("r1") == "" and spans.first("r1", 0) == ""
