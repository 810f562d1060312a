"""`specserve serve <role>`: build one role's service from its settings and run it until SIGTERM."""

from __future__ import annotations

import asyncio
import logging

from services.common import codec
from services.common.grpc_server import GrpcServer
from services.common.metrics import Registry, SchedulerMetrics, WorkerMetrics, cuda_memory
from services.common.settings import positive_int, split_addrs
from services.common.step_servicer import StepServicer
from services.common.tls import Tls
from services.common.tracing import setup_tracing
from services.common.worker import StepWorker, model_thread, on_model_thread
from specserve.v1 import common_pb2

log = logging.getLogger(__name__)


def _worker_info(role: str, loaded, device: str, proposer: str = "", feature_layers: tuple[int, ...] = (),
                 min_match: int = 0) -> common_pb2.InfoResponse:
    c = loaded.config
    route_rows = loaded.model.matmul.small_rows if role == "verifier" else 0
    return common_pb2.InfoResponse(model=loaded.name, vocab_size=c.vocab_size, max_positions=c.max_positions,
                                   eos_token_ids=list(c.eos_token_ids), role=role, proposer=proposer,
                                   device=device, route_rows=route_rows, feature_layers=list(feature_layers),
                                   min_match=min_match)


def _worker_metrics(role: str, args) -> WorkerMetrics:
    """A worker's metrics, served on --metrics-port (0 = off)."""
    metrics = WorkerMetrics(Registry(role), cuda_memory(args.device))
    metrics.registry.serve(args.host, int(args.metrics_port))
    return metrics


def _server(args, role: str, pb2, service: str, add_servicer, servicer) -> tuple[Tls, GrpcServer]:
    """The role's gRPC server (TLS from its flags, reloaded on SIGHUP). `async with` it listens at
    once, health NOT_SERVING until the role says it is ready, and stops however the role ends."""
    tls = Tls.from_args(args, role)
    server = GrpcServer(args.host, int(args.port), [pb2.DESCRIPTOR.services_by_name[service].full_name],
                        credentials=tls.server_credentials())
    tls.watch_sighup()
    add_servicer(servicer, server.server)
    return tls, server


async def serve_draft(args) -> None:
    from specserve.v1 import draft_pb2, draft_pb2_grpc

    servicer = StepServicer(None, codec.DRAFT)
    _, server = _server(args, "draft", draft_pb2, "DraftService", draft_pb2_grpc.add_DraftServiceServicer_to_server,
                        servicer)
    async with server:  # NOT_SERVING while it loads
        servicer.bind(await _draft_worker(args, model_thread("draft")))
        await server.ready()
        await server.run(float(args.grace_period))


async def _draft_worker(args, thread) -> StepWorker:
    """The draft's proposer, loaded on its model thread (worker.py), as a step worker. The target's
    weights are needed only when it drafts for itself; otherwise its tokenizer and configuration
    suffice (vocabulary check, context length)."""
    from services.common.constraint import Constraints
    from services.common.loading import load_model
    from services.common.metrics import CallbackCounter
    from services.draft.factory import build_proposer
    from services.draft.proposer import ProposeWork

    target = await on_model_thread(thread, load_model, args.target, device=args.device, dtype=args.dtype,
                                   weights=args.draft == "self", weight_format=args.weights)
    proposer = await on_model_thread(thread, build_proposer, args.draft, target, device=args.device,
                                     dtype=args.dtype, weight_format=args.weights,
                                     compression_ratio=float(args.compression_ratio),
                                     guard_points=float(args.slim_guard_points))
    if proposer is None:
        raise ValueError("a draft service needs a proposer: --draft ngram, self or a checkpoint path")
    metrics = _worker_metrics("draft", args)
    draft_model = getattr(proposer, "model", None)
    if draft_model is not None:  # a model draft (the n-gram holds no weights)
        metrics.weight_bytes.set(draft_model.weight_bytes())
    slim_state = getattr(proposer, "slim_state", None)
    if slim_state is not None:  # SlimSpec guard: slim -> full head switches
        CallbackCounter(metrics.registry, "specserve:slimspec_fallbacks",
                        "Switches of the draft from its SlimSpec head to the full head by the quality guard",
                        lambda: (slim_state() or {}).get("fallbacks", 0))
    grammars = Constraints(target.tokenizer, target.config.vocab_size, target.eos_token_ids)
    info = _worker_info("draft", target, args.device, proposer.name, proposer.feature_layers, proposer.min_match)
    return StepWorker(info, 0, ProposeWork(proposer, grammars), metrics, thread)


async def serve_verifier(args) -> None:
    from specserve.v1 import verifier_pb2, verifier_pb2_grpc

    servicer = StepServicer(None, codec.VERIFIER)
    _, server = _server(args, "verifier", verifier_pb2, "VerifierService",
                        verifier_pb2_grpc.add_VerifierServiceServicer_to_server, servicer)
    async with server:  # NOT_SERVING while it loads
        thread = model_thread("verifier")  # loads the model too (worker.py: one OpenMP thread team)
        target, work = await on_model_thread(thread, _verify_work, args)
        metrics = _worker_metrics("verifier", args)
        metrics.weight_bytes.set(target.model.weight_bytes())
        servicer.bind(StepWorker(_worker_info("verifier", target, args.device), 1, work, metrics, thread))
        await server.ready()
        await server.run(float(args.grace_period))


def _verify_work(args):
    """The target and its verifier, a step's work, loaded on the thread that will run its steps."""
    from services.common.constraint import Constraints
    from services.common.loading import load_model
    from services.verifier.verifier import Verifier, VerifyWork

    target = load_model(args.target, device=args.device, dtype=args.dtype, weight_format=args.weights)
    grammars = Constraints(target.tokenizer, target.config.vocab_size, target.eos_token_ids)
    return target, VerifyWork(Verifier(target.model, grammars))


LOCAL = "local"  # the --draft-addrs (n-gram) or --verifier-addrs value: that worker in the scheduler's process


def is_local(addrs: str | None, flag: str) -> bool:
    """Whether a --*-addrs value puts that worker in the scheduler's own process (`local`, which
    takes no other replica: ValueError)."""
    listed = split_addrs(addrs)
    if LOCAL in listed and len(listed) > 1:
        raise ValueError(f"{flag} {LOCAL} runs that worker in the scheduler; it takes no other replica")
    return LOCAL in listed


def local_verifier(args) -> bool:
    return is_local(args.verifier_addrs, "--verifier-addrs")


def _local_draft(info: common_pb2.InfoResponse, grammars):
    """An n-gram draft in the scheduler's process: it needs no weights and takes well under a
    millisecond, while the hop to a draft service and back costs a few (vLLM and SGLang also run
    n-gram lookup in their engine process). A failed step costs its trees, as a broken stream would."""
    from services.draft.ngram import NgramProposer
    from services.draft.proposer import ProposeWork
    from services.scheduler.workers import LocalWorkers

    draft_info = common_pb2.InfoResponse(model=info.model, vocab_size=info.vocab_size,
                                         max_positions=info.max_positions, eos_token_ids=info.eos_token_ids,
                                         role="draft", proposer=NgramProposer.name, device="cpu")
    proposer = NgramProposer()
    worker = StepWorker(draft_info, 0, ProposeWork(proposer, grammars))
    return LocalWorkers("draft", worker, contain_errors=True, min_match=proposer.min_match), NgramProposer.name


async def _drafts(args, info: common_pb2.InfoResponse, spans, grammars, credentials=None):
    """The scheduler's draft workers and the proposer's name (`grammars`: a local draft's)."""
    from services.scheduler.replicas import RemoteWorkers

    if is_local(args.draft_addrs, "--draft-addrs"):
        return _local_draft(info, grammars)
    drafts = RemoteWorkers("draft", split_addrs(args.draft_addrs), spans, credentials)
    try:
        draft_info = await drafts.info()
    except RuntimeError:
        return drafts, "unknown"
    drafts.feature_layers = tuple(draft_info.feature_layers)  # the verifier is asked for these states
    drafts.min_match = draft_info.min_match
    return drafts, draft_info.proposer


async def _verifiers(args, spans, registry: Registry, credentials=None):
    """The scheduler's verifier workers and the target's Info: remote replicas, or (local) the
    target in this process, loaded and stepped on the event loop's thread as the in-process engine
    steps it: no verify hop, and no second thread taking the cores from the forward's OpenMP team.
    A step then holds the loop (health checks, new calls and token writes wait for it): decoding
    steps are short, and --max-step-tokens bounds a long prompt's. A local verifier's worker
    metrics (step time, KV bytes, weights) go to the scheduler's `registry`."""
    from services.scheduler.replicas import RemoteWorkers
    from services.scheduler.workers import LocalWorkers

    if local_verifier(args):
        target, work = _verify_work(args)
        metrics = WorkerMetrics(registry, cuda_memory(args.device))
        metrics.weight_bytes.set(target.model.weight_bytes())
        worker = StepWorker(_worker_info("verifier", target, args.device), 1, work, metrics)
        return LocalWorkers("verifier", worker, contain_errors=True), worker.info
    verifiers = RemoteWorkers("verifier", split_addrs(args.verifier_addrs), spans, credentials)
    return verifiers, await verifiers.info()


def _step_config(args):
    from services.scheduler.core import StepConfig

    return StepConfig(draft_length=args.draft_length if args.draft_length == "adaptive" else int(args.draft_length),
                      tree_size=int(args.tree_size) if args.tree_size else None, max_batch=int(args.max_batch),
                      min_draft_length=int(args.min_draft_length), max_draft_length=int(args.max_draft_length),
                      adjust_interval_ms=float(args.adjust_interval_ms), rejection_alert=float(args.rejection_alert),
                      kv_budget_tokens=int(args.kv_budget_tokens), max_waiting=int(args.max_waiting),
                      max_step_tokens=int(args.max_step_tokens), target_itl_ms=float(args.target_itl_ms))


async def serve_scheduler(args) -> None:
    from services.scheduler.servicer import SchedulerServicer
    from specserve.v1 import scheduler_pb2, scheduler_pb2_grpc

    servicer = SchedulerServicer()
    tls, server = _server(args, "scheduler", scheduler_pb2, "SchedulerService",
                          scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, servicer)
    async with server:  # NOT_SERVING until a verifier answers and the warm-up is done
        await _run_scheduler(args, tls, server, servicer)


async def _run_scheduler(args, tls: Tls, server: GrpcServer, servicer) -> None:
    from transformers import AutoTokenizer

    from services.common.constraint import Constraints
    from services.common.loading import resolve_checkpoint
    from services.common.tracing import RequestSpans
    from services.scheduler.core import StepCore, Target
    from services.scheduler.loop import SchedulerLoop
    from services.scheduler.observers import MetricsObserver, SpansObserver, StepLogObserver
    from services.scheduler.priors import Priors

    spans = RequestSpans("specserve.scheduler")  # the servicer opens each request's span
    metrics = SchedulerMetrics(Registry("scheduler"))
    # the target's facts; a local verifier's worker metrics join the scheduler's
    verifiers, info = await _verifiers(args, spans, metrics.registry, tls.channel_credentials())
    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(args.target))
    eos = set(info.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    grammars = Constraints(tokenizer, info.vocab_size, tuple(sorted(eos)))
    drafts, draft_name = await _drafts(args, info, spans, grammars, tls.channel_credentials())
    pair = f"{args.target}|{draft_name}"
    priors = Priors(args.redis_url, pair)
    target = Target(tokenizer, tuple(sorted(eos)), info.max_positions, info.vocab_size, info.route_rows, grammars)
    observers = [MetricsObserver(metrics), SpansObserver(spans)]
    if args.step_log:
        observers.append(StepLogObserver(args.step_log))
    core = StepCore(_step_config(args), target, verifiers, drafts, priors, observers)
    loop = SchedulerLoop(core, metrics, spans)
    _watch(metrics, core)
    metrics.registry.serve(args.host, int(args.metrics_port))
    try:
        await core.warm_up(pair)
    except Exception as e:  # a replica not up yet: the model learns from the first real steps instead
        log.warning("warm-up measurement failed (%s); starting from default latency estimates", e)
    sched_info = common_pb2.InfoResponse(model=info.model, vocab_size=info.vocab_size,
                                         max_positions=info.max_positions, eos_token_ids=sorted(eos),
                                         role="scheduler")
    servicer.bind(loop, sched_info)
    task = asyncio.create_task(loop.run())
    await server.ready()
    # Without a serving verifier nothing can be generated: a load balancer should go elsewhere.
    readiness = server.watch(verifiers.serving, "a verifier replica serving")
    try:
        await server.run(float(args.grace_period), on_drain=loop.drain)
    finally:
        readiness.cancel()
        task.cancel()
        await priors.close()
        await drafts.close()
        await verifiers.close()


def _watch(metrics: SchedulerMetrics, core) -> None:
    """The gauges read from the core: its controller, admission and queue."""
    if core.controller is not None:
        metrics.watch_controller(core.controller)
    metrics.watch_admission(core.admission)
    metrics.watch_queue(lambda: len(core.waiting), lambda: len(core.running),
                        lambda: sum(r.prefilling for r in core.running))


async def serve_gateway(args) -> None:
    from services.gateway.server import serve_gateway as run

    await run(args)


ROLE_MAIN = {"draft": serve_draft, "verifier": serve_verifier, "scheduler": serve_scheduler,
             "gateway": serve_gateway}


def torch_threads(role: str, threads: str | None, runs_target: bool = False) -> int | None:
    """The torch thread count a role runs with (None: torch's default, one per core). Roles with
    no model forward, and the draft unless told otherwise (--threads), keep to one: idle OpenMP
    workers spin on the cores the verifier's forward needs (on a small machine all share them).
    `runs_target`: a scheduler with the target in its process (--verifier-addrs local)."""
    if threads in (None, "auto"):
        return None if role == "verifier" or runs_target else 1
    try:
        return positive_int(threads, "--threads")
    except ValueError as e:
        raise SystemExit(f"{e} (or auto)") from None


def serve(role: str, args) -> None:
    threads = torch_threads(role, getattr(args, "threads", None), role == "scheduler" and local_verifier(args))
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    tracer_provider = setup_tracing(role)  # None unless OTEL_EXPORTER_OTLP_ENDPOINT is set
    try:
        asyncio.run(ROLE_MAIN[role](args))
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()  # flush the spans still queued
