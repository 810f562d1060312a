"""Gateway: what the HTTP app and the public gRPC servicer share.

It holds the served model's name, the target's tokenizer, the scheduler client, the
`Authenticator` and the `RateLimiter`, and turns a validated `ApiRequest` into a scheduler
`GenerateRequest` (text checks and deny patterns, tokenizing, the prompt-token limit, fitting
max_tokens into the context, then the rate limits) and a scheduler event stream into a
`Completion`. `InFlight` caps the generation requests in flight (--max-concurrent-requests).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from services.common.settings import positive_int
from services.gateway.auth import ApiKeys, Authenticator, Principal
from services.gateway.errors import ApiError
from services.gateway.openai_api import ApiRequest
from services.gateway.ratelimit import RateLimiter
from services.gateway.scheduler_client import SchedulerClient, SchedulerStream
from services.gateway.tokenization import PromptTokenizer
from services.gateway.validation import DenyPatterns, check_text, fit_max_tokens
from specserve.v1 import scheduler_pb2

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what target "default" serves
MAX_BODY_BYTES = 2 * 1024 * 1024  # --max-request-bytes
MAX_CONCURRENT_REQUESTS = 256  # --max-concurrent-requests
# ApiError codes counted as overload refusals (specserve:requests_rejected_total{reason}).
OVERLOAD_CODES = ("gateway_overloaded", "scheduler_overloaded", "scheduler_unavailable")


def served_model_name(target: str, override: str | None = None) -> str:
    """The model id clients use: the override, else the default model's name for "default",
    else the target path's basename (without a .gguf suffix)."""
    if override:
        return override
    if target == "default":
        return DEFAULT_MODEL_NAME
    path = Path(target.rstrip("/\\")).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


@dataclass
class GatewayConfig:
    model_name: str
    target: str
    default_max_tokens: int = 256
    max_body_bytes: int = MAX_BODY_BYTES  # request size limit (HTTP body, gRPC message): 413
    max_prompt_tokens: int | None = None  # None = only the context limits the prompt
    deny: DenyPatterns = field(default_factory=DenyPatterns)
    max_concurrent_requests: int = MAX_CONCURRENT_REQUESTS  # generation requests in flight: 503 beyond


def input_limits(args) -> dict:
    """GatewayConfig's input limits from the gateway options (--max-request-bytes,
    --max-prompt-tokens, --deny-patterns, --max-concurrent-requests)."""
    def positive(name: str, flag: str) -> int | None:
        return positive_int(getattr(args, name, None), flag)

    return {"max_body_bytes": positive("max_request_bytes", "--max-request-bytes") or MAX_BODY_BYTES,
            "max_prompt_tokens": positive("max_prompt_tokens", "--max-prompt-tokens"),
            "deny": DenyPatterns.from_setting(getattr(args, "deny_patterns", None)),
            "max_concurrent_requests": positive("max_concurrent_requests", "--max-concurrent-requests")
            or MAX_CONCURRENT_REQUESTS}


@dataclass
class Completion:
    """A finished generation, collected from the scheduler's events."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: scheduler_pb2.Usage
    logprobs: list | None = None  # TokenLogprob messages, one per token, when the request asked


def event_error(event: scheduler_pb2.GenerateEvent) -> ApiError:
    """The error a final event with finish_reason "error" reports."""
    return ApiError(500, f"generation failed: {event.error or 'unknown error'}", code="generation_error")


def incomplete_stream() -> ApiError:
    return ApiError(500, "the scheduler ended the stream without a finish reason",
                    code="incomplete_stream")


class Slot:
    """One request's place among those in flight: `acquire` (503 when all are taken), then
    `release` on every way out; releasing twice, or a slot never acquired, is a no-op."""

    def __init__(self, owner: "InFlight"):
        self._owner = owner
        self.held = False

    def acquire(self) -> "Slot":
        owner = self._owner
        if not self.held:
            if owner.active >= owner.limit:
                raise ApiError(503, f"this gateway is at capacity ({owner.limit} requests in flight); retry later",
                               code="gateway_overloaded", retry_after=1.0)
            owner.active += 1
            self.held = True
        return self

    def release(self) -> None:
        if self.held:
            self.held = False
            self._owner.active -= 1


class InFlight:
    """The generation requests in flight at one gateway (HTTP and gRPC together), at most `limit`,
    so that a flood of requests cannot grow the gateway's memory without bound."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"--max-concurrent-requests must be >= 1, got {limit}")
        self.limit = limit
        self.active = 0

    def slot(self) -> Slot:
        return Slot(self)


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: PromptTokenizer, scheduler: SchedulerClient,
                 auth: Authenticator | ApiKeys | None = None, limiter: RateLimiter | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.auth = auth if isinstance(auth, Authenticator) else Authenticator(auth)
        self.limiter = limiter if limiter is not None and limiter.enabled else None
        self.created = int(time.time())
        self.inflight = InFlight(config.max_concurrent_requests)
        self.rejections: Counter[str] = Counter()  # overload refusals by reason (OVERLOAD_CODES)

    def count_refusal(self, e: ApiError) -> None:
        """Count `e` if it refuses a request for overload (specserve:requests_rejected_total)."""
        if e.code in OVERLOAD_CODES:
            self.rejections[e.code] += 1

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def context_length(self) -> int:
        return self.tokenizer.context_length

    def check_model(self, model: str | None) -> None:
        """An empty or missing model means the served one; any other name is a 404."""
        if model and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    @staticmethod
    def new_request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def prompt_ids(self, req: ApiRequest) -> list[int]:
        """Token ids of the request's prompt (chat messages through the chat template), after
        the text checks and deny patterns (on each message's content, or on the decoded ids)."""
        deny = self.config.deny
        if req.messages is not None:
            for n, m in enumerate(req.messages):
                param = f"{req.prompt_param}[{n}].content"
                deny.check(check_text(m["content"], param), param)
            return self.tokenizer.encode_chat(req.messages, req.prompt_param)
        if req.prompt_ids is not None:
            ids = self.tokenizer.check_ids(req.prompt_ids, req.prompt_param)
            if deny.enabled:
                deny.check(self.tokenizer.decode(ids), req.prompt_param)
            return ids
        text = check_text(req.prompt or "", req.prompt_param)
        deny.check(text, req.prompt_param)
        return self.tokenizer.encode(text)

    def build(self, req: ApiRequest, request_id: str) -> scheduler_pb2.GenerateRequest:
        """Tokenize and check a request against the context: the scheduler's GenerateRequest."""
        self.check_model(req.model)
        ids = self.prompt_ids(req)
        limit = self.config.max_prompt_tokens
        if limit is not None and len(ids) > limit:
            raise ApiError(400, f"{req.prompt_param} has {len(ids)} tokens, more than this server's "
                           f"limit of {limit} prompt tokens", param=req.prompt_param,
                           code="prompt_too_long")
        s = req.sampling
        max_tokens = fit_max_tokens(s, len(ids), self.context_length, self.config.default_max_tokens,
                                    req.prompt_param)
        out = scheduler_pb2.GenerateRequest(request_id=request_id, prompt_ids=ids,
                                            params=s.to_proto(max_tokens), n=req.n)
        if s.draft_length is not None:
            out.draft_length = s.draft_length
        if s.tree_size is not None:
            out.tree_size = s.tree_size
        return out

    async def prepare(self, req: ApiRequest, request_id: str, principal: Principal | None
                      ) -> scheduler_pb2.GenerateRequest:
        """`build`, then charge the request to its principal's rate limits (429 when over). The
        principal is also the request's class for the scheduler's shared acceptance priors."""
        out = self.build(req, request_id)
        if principal is not None and principal.kind != "anonymous":
            out.request_class = principal.subject
        if self.limiter is not None:
            subject = principal.subject if principal is not None else "anonymous"
            await self.limiter.admit(subject, len(out.prompt_ids) + req.n * out.params.max_tokens,
                                     req.sampling.max_tokens_param)
        return out

    def stream(self, request: scheduler_pb2.GenerateRequest, timeout: float | None = None) -> SchedulerStream:
        return self.scheduler.stream(request, timeout)

    async def collect(self, request: scheduler_pb2.GenerateRequest, timeout: float | None = None
                      ) -> list[Completion]:
        """Run a request to the end (within `timeout` seconds when given): one Completion per
        sample; cancelled (also on the scheduler) if this task is."""
        n = max(1, request.n)
        text: list[list[str]] = [[] for _ in range(n)]
        ids: list[list[int]] = [[] for _ in range(n)]
        logprobs = [[] if request.params.HasField("logprobs") else None for _ in range(n)]
        done: dict[int, Completion] = {}
        async with self.scheduler.stream(request, timeout) as events:
            async for event in events:
                i = event.index
                text[i].append(event.text)
                ids[i].extend(event.token_ids)
                if logprobs[i] is not None:
                    logprobs[i].extend(event.logprobs)
                if event.finish_reason == "error":
                    raise event_error(event)
                if event.finish_reason:
                    done[i] = Completion("".join(text[i]), ids[i], event.finish_reason, event.usage, logprobs[i])
                    if len(done) == n:
                        return [done[j] for j in range(n)]
        raise incomplete_stream()

    async def healthy(self) -> bool:
        return await self.scheduler.healthy()
