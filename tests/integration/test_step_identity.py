"""One step, two drivers: the scheduler service (real processes over gRPC) and the in-process
engine give the same tokens for every configuration: plain decoding, chains and trees, the model
draft, the feature head (the target's states travel verifier -> scheduler -> draft) and the n-gram
(the scheduler's own, and a draft service's), adaptive, and sampling with a seed at a fixed k; and
the same with the target in the scheduler's process (--verifier-addrs local)."""

import asyncio
import json

import grpc
import pytest

from services.common.loading import load_model
from services.common.sampling import SamplingParams
from services.draft.factory import build_head_proposer
from services.draft.model_proposer import ModelProposer
from services.draft.ngram import NgramProposer
from services.scheduler.core import StepConfig
from services.scheduler.engine import Engine
from tests import tiny
from tests.integration.stack import Stack, free_port, stack_env
from tests.integration.test_metrics import scrape, value
from tests.integration.test_services import generate, state
from tests.unit.test_greedy_identity import assert_asked_only_where_the_end_recurs
from specserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [20, 21, 22, 20, 21], [9, 10, 11]]
GREEDY = dict(max_tokens=20)
SAMPLED = dict(max_tokens=16, temperature=0.9, top_p=0.9, seed=7)

# (scheduler, draft, k or "adaptive", tree size, sampling): k and tree size go with each request
# to the fixed schedulers; the adaptive ones choose (greedy only: a seed's tokens depend on k).
CONFIGS = {
    "plain": ("model", "model", 0, None, GREEDY),
    "model-chain": ("model", "model", 2, 2, GREEDY),
    "model-tree": ("model", "model", 3, 5, GREEDY),
    "model-tree-sampled": ("model", "model", 3, 5, SAMPLED),
    "model-chain-sampled": ("model", "model", 2, 2, dict(max_tokens=16, temperature=1.2, top_k=10, seed=3)),
    "model-adaptive": ("model-adaptive", "model", "adaptive", None, GREEDY),
    "ngram-chain": ("ngram", "ngram", 3, 3, GREEDY),
    "ngram-tree": ("ngram", "ngram", 4, 8, GREEDY),
    "ngram-sampled": ("ngram", "ngram", 3, 3, SAMPLED),
    "ngram-adaptive": ("ngram", "ngram", "adaptive", None, GREEDY),
    "ngram-service-chain": ("ngram-service", "ngram", 3, 3, GREEDY),
    "head-chain": ("head", "head", 3, 3, GREEDY),
    "head-tree": ("head", "head", 3, 6, GREEDY),
    "head-tree-sampled": ("head", "head", 3, 5, SAMPLED),
    "head-adaptive": ("head-adaptive", "head", "adaptive", None, GREEDY),
    # chunked prefill (4 rows a step): prompt chunks, then trees cut to the budget
    "model-tree-chunked": ("model-chunked", "model", 3, 5, GREEDY),
    "model-tree-sampled-chunked": ("model-chunked", "model", 3, 5, SAMPLED),
    "head-tree-chunked": ("head-chunked", "head", 3, 5, GREEDY),
    # the target in the scheduler's process, its draft the scheduler's n-gram or the head's service
    "colocated-plain": ("colocated", "ngram", 0, None, GREEDY),
    "colocated-ngram-tree": ("colocated", "ngram", 4, 8, GREEDY),
    "colocated-ngram-adaptive": ("colocated-adaptive", "ngram", "adaptive", None, GREEDY),
    "colocated-head-tree-sampled": ("colocated-head", "head", 3, 5, SAMPLED),
}
CHUNKED = dict(max_batch=4, max_step_tokens=4)


@pytest.fixture(scope="module")
def schedulers(tmp_path_factory, home, stack):
    """The stack's scheduler (model draft service, fixed k), one adaptive over the same draft
    service, one adaptive drafting by n-gram in its own process, and a fixed and an adaptive one
    over a feature-head draft service, and one over an n-gram draft service (with a step log); and
    three with the target in their own process (n-gram fixed and adaptive, the head's service)."""
    root = tmp_path_factory.mktemp("identity")
    st = Stack(root, stack_env(home))
    common = ["--target", str(stack.target), "--verifier-addrs", stack.verifier_addr]
    # Adaptive, but at least one level verified a step: whether drafting pays on a loaded test
    # machine is the latency model's call, and these tests need the drafted path taken.
    adapt = ["--draft-length", "adaptive", "--min-draft-length", "1"]
    tiny.make_head(load_model(str(stack.target)), seed=5).save(root / "head")
    try:
        head = st.start("draft", "--target", str(stack.target), "--draft", str(root / "head"))
        lookup = st.start("draft", "--target", str(stack.target), "--draft", "ngram")
        adaptive = st.start("scheduler", *common, "--draft-addrs", stack.draft_addr, *adapt)
        ngram = st.start("scheduler", *common, "--draft-addrs", "local", *adapt)
        st.wait_healthy(head)
        st.wait_healthy(lookup)
        lookup_sched = st.start("scheduler", *common, "--draft-addrs", lookup.addr, "--step-log", str(root / "steps"))
        fixed_head = st.start("scheduler", *common, "--draft-addrs", head.addr)
        adaptive_head = st.start("scheduler", *common, "--draft-addrs", head.addr, *adapt)
        chunk = ["--max-batch", str(CHUNKED["max_batch"]), "--max-step-tokens", str(CHUNKED["max_step_tokens"])]
        chunked = st.start("scheduler", *common, "--draft-addrs", stack.draft_addr, *chunk)
        chunked_head = st.start("scheduler", *common, "--draft-addrs", head.addr, *chunk)
        own = ["--target", str(stack.target), "--verifier-addrs", "local"]
        metrics_port = free_port()
        colocated = st.start("scheduler", *own, "--draft-addrs", "local", "--metrics-port", str(metrics_port))
        colocated_adaptive = st.start("scheduler", *own, "--draft-addrs", "local", *adapt)
        colocated_head = st.start("scheduler", *own, "--draft-addrs", head.addr)
        for svc in (adaptive, ngram, fixed_head, adaptive_head, chunked, chunked_head, lookup_sched, colocated,
                    colocated_adaptive, colocated_head):
            st.wait_healthy(svc)
        yield {"model": stack.scheduler_addr, "model-adaptive": adaptive.addr, "ngram": ngram.addr,
               "head": fixed_head.addr, "head-adaptive": adaptive_head.addr, "model-chunked": chunked.addr,
               "head-chunked": chunked_head.addr, "ngram-service": lookup_sched.addr, "head-dir": root / "head",
               "ngram-service-log": root / "steps", "colocated": colocated.addr,
               "colocated-adaptive": colocated_adaptive.addr, "colocated-head": colocated_head.addr,
               "colocated-metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        st.stop_all()


@pytest.fixture(scope="module")
def draft_model(stack):
    return load_model(str(stack.draft)).model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_services_and_engine_give_the_same_tokens(stack, schedulers, draft_model, name):
    scheduler, draft, k, tree_size, params = CONFIGS[name]
    target = stack.engine.target
    proposer = {"model": lambda: ModelProposer(draft_model, target.config.vocab_size), "ngram": NgramProposer,
                "head": lambda: build_head_proposer(str(schedulers["head-dir"]), target)}[draft]()
    chunked = CHUNKED if scheduler.endswith("-chunked") else {}
    engine = Engine(target, proposer if k != 0 else None, StepConfig(draft_length=k, tree_size=tree_size, **chunked))
    fixed = {} if k == "adaptive" else {"draft_length": k, **({"tree_size": tree_size} if tree_size else {})}
    drafted = 0
    for i, prompt in enumerate(PROMPTS):
        got = asyncio.run(generate(schedulers[scheduler], f"{name}-{i}", prompt, fixed=fixed, **params))
        want = engine.generate([prompt], SamplingParams(**params))[0]
        assert got["token_ids"] == want.output_ids, (name, i)
        assert got["usage"].steps == want.stats.steps or k == "adaptive"  # adaptive: k follows time
        drafted += got["usage"].drafted_tokens
    assert (drafted > 0) == (k != 0)  # every speculative configuration did draft


def test_the_scheduler_asks_an_ngram_draft_service_only_where_it_can_match(schedulers):
    """The n-gram draft service says in Info that it proposes only after tokens seen before
    (min_match); the scheduler then skips its round trip where the request's last 2 are new."""
    log = schedulers["ngram-service-log"]
    seen = len(log.read_text().splitlines()) if log.exists() else 0
    prompts, outputs = [[9, 10, 11, 12], [5, 6, 7, 8, 5]], []
    for i, prompt in enumerate(prompts):
        got = asyncio.run(generate(schedulers["ngram-service"], f"lookup-{i}", prompt, fixed={"draft_length": 3},
                                   **GREEDY))
        outputs.append(got["token_ids"])
    lines = [json.loads(line) for line in log.read_text().splitlines()[seen:]]
    assert_asked_only_where_the_end_recurs(lines, prompts, outputs, GREEDY["max_tokens"])


def test_a_scheduler_that_verifies_itself_streams_while_it_decodes(schedulers):
    """Its steps never wait on a worker, so the loop yields after each one: a request arriving after
    a long one's first tokens joins its steps and finishes first (were the loop held, the long
    request's tokens would reach its client only at its end, and the short one would run alone)."""
    addr = schedulers["colocated"]

    async def run():
        started, finished = asyncio.Event(), []
        async with grpc.aio.insecure_channel(addr) as ch:
            params = common_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
            calls = scheduler_pb2_grpc.SchedulerServiceStub(ch).Generate(
                scheduler_pb2.GenerateRequest(request_id="long", prompt_ids=[9, 10, 11], params=params), timeout=120)

            async def long():
                async for ev in calls:
                    started.set()
                    if ev.finish_reason:
                        finished.append("long")

            async def short():
                await started.wait()
                await generate(addr, "short", [20, 21, 22], max_tokens=3)
                finished.append("short")

            await asyncio.gather(long(), short())
        return finished

    assert state(addr, scheduler_pb2_grpc.SchedulerServiceStub).max_batch_seen <= 1  # the other tests: one at a time
    assert asyncio.run(run()) == ["short", "long"]
    assert state(addr, scheduler_pb2_grpc.SchedulerServiceStub).max_batch_seen == 2  # they shared steps


def test_a_scheduler_that_verifies_itself_serves_the_verifier_metrics(schedulers):
    """The verifier's worker metrics (its steps, the KV it holds, its weights) are on the
    scheduler's /metrics page when the target runs in the scheduler."""
    addr = schedulers["colocated"]
    before = scrape(schedulers["colocated-metrics"])
    asyncio.run(generate(addr, "metrics", [5, 6, 7], max_tokens=8))
    after = scrape(schedulers["colocated-metrics"])
    steps = value(after, "specserve:worker_step_duration_seconds_count") - \
        value(before, "specserve:worker_step_duration_seconds_count")
    assert steps >= 2  # 8 tokens: a prefill and at least one more verifier step (k = 4)
    # the scheduler's own steps on the same page, one verifier step each
    assert value(after, "specserve:scheduler_steps_total") - value(before, "specserve:scheduler_steps_total") == steps
    assert value(after, "specserve:model_weight_bytes") > 0
    assert {"specserve:kv_cache_usage_bytes", "specserve:worker_requests"} <= {name for name, _ in after}
