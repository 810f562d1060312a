"""`specserve serve <role>`: build one role's service from its settings and run it until SIGTERM."""

from __future__ import annotations

import asyncio
import logging

from services.common.grpc_server import GrpcServer
from services.common.metrics import Registry, SchedulerMetrics, WorkerMetrics, cuda_memory
from services.common.settings import split_addrs
from services.common.tracing import setup_tracing
from services.common.worker import model_thread, on_model_thread
from specserve.v1 import common_pb2

log = logging.getLogger(__name__)


def _worker_info(role: str, loaded, device: str, proposer: str = "") -> common_pb2.InfoResponse:
    c = loaded.config
    route_rows = loaded.model.matmul.small_rows if role == "verifier" else 0
    return common_pb2.InfoResponse(model=loaded.name, vocab_size=c.vocab_size, max_positions=c.max_positions,
                                   eos_token_ids=list(c.eos_token_ids), role=role, proposer=proposer,
                                   device=device, route_rows=route_rows)


def _worker_metrics(role: str, args) -> WorkerMetrics:
    """A worker's metrics, served on --metrics-port (0 = off)."""
    metrics = WorkerMetrics(Registry(role), cuda_memory(args.device))
    metrics.registry.serve(args.host, int(args.metrics_port))
    return metrics


async def serve_draft(args) -> None:
    from services.common.loading import load_model
    from services.draft.factory import build_proposer
    from services.draft.servicer import DraftServicer
    from specserve.v1 import draft_pb2, draft_pb2_grpc

    # The target's weights are needed only when it drafts for itself; otherwise its tokenizer and
    # configuration suffice (vocabulary check, context length). Loaded on the model thread (worker.py).
    thread = model_thread("draft")
    target = await on_model_thread(thread, load_model, args.target, device=args.device, dtype=args.dtype,
                                   weights=args.draft == "self")
    proposer = await on_model_thread(thread, build_proposer, args.draft, target, device=args.device,
                                     dtype=args.dtype, compression_ratio=float(args.compression_ratio),
                                     guard_points=float(args.slim_guard_points))
    if proposer is None:
        raise ValueError("a draft service needs a proposer: --draft ngram, self or a checkpoint path")
    servicer = DraftServicer(proposer, _worker_info("draft", target, args.device, proposer.name),
                             _worker_metrics("draft", args), thread)
    server = GrpcServer(args.host, int(args.port), [draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name])
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server.server)
    await server.run(float(args.grace_period))


async def serve_verifier(args) -> None:
    from services.common.loading import load_model
    from services.verifier.servicer import VerifierServicer
    from services.verifier.verifier import Verifier
    from specserve.v1 import verifier_pb2, verifier_pb2_grpc

    thread = model_thread("verifier")  # loads the model too (worker.py: one OpenMP thread team)
    target = await on_model_thread(thread, load_model, args.target, device=args.device, dtype=args.dtype)
    verifier = await on_model_thread(thread, Verifier, target.model)
    servicer = VerifierServicer(verifier, _worker_info("verifier", target, args.device),
                                _worker_metrics("verifier", args), thread)
    server = GrpcServer(args.host, int(args.port),
                        [verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name])
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, server.server)
    await server.run(float(args.grace_period))


async def serve_scheduler(args) -> None:
    from transformers import AutoTokenizer

    from services.common.loading import resolve_checkpoint
    from services.scheduler.controller import ControllerConfig
    from services.scheduler.local_draft import LOCAL, LocalDraft
    from services.scheduler.loop import SchedulerLoop
    from services.scheduler.servicer import SchedulerServicer
    from services.scheduler.telemetry import Telemetry
    from services.scheduler.workers import ReplicaSet
    from specserve.v1 import scheduler_pb2, scheduler_pb2_grpc

    verifiers = ReplicaSet("verifier", split_addrs(args.verifier_addrs))
    info = await _wait_for_info(verifiers)  # the target's facts come from a verifier
    draft_addrs = split_addrs(args.draft_addrs)
    if LOCAL in draft_addrs:  # n-gram lookup in this process: no draft hop
        if len(draft_addrs) > 1:
            raise ValueError(f"--draft-addrs {LOCAL} drafts in the scheduler; it takes no other replica")
        drafts = ReplicaSet("draft", [], replicas=[LocalDraft(info)])
    else:
        drafts = ReplicaSet("draft", draft_addrs)
    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint(args.target))
    eos = set(info.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    pair = f"{args.target}|{await _draft_name(drafts)}"
    telemetry = Telemetry(args.redis_url, pair)
    tree_size = int(args.tree_size) if args.tree_size else None
    metrics = SchedulerMetrics(Registry("scheduler"))
    controller = ControllerConfig(min_draft_length=int(args.min_draft_length),
                                  max_draft_length=int(args.max_draft_length),
                                  adjust_interval_ms=float(args.adjust_interval_ms),
                                  rejection_alert=float(args.rejection_alert), route_rows=info.route_rows)
    loop = SchedulerLoop(tokenizer, tuple(sorted(eos)), info.max_positions, drafts, verifiers, telemetry,
                         draft_length=args.draft_length, max_draft_length=int(args.max_draft_length),
                         tree_size=tree_size, max_batch=int(args.max_batch), controller=controller,
                         metrics=metrics, kv_budget_tokens=int(args.kv_budget_tokens),
                         max_waiting=int(args.max_waiting), vocab_size=info.vocab_size)
    metrics.watch_queue(lambda: len(loop.waiting), lambda: len(loop.running))
    metrics.registry.serve(args.host, int(args.metrics_port))
    if loop.controller is not None:
        await _warm_up(loop, info.vocab_size)
    sched_info = common_pb2.InfoResponse(model=info.model, vocab_size=info.vocab_size,
                                         max_positions=info.max_positions, eos_token_ids=sorted(eos),
                                         role="scheduler")
    server = GrpcServer(args.host, int(args.port),
                        [scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name])
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(SchedulerServicer(loop, sched_info), server.server)
    task = asyncio.create_task(loop.run())
    try:
        await server.run(float(args.grace_period), on_drain=loop.drain)
    finally:
        task.cancel()
        await telemetry.close()
        await drafts.close()
        await verifiers.close()


async def _warm_up(loop, vocab_size: int) -> None:
    """Seed the controller's latency model from a few measured steps on the first replicas."""
    from services.scheduler.calibration import calibrate_remote

    cfg = loop.controller.config
    verifier = loop.verifiers.replicas[0]
    draft = loop.drafts.replicas[0] if loop.drafts.replicas else None
    try:
        await calibrate_remote(loop.controller.latency, verifier.step, draft.step if draft else None, vocab_size,
                               cfg.max_draft_length, cfg.tree_width)
    except Exception as e:  # a replica not up yet: the model learns from the first real steps instead
        log.warning("warm-up measurement failed (%s); starting from default latency estimates", e)


async def _wait_for_info(replicas, timeout_s: float = 600.0) -> common_pb2.InfoResponse:
    """Workers may still be loading their model: retry until one answers."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        for rep in replicas.replicas:
            try:
                return await rep.info(timeout=2.0)
            except Exception as e:  # not up yet
                last = e
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"no {replicas.kind} replica answered: {last}")
        await asyncio.sleep(0.5)


async def _draft_name(drafts) -> str:
    try:
        info = await _wait_for_info(drafts, timeout_s=600.0)
        return info.proposer
    except RuntimeError:
        return "unknown"


async def serve_gateway(args) -> None:
    from services.gateway.server import serve_gateway as run

    await run(args)


ROLE_MAIN = {"draft": serve_draft, "verifier": serve_verifier, "scheduler": serve_scheduler,
             "gateway": serve_gateway}


def serve(role: str, args) -> None:
    # Roles that run no model forward keep torch to one thread: its idle worker threads would
    # otherwise spin on the cores the verifier's forward needs (on a small machine all share them).
    if role in ("scheduler", "gateway") or (role == "draft" and args.draft == "ngram"):
        import torch

        torch.set_num_threads(1)
    tracer_provider = setup_tracing(role)  # None unless OTEL_EXPORTER_OTLP_ENDPOINT is set
    try:
        asyncio.run(ROLE_MAIN[role](args))
    finally:
        if tracer_provider is not None:
            tracer_provider.shutdown()  # flush the spans still queued
