"""Prometheus metrics: one registry object per service, passed to whatever records into it.

Names follow vLLM's (`vllm:...` there, `specserve:...` here), so dashboards built for vLLM's
speculative-decoding counters carry over: acceptance rate = accepted / draft tokens, mean
accepted length = 1 + accepted / drafts, per-position acceptance from
`specserve:spec_decode_num_accepted_tokens_per_pos_total{position}` (0 = the first draft token).

    gateway    GatewayMetrics    on its HTTP port, GET /metrics
    scheduler  SchedulerMetrics  --metrics-port (default 9101)
    draft      WorkerMetrics     --metrics-port (default 9102)
    verifier   WorkerMetrics     --metrics-port (default 9103)

Nothing here is a module-level mutable: every metric lives in the `Registry` it was built with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM's buckets, so that quantiles compare across the two servers.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
K_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
CHUNK_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class Registry:
    """A Prometheus registry for one service, with its text exposition and optional HTTP port."""

    def __init__(self, role: str):
        self.role = role
        self.registry = CollectorRegistry()

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric (what GET /metrics returns)."""
        return generate_latest(self.registry)

    def names(self) -> set[str]:
        """Every series name this registry exports (`x_total` for a counter; `x_bucket`, `x_sum`,
        `x_count` for a histogram), also of labelled metrics that have no sample yet."""
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
        out = set()
        for fam in self.registry.collect():
            out.update(fam.name + s for s in suffixes.get(fam.type, ("",)))
            out.update(s.name for s in fam.samples if not s.name.endswith("_created"))
        return out

    def serve(self, host: str, port: int) -> int:
        """Serve GET /metrics on host:port in a background thread; 0 = off. A port that is taken
        is logged and metrics stay off: observability never stops a service from serving."""
        if port <= 0:
            return 0
        try:
            server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            log.error("metrics: cannot listen on %s:%d (%s); /metrics is off", host, port, e.strerror or e)
            return 0
        log.info("metrics on http://%s:%d/metrics", host, server.server_port)
        return server.server_port


class CallbackCounter:
    """A counter read from another object at scrape time (e.g. the `Counter` of refusals by
    reason that the authenticator keeps), so that object needs no Prometheus dependency. `read`
    returns a number, or a mapping from the value of `label` to a number."""

    def __init__(self, registry: Registry, name: str, doc: str,
                 read: Callable[[], float | Mapping[str, float]] | None = None, label: str = ""):
        self.name, self.doc, self.label = name, doc, label
        self.read = read or (lambda: 0)
        registry.registry.register(self)

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.doc, labels=[self.label] if self.label else None)

    def describe(self):
        return [self._family()]

    def collect(self):
        try:
            value = self.read()
        except Exception:  # a scrape must not fail because one source did
            log.exception("metrics: reading %s failed", self.name)
            return []
        fam = self._family()
        if isinstance(value, Mapping):
            for key, n in sorted(value.items()):
                fam.add_metric([str(key)] if self.label else [], float(n))
        else:
            fam.add_metric([], float(value or 0))  # a bare number: no label
        return [fam]


class GatewayMetrics:
    """HTTP requests by route and status, auth failures, rate-limit rejections, overload refusals.
    The refusal counts are read at scrape time from the objects that keep them (see `CallbackCounter`)."""

    def __init__(self, registry: Registry, auth_failures: Callable[[], Mapping[str, float]] | None = None,
                 rate_limit_rejections: Callable[[], Mapping[str, float]] | None = None,
                 rate_limit_unchecked: Callable[[], float] | None = None,
                 rejections: Callable[[], Mapping[str, float]] | None = None):
        r = registry.registry
        self.registry = registry
        self.http_requests = Counter("specserve:http_requests", "HTTP requests answered, by route and status",
                                     ["route", "status"], registry=r)
        self.http_duration = Histogram("specserve:http_request_duration_seconds",
                                       "Time from an HTTP request to the end of its response (whole stream)",
                                       ["route"], buckets=E2E_BUCKETS, registry=r)
        CallbackCounter(registry, "specserve:auth_failures",
                        "Requests refused (401, 403) for a missing, invalid or forbidden credential, by reason",
                        auth_failures or dict, label="reason")
        CallbackCounter(registry, "specserve:rate_limit_rejections",
                        "Requests refused (429) by a rate limit, by limit (requests, tokens)",
                        rate_limit_rejections or dict, label="limit")
        CallbackCounter(registry, "specserve:rate_limit_unchecked",
                        "Requests let through unchecked (or refused, if configured closed) because Redis "
                        "was unreachable", rate_limit_unchecked)
        CallbackCounter(registry, "specserve:requests_rejected",
                        "Requests refused for overload (HTTP 429/503 with Retry-After), by reason: "
                        "gateway_overloaded (--max-concurrent-requests), scheduler_overloaded, "
                        "scheduler_unavailable", rejections or dict, label="reason")

    def record_http(self, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(route, str(status)).inc()
        self.http_duration.labels(route).observe(seconds)


class SchedulerMetrics:
    """vLLM-compatible speculative-decoding counters, request latencies, queue and batch gauges."""

    def __init__(self, registry: Registry):
        r = registry.registry
        self.registry = registry
        self.num_drafts = Counter("specserve:spec_decode_num_drafts",
                                  "Request-steps that proposed at least one draft token", registry=r)
        self.num_draft_tokens = Counter("specserve:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                        registry=r)
        self.num_accepted_tokens = Counter("specserve:spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted by the verifier", registry=r)
        self.accepted_per_pos = Counter("specserve:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position on the accepted path (0 = first)",
                                        ["position"], registry=r)
        self.steps = Counter("specserve:scheduler_steps", "Speculation steps run (one verify forward each)",
                             registry=r)
        self.step_duration = Histogram("specserve:step_duration_seconds",
                                       "Wall time of one step's phase as the scheduler sees it",
                                       ["phase"], buckets=STEP_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specserve:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("specserve:generation_tokens", "Output tokens committed", registry=r)
        self.request_success = Counter("specserve:request_success", "Requests finished, by finish reason",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram("specserve:time_to_first_token_seconds",
                              "Time from a request's arrival at the scheduler to its first output tokens",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("specserve:inter_token_latency_seconds",
                             "Time between consecutive output chunks of a request (one per step; a step may "
                             "commit several tokens)", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("specserve:e2e_request_latency_seconds",
                             "Time from a request's arrival at the scheduler to its last event",
                             buckets=E2E_BUCKETS, registry=r)
        self.waiting = Gauge("specserve:num_requests_waiting", "Requests queued for a batch slot", registry=r)
        self.running = Gauge("specserve:num_requests_running", "Requests in the running batch", registry=r)
        # Chunked prefill (services/scheduler/budget.py): prompts joining over several steps.
        self.prefilling = Gauge("specserve:num_requests_prefilling",
                                "Running requests whose prompt the verifier has not all been sent yet", registry=r)
        self.prefill_chunk = Histogram("specserve:prefill_chunk_tokens",
                                       "Prompt tokens of one request sent to the verifier in one step",
                                       buckets=CHUNK_BUCKETS, registry=r)
        # Admission (services/scheduler/admission.py): KV reservations and refusals.
        self.kv_reserved = Gauge("specserve:kv_cache_reserved_tokens",
                                 "KV tokens reserved by running requests (prompt + max_tokens + one tree each)",
                                 registry=r)
        self.kv_budget = Gauge("specserve:kv_cache_budget_tokens",
                               "KV tokens the running requests may reserve in all (--kv-budget-tokens)", registry=r)
        self._rejections: Callable[[], Mapping[str, float]] = dict
        CallbackCounter(registry, "specserve:requests_rejected",
                        "Requests refused, by reason: queue_full (429 with Retry-After), exceeds_kv_budget (400), "
                        "shutting_down (503)", lambda: self._rejections(), label="reason")
        self._per_pos: list = []  # accepted_per_pos children by position (labels() lookups are slow)
        # The adaptive draft length: what it chose, and how its predictions held.
        self.chosen_k = Histogram("specserve:draft_length_chosen", "Draft length k chosen per request and step",
                                  buckets=K_BUCKETS, registry=r)
        self.chosen_tree = Histogram("specserve:tree_size_chosen", "Tree node budget chosen per request and step",
                                     buckets=BATCH_BUCKETS, registry=r)
        self.predicted_tps = Gauge("specserve:adaptive_predicted_tokens_per_second",
                                   "Output tokens/s of the batch the last plan predicted", registry=r)
        self.plain_tps = Gauge("specserve:adaptive_plain_tokens_per_second",
                               "Output tokens/s the same batch would get without drafting (predicted)",
                               registry=r)
        self._controller_totals: dict[str, Callable[[], float]] = {}
        CallbackCounter(registry, "specserve:adaptive_predicted_tokens",
                        "Output tokens the controller expected of the steps it planned",
                        lambda: self._controller_totals.get("predicted", lambda: 0.0)())
        CallbackCounter(registry, "specserve:adaptive_observed_tokens",
                        "Output tokens those steps actually committed",
                        lambda: self._controller_totals.get("observed", lambda: 0.0)())
        CallbackCounter(registry, "specserve:adaptive_proposed_nodes",
                        "Draft tree nodes proposed for adaptive requests",
                        lambda: self._controller_totals.get("proposed", lambda: 0.0)())
        CallbackCounter(registry, "specserve:adaptive_verified_nodes",
                        "Those nodes kept for verification after trimming by confidence",
                        lambda: self._controller_totals.get("kept", lambda: 0.0)())

    def watch_controller(self, controller) -> None:
        """Export a DraftController's plan and prediction totals (read at scrape time)."""
        self._controller_totals = {"predicted": lambda: controller.predicted_tokens,
                                   "observed": lambda: controller.observed_tokens,
                                   "proposed": lambda: controller.proposed_nodes,
                                   "kept": lambda: controller.kept_nodes}
        self.predicted_tps.set_function(lambda: controller.stats()["predicted_tokens_per_s"])
        self.plain_tps.set_function(lambda: controller.stats()["plain_tokens_per_s"])

    def watch_admission(self, admission) -> None:
        """Export an Admission's reserved tokens, budget and refusals (read at scrape time)."""
        self.kv_reserved.set_function(lambda: admission.used)
        self.kv_budget.set_function(lambda: admission.budget_tokens)
        self._rejections = lambda: admission.rejections

    def record_choice(self, k: int, tree_size: int) -> None:
        self.chosen_k.observe(k)
        self.chosen_tree.observe(tree_size)

    def watch_queue(self, waiting: Callable[[], int], running: Callable[[], int],
                    prefilling: Callable[[], int] = lambda: 0) -> None:
        self.waiting.set_function(waiting)
        self.running.set_function(running)
        self.prefilling.set_function(prefilling)

    def record_prefill(self, chunks: list[int]) -> None:
        for n in chunks:
            self.prefill_chunk.observe(n)

    def record_step(self, drafted: int, accepted: int) -> None:
        """One request's step: `drafted` tree nodes, an accepted path of `accepted` tokens."""
        if drafted <= 0:
            return
        self.num_drafts.inc()
        self.num_draft_tokens.inc(drafted)
        if accepted:
            self.num_accepted_tokens.inc(accepted)
            while len(self._per_pos) < accepted:
                self._per_pos.append(self.accepted_per_pos.labels(str(len(self._per_pos))))
            for child in self._per_pos[:accepted]:
                child.inc()

    def record_phases(self, draft_s: float, verify_s: float) -> None:
        self.steps.inc()
        self.step_duration.labels("draft").observe(draft_s)
        self.step_duration.labels("verify").observe(verify_s)


class RequestTimer:
    """One request's latencies at the scheduler: time to first token, the gaps between output
    chunks, end to end; and its outcome. Call `event` for every event sent, `end` when the call ends."""

    def __init__(self, metrics: SchedulerMetrics, prompt_tokens: int):
        self.metrics = metrics
        self.arrived = time.perf_counter()
        self.last: float | None = None
        self.finish_reason = ""
        metrics.prompt_tokens.inc(prompt_tokens)

    def event(self, tokens: int, finish_reason: str) -> None:
        now = time.perf_counter()
        m = self.metrics
        if tokens:
            (m.ttft if self.last is None else m.itl).observe(now - (self.arrived if self.last is None else self.last))
            self.last = now
            m.generation_tokens.inc(tokens)
        if finish_reason and not self.finish_reason:
            self.finish_reason = finish_reason
            m.e2e.observe(now - self.arrived)
            m.request_success.labels(finish_reason).inc()

    def end(self) -> None:
        """The call ended; without a finish reason the client went away (counted as "abort")."""
        if not self.finish_reason:
            self.finish_reason = "abort"
            self.metrics.request_success.labels("abort").inc()


class WorkerMetrics:
    """A draft or verifier worker: step time and batch size, state held, KV cache and GPU memory."""

    def __init__(self, registry: Registry, gpu_memory: Callable[[], tuple[int, int]] | None = None):
        r = registry.registry
        self.registry = registry
        self.step_duration = Histogram("specserve:worker_step_duration_seconds",
                                       "Compute time of one step message in the worker", buckets=STEP_BUCKETS,
                                       registry=r)
        self.batch_size = Histogram("specserve:worker_batch_size", "Requests carried by one step message",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.requests = Gauge("specserve:worker_requests", "Requests whose state the worker holds", registry=r)
        self.kv_bytes = Gauge("specserve:kv_cache_usage_bytes", "Bytes of KV cache held for requests",
                              registry=r)
        self.weight_bytes = Gauge("specserve:model_weight_bytes",
                                  "Bytes of model weights held (quantized ones as stored or packed)", registry=r)
        if gpu_memory is not None:  # only on CUDA: (used, total) bytes of the device
            self.gpu_used = Gauge("specserve:gpu_memory_used_bytes", "Device memory in use", registry=r)
            self.gpu_total = Gauge("specserve:gpu_memory_total_bytes", "Device memory in all", registry=r)
            self.gpu_used.set_function(lambda: gpu_memory()[0])
            self.gpu_total.set_function(lambda: gpu_memory()[1])

    def record_step(self, seconds: float, batch: int) -> None:
        self.step_duration.observe(seconds)
        self.batch_size.observe(batch)

    def record_state(self, requests: int, kv_bytes: int) -> None:
        self.requests.set(requests)
        self.kv_bytes.set(kv_bytes)


def route_of(scope, routes=()) -> str:
    """The route template serving this request (e.g. /v1/models/{model_id:path}), not the raw
    path, so that labels stay few: the route the router matched, else the first of `routes` whose
    path matches (a request refused before routing, e.g. by auth), else "unmatched"."""
    route = scope.get("route")
    if route is None:
        route = next((r for r in routes if getattr(r, "matches", None) and r.matches(scope)[0].value), None)
    return getattr(route, "path", None) or "unmatched"


class HttpMetricsMiddleware:
    """ASGI middleware counting every HTTP response by route and status, with its duration up to
    the end of the body (a whole SSE stream). `routes`: the app's routes, for route labels."""

    def __init__(self, app, metrics: GatewayMetrics, routes=()):
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), 500

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            self.metrics.record_http(route_of(scope, self.routes), status, time.perf_counter() - started)


def cuda_memory(device: str) -> Callable[[], tuple[int, int]] | None:
    """A (used, total) bytes reader for a CUDA device ("cuda", "cuda:N" or "auto"), else None."""
    if not (str(device).startswith("cuda") or device == "auto"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None

    def read() -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info()
        return total - free, total

    return read
