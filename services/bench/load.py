"""The load test: streamed requests against a running gateway over HTTP, at several concurrency
levels (closed loop: `concurrency` clients, each sending its next request when the last ends).

Per request: time to first token (TTFT: until the first chunk carrying a token), end-to-end
latency, output tokens, and the gap before each later chunk with its token count (a speculative
step can commit several tokens in one chunk). Inter-token latency (ITL) is per token: a gap of g
seconds before a chunk of n tokens counts n times as g / n. Per level: requests/s and output
tokens/s (median over repeats), P50 and P99 of TTFT, ITL and end-to-end latency over every
successful request, and errors.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from services.bench.stats import median, percentile

DEFAULT_PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about a lighthouse.",
    "List five uses of a paperclip, one per line.",
    "Summarize the plot of a detective story you invent, in one paragraph.",
)
WARMUP_TOKENS = 8


@dataclass
class LoadSettings:
    url: str
    concurrency: list[int]
    requests: int  # per level and repeat
    max_tokens: int
    temperature: float = 0.0
    endpoint: str = "chat"  # chat (/v1/chat/completions) or completions (/v1/completions)
    model: str | None = None  # None: the first model of GET /v1/models
    api_key: str | None = None
    repeats: int = 1
    timeout_s: float = 600.0
    ignore_eos: bool = False
    prompts: str = "built-in prompts"  # where the prompts came from, for the report

    def validate(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency must be positive integers, got {self.concurrency}")
        if self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"--endpoint must be chat or completions, got {self.endpoint!r}")


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    tokens: int = 0
    chunk_gaps_s: list[float] = field(default_factory=list)  # before each chunk after the first
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks


def parse_concurrency(text: str) -> list[int]:
    try:
        levels = [int(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--concurrency: expected comma-separated integers, got {text!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"--concurrency: expected positive integers, got {text!r}")
    return levels


def chunk_tokens(chunk: dict) -> int:
    """Output tokens carried by one stream chunk: its token ids when present (return_token_ids),
    else 1 for a chunk with text."""
    n = 0
    for choice in chunk.get("choices") or []:
        if "token_ids" in choice:
            n += len(choice["token_ids"] or [])
        else:
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            n += 1 if text else 0
    return n


def _body(settings: LoadSettings, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": settings.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    if settings.ignore_eos:
        body["ignore_eos"] = True
    if settings.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _error_message(status: int, raw: bytes) -> str:
    try:
        return f"HTTP {status}: {json.loads(raw)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {raw[:200].decode(errors='replace')}"


async def stream_one(client: httpx.AsyncClient, settings: LoadSettings, model: str, prompt: str,
                     max_tokens: int | None = None) -> RequestResult:
    """Send one streamed request and time it; failures come back as a result with ok=False."""
    path = "/v1/chat/completions" if settings.endpoint == "chat" else "/v1/completions"
    res = RequestResult(ok=False)
    started = time.perf_counter()
    last = None
    usage_tokens, done = None, False
    try:
        async with client.stream("POST", settings.url.rstrip("/") + path,
                                 json=_body(settings, model, prompt, max_tokens or settings.max_tokens)) as resp:
            if resp.status_code != 200:
                res.error = _error_message(resp.status_code, await resp.aread())
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    res.error = f"error in stream: {chunk['error'].get('message')}"
                    return res
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                n = chunk_tokens(chunk)
                if not n:
                    continue
                now = time.perf_counter()
                if res.ttft_s is None:
                    res.ttft_s = now - started
                else:
                    res.chunk_gaps_s.append(now - last)
                    res.chunk_tokens.append(n)
                res.tokens += n
                last = now
    except (httpx.HTTPError, ValueError) as e:  # refused, reset, timed out, or a broken chunk
        res.error = f"{type(e).__name__}: {e}"
        return res
    finally:
        res.e2e_s = time.perf_counter() - started
    if not done:
        res.error = "the stream ended without data: [DONE]"
        return res
    if usage_tokens is not None:
        res.tokens = usage_tokens
    res.ok = True
    return res


async def run_level(client: httpx.AsyncClient, settings: LoadSettings, model: str, prompts: list[str],
                    concurrency: int, bar=None) -> tuple[float, list[RequestResult]]:
    """`settings.requests` requests by `concurrency` clients; (wall seconds, results in send order)."""
    next_index = 0
    results: list[RequestResult | None] = [None] * settings.requests

    async def client_loop():
        nonlocal next_index
        while next_index < settings.requests:
            i = next_index
            next_index += 1
            results[i] = await stream_one(client, settings, model, prompts[i % len(prompts)])
            if bar is not None:
                bar.update(1)

    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(min(concurrency, settings.requests))))
    return time.perf_counter() - t0, [r for r in results if r is not None]


async def wait_healthy(url: str, wait_s: float, alive: Callable[[], bool] | None = None) -> None:
    """Poll GET /health until it answers 200, for at most wait_s seconds; with `alive` (is the
    process serving it still running?), give up as soon as it says no."""
    deadline = time.monotonic() + wait_s
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            try:
                if (await client.get(url.rstrip("/") + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if alive is not None and not alive():
                raise RuntimeError(f"the process serving {url} exited before GET /health answered")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway at {url} did not answer GET /health within {wait_s:g} s")
            await asyncio.sleep(0.5)


async def served_model(client: httpx.AsyncClient, url: str) -> str:
    r = await client.get(url.rstrip("/") + "/v1/models")
    if r.status_code != 200:
        raise RuntimeError(f"GET {url}/v1/models: {_error_message(r.status_code, r.content)} (pass --model)")
    return r.json()["data"][0]["id"]


async def run_load(settings: LoadSettings, prompts: list[str], progress: bool = True) -> dict:
    """Warm up with one short request, then run every level `repeats` times (levels in a rotating
    order per repeat); the result as a JSON-ready dict."""
    settings.validate()
    if not prompts:
        raise ValueError("the load test needs at least one prompt")
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    limits = httpx.Limits(max_connections=max(settings.concurrency) + 4,
                          max_keepalive_connections=max(settings.concurrency) + 4)
    from tqdm import tqdm

    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(settings.timeout_s)) as client:
        try:
            model = settings.model or await served_model(client, settings.url)
        except httpx.ConnectError as e:
            raise RuntimeError(f"cannot connect to the gateway at {settings.url}: {e}") from None
        warmup = await stream_one(client, settings, model, prompts[0], min(WARMUP_TOKENS, settings.max_tokens))
        if not warmup.ok and warmup.error.startswith("ConnectError"):
            raise RuntimeError(f"cannot connect to the gateway at {settings.url}: {warmup.error}")
        raw: dict[int, list[tuple[float, list[RequestResult]]]] = {c: [] for c in settings.concurrency}
        total = settings.requests * len(settings.concurrency) * settings.repeats
        with tqdm(total=total, desc="bench load", unit="req", file=sys.stderr, disable=not progress,
                  dynamic_ncols=True) as bar:
            for rep in range(settings.repeats):
                shift = rep % len(settings.concurrency)
                for c in settings.concurrency[shift:] + settings.concurrency[:shift]:
                    bar.set_postfix_str(f"repeat {rep + 1} concurrency {c}", refresh=False)
                    raw[c].append(await run_level(client, settings, model, prompts, c, bar))
    return {
        "kind": "load",
        "settings": {**asdict(settings), "model": model, "api_key": "set" if settings.api_key else None},
        "warmup": asdict(warmup),
        "levels": [{"concurrency": c,
                    "repeats": [{"wall_s": wall, "requests": [asdict(r) for r in rs]} for wall, rs in raw[c]],
                    "summary": summarize_level(raw[c])} for c in settings.concurrency],
    }


def summarize_level(repeats: list[tuple[float, list[RequestResult]]]) -> dict:
    ok = [r for _, rs in repeats for r in rs if r.ok]
    failed = [r for _, rs in repeats for r in rs if not r.ok]
    itl = [g / n for r in ok for g, n in zip(r.chunk_gaps_s, r.chunk_tokens) for _ in range(n)]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok]
    return {
        "requests": len(ok) + len(failed),
        "completed": len(ok),
        "errors": len(failed),
        "error_examples": list(dict.fromkeys(r.error for r in failed))[:3],
        "output_tokens": sum(r.tokens for r in ok),
        "requests_per_s": median([sum(r.ok for r in rs) / wall for wall, rs in repeats if wall > 0]),
        "output_tokens_per_s": median([sum(r.tokens for r in rs if r.ok) / wall for wall, rs in repeats if wall > 0]),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
        "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
    }
