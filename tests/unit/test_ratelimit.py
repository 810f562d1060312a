"""RateLimiter against a real redis-server: exact at the boundary, atomic across clients, both
limits in one decision, Retry-After honoured, EVALSHA fallback, failing open or closed; and the
429s of the HTTP app and the public gRPC API."""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc
import httpx
import pytest
import redis

from services.gateway.app import create_app
from services.gateway.auth import ApiKeys, Authenticator
from services.gateway.errors import ApiError
from services.gateway.ratelimit import GCRA_SHA, Rate, RateLimiter
from tests.unit.test_gateway_http import KEY, make_gateway
from tests.unit.test_gateway_scheduler_client import running_fake

DEAD_REDIS = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def subject() -> str:
    return f"key:{uuid.uuid4().hex}"  # a fresh bucket per test


async def outcomes(limiter: RateLimiter, who: str, costs: list[int]) -> list[str | None]:
    """None for each admitted request, else the refusal's code."""
    out = []
    for cost in costs:
        try:
            await limiter.admit(who, cost)
            out.append(None)
        except ApiError as e:
            out.append(e.code)
    return out


def with_limiter(url: str, requests: str | None, tokens: str | None, scenario, **kw):
    async def go():
        limiter = RateLimiter.from_url(url, Rate.parse(requests, "--rate-limit"),
                                       Rate.parse(tokens, "--token-limit"), **kw)
        try:
            return await scenario(limiter)
        finally:
            await limiter.close()
    return asyncio.run(go())


def test_rate_parsing():
    assert Rate.parse("10/s", "x") == Rate(10, 1.0, "10/s")
    assert Rate.parse("20000/m", "x").period == 60.0 and Rate.parse("5/10s", "x").period == 10.0
    assert Rate.parse("100 / hour", "x").period == 3600.0 and Rate.parse("1/1.5s", "x").period == 1.5
    assert Rate.parse(None, "x") is None and Rate.parse("off", "x") is None and Rate.parse("", "x") is None
    for bad in ("10", "ten/s", "10/fortnight", "-1/s", "10/0s"):
        with pytest.raises(ValueError, match="--rate-limit"):
            Rate.parse(bad, "--rate-limit")


def test_requests_exact_at_the_boundary(redis_url):
    async def s(limiter):
        who = subject()
        got = await outcomes(limiter, who, [1] * 6)
        with pytest.raises(ApiError) as e:
            await limiter.admit(who, 1)
        return got, e.value, limiter.rejections
    got, err, rejections = with_limiter(redis_url, "5/m", None, s)
    assert got == [None] * 5 + ["rate_limit_requests"]  # 5 pass, the 6th is refused
    assert err.status == 429 and err.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert 11.0 < err.retry_after <= 12.0  # one emission interval: 60 s / 5
    assert err.headers()["Retry-After"] == "12" and "5 requests per minute" in err.message
    assert rejections == {"requests": 2}


def test_tokens_exact_at_the_boundary_and_both_limits_in_one_decision(redis_url):
    async def s(limiter):
        who = subject()
        return await outcomes(limiter, who, [30, 30, 30, 11, 10, 1])
    # 90 tokens spent; 11 more would be 101 > 100; exactly 100 passes; then nothing is left
    assert with_limiter(redis_url, None, "100/h", s) == [None, None, None, "rate_limit_tokens", None,
                                                         "rate_limit_tokens"]

    async def both(limiter):
        who = subject()
        # the second request is refused for tokens and so is not counted as a request either
        return await outcomes(limiter, who, [60, 60, 30, 1])  # the last one fits the tokens left
    assert with_limiter(redis_url, "2/m", "100/h", both) == [None, "rate_limit_tokens", None,
                                                             "rate_limit_requests"]


def test_a_request_larger_than_the_token_limit_is_refused_without_retry_after(redis_url):
    async def s(limiter):
        with pytest.raises(ApiError) as e:
            await limiter.admit(subject(), 101, "max_completion_tokens")
        return e.value
    e = with_limiter(redis_url, None, "100/m", s)
    assert e.status == 429 and e.code == "tokens_exceed_limit" and e.retry_after is None
    assert e.param == "max_completion_tokens" and "101" in e.message and e.headers() is None


def test_retry_after_is_honoured(redis_url):
    async def s(limiter):
        who = subject()
        first = await outcomes(limiter, who, [1, 1, 1])
        with pytest.raises(ApiError) as e:
            await limiter.admit(who, 1)
        await asyncio.sleep(e.value.retry_after)
        after = await outcomes(limiter, who, [1, 1])
        return first, e.value.retry_after, after
    first, wait, after = with_limiter(redis_url, "2/4s", None, s)  # a burst of 2, then one per 2 s
    assert first == [None, None, "rate_limit_requests"] and 0 < wait <= 2.0
    assert after == [None, "rate_limit_requests"]  # one request per emission interval after the burst


def test_limits_are_shared_by_clients_and_atomic_under_concurrency(redis_url):
    """Four limiters (four connection pools, like four gateway replicas) admit 40 requests at once
    against 10/h: exactly 10 pass."""
    who = subject()

    async def go():
        limiters = [RateLimiter.from_url(redis_url, Rate.parse("10/h", "x"), None) for _ in range(4)]

        async def one(limiter):
            try:
                await limiter.admit(who, 1)
                return True
            except ApiError:
                return False
        try:
            return await asyncio.gather(*(one(limiters[i % 4]) for i in range(40)))
        finally:
            for limiter in limiters:
                await limiter.close()
    assert sum(asyncio.run(go())) == 10


def test_subjects_have_separate_buckets_in_hash_tagged_keys(redis_url):
    a, b = subject(), subject()

    async def s(limiter):
        return await outcomes(limiter, a, [1, 1]), await outcomes(limiter, b, [1]), limiter.keys(a)
    got_a, got_b, keys = with_limiter(redis_url, "1/m", "50/m", s)
    assert got_a == [None, "rate_limit_requests"] and got_b == [None]
    assert keys == {"requests": f"specserve:ratelimit:{{{a}}}:requests",
                    "tokens": f"specserve:ratelimit:{{{a}}}:tokens"}
    r = redis.Redis.from_url(redis_url)
    assert r.exists(keys["requests"]) and r.exists(keys["tokens"])
    assert 0 < r.pttl(keys["requests"]) <= 60_001  # buckets expire once full again


def test_script_is_loaded_with_eval_when_redis_lacks_it(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.script_flush()
    assert r.script_exists(GCRA_SHA) == [False]

    async def s(limiter):
        return await outcomes(limiter, subject(), [1, 1])
    assert with_limiter(redis_url, "1/m", None, s) == [None, "rate_limit_requests"]
    assert r.script_exists(GCRA_SHA) == [True]


def test_redis_down_fails_open_counts_and_logs_once(caplog):
    async def s(limiter):
        got = await outcomes(limiter, subject(), [1, 1, 1])
        return got, limiter.redis_errors, limiter.unchecked
    with caplog.at_level(logging.WARNING, logger="services.gateway.ratelimit"):
        got, errors, unchecked = with_limiter(DEAD_REDIS, "1/m", None, s, backoff=60.0)
    assert got == [None, None, None]  # no limit without Redis, but no refusal either
    assert errors == 1 and unchecked == 3  # Redis is not asked again during the backoff
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "failing open" in warnings[0].getMessage()


def test_redis_down_fails_closed_when_configured():
    async def s(limiter):
        with pytest.raises(ApiError) as e:
            await limiter.admit(subject(), 1)
        return e.value, limiter.redis_errors
    e, errors = with_limiter(DEAD_REDIS, "1/m", None, s, fail_closed=True)
    assert e.status == 503 and e.code == "rate_limiter_unavailable" and e.retry_after == 1.0
    assert errors == 1


def test_from_args():
    class Args:
        rate_limit, token_limit, rate_limit_on_redis_error, redis_url = "10/s", None, "closed", DEAD_REDIS
    limiter = RateLimiter.from_args(Args)
    assert limiter.fail_closed and limiter.requests == Rate(10, 1.0, "10/s") and limiter.tokens is None
    asyncio.run(limiter.close())
    Args.redis_url = None
    with pytest.raises(ValueError, match="set --redis-url"):
        RateLimiter.from_args(Args)
    Args.rate_limit_on_redis_error = "sometimes"
    with pytest.raises(ValueError, match="--rate-limit-on-redis-error must be open or closed"):
        RateLimiter.from_args(Args)
    Args.rate_limit = None
    assert RateLimiter.from_args(Args) is None  # no limits: no Redis needed


# --- the APIs -----------------------------------------------------------------------------------


def test_http_429_with_retry_after_never_reaches_the_scheduler(redis_url):
    async def go():
        async with running_fake() as (fake, addr):
            gw = make_gateway([addr], keys=[KEY])
            gw.limiter = RateLimiter.from_url(redis_url, Rate.parse("2/m", "x"), Rate.parse("1000/m", "x"))
            transport = httpx.ASGITransport(app=create_app(gw))
            headers = {"Authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                r = redis.Redis.from_url(redis_url)
                for key in r.scan_iter("specserve:ratelimit:*"):
                    r.delete(key)
                out = [await client.post("/v1/completions", json={"prompt": "w5 w6", "max_tokens": 3},
                                         headers=headers) for _ in range(3)]
                out.append(await client.post("/v1/completions", json={"prompt": "w5", "max_tokens": 9},
                                             headers=headers))
            keys = [k.decode() for k in r.scan_iter("specserve:ratelimit:*")]
            await gw.limiter.close()
            await gw.scheduler.close()
            return out, len(fake.requests), keys
    (ok1, ok2, limited, limited2), n, keys = asyncio.run(go())
    assert ok1.status_code == 200 and ok2.status_code == 200 and n == 2
    for r in (limited, limited2):
        assert r.status_code == 429 and int(r.headers["retry-after"]) in (29, 30)
        e = r.json()["error"]
        assert e["type"] == "rate_limit_error" and e["code"] == "rate_limit_requests"
    assert KEY not in "".join(keys) and all("key:" in k for k in keys)  # keyed by the key's digest


def test_grpc_resource_exhausted_with_retry_after_metadata(redis_url):
    from tests.unit.test_gateway_grpc import public_api, text_request

    async def go():
        async with public_api() as (stub, fake, servicer):
            servicer.gateway.limiter = RateLimiter.from_url(redis_url, None, Rate.parse("40/h", "x"))
            servicer.gateway.auth = Authenticator(ApiKeys([KEY + "-grpc"]))
            md = (("authorization", f"Bearer {KEY}-grpc"),)
            out = []
            for max_tokens in (30, 7, 6):  # prompt "w5 w6" is 2 tokens: 32, then 9 > 8 left, then 8
                try:
                    await stub.Generate(text_request(max_tokens=max_tokens), metadata=md, timeout=10)
                    out.append("ok")
                except grpc.aio.AioRpcError as e:
                    out.append((e.code(), e.details(), dict(e.trailing_metadata() or ())))
            await servicer.gateway.limiter.close()
            return out, len(fake.requests)
    (ok, (code, details, md), last), n = asyncio.run(go())
    assert ok == "ok" and last == "ok" and n == 2  # the refused one never reached the scheduler
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "40 tokens per hour" in details
    assert 80 <= int(md["retry-after"]) <= 90  # 1 token too many: 90 s at 40 tokens per hour
