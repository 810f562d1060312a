"""Service settings: every option is a flag and a `SPECSERVE_*` environment variable (flags win).

One table for all four roles, so that the CLI, `make run`, docker-compose and the Kubernetes
manifests agree on names, ports and defaults (a test checks the deployment files against it).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

ROLES = ("draft", "verifier", "scheduler", "gateway")

# Roles that load a model: the scheduler does when it verifies itself (--verifier-addrs local).
MODEL_ROLES = ("draft", "verifier", "scheduler")

# native: a GGUF model's quantized blocks as stored (CPU); float32: dequantized at load (into --dtype)
WEIGHT_FORMATS = ("native", "float32")

# Default listening ports per role (gRPC; the gateway also serves HTTP).
DEFAULT_PORTS = {"gateway": 50050, "scheduler": 50051, "draft": 50052, "verifier": 50053}
DEFAULT_HTTP_PORT = 8000
# Prometheus /metrics port per role (the gateway serves /metrics on its HTTP port instead).
DEFAULT_METRICS_PORTS = {"scheduler": 9101, "draft": 9102, "verifier": 9103}


@dataclass(frozen=True)
class Option:
    flag: str  # --flag-name
    env: str  # SPECSERVE_... (or a standard name such as REDIS_URL)
    default: str | None
    roles: tuple[str, ...]
    help: str
    secret: bool = False  # never shown in --help (API keys, JWT secret)


OPTIONS: tuple[Option, ...] = (
    Option("--host", "SPECSERVE_HOST", "127.0.0.1", ROLES, "address to listen on"),
    Option("--port", "SPECSERVE_PORT", None, ROLES, "gRPC port (default per role: "
           + ", ".join(f"{r} {p}" for r, p in DEFAULT_PORTS.items()) + ")"),
    Option("--http-port", "SPECSERVE_HTTP_PORT", str(DEFAULT_HTTP_PORT), ("gateway",), "HTTP port"),
    Option("--target", "SPECSERVE_TARGET", "default", ROLES,
           "target model: default, a .gguf file or a checkpoint directory"),
    Option("--draft", "SPECSERVE_DRAFT", "ngram", ("draft",),
           "proposer: ngram, default (the committed distilled draft of the default target), self or a "
           "draft checkpoint path"),
    Option("--compression-ratio", "SPECSERVE_COMPRESSION_RATIO", "0.2", ("draft",),
           "SlimSpec: fraction of the vocabulary the draft's LM head keeps (0.1 to 0.5; 1.0 = full head)"),
    Option("--slim-guard-points", "SPECSERVE_SLIM_GUARD_POINTS", "5", ("draft",),
           "SlimSpec guard: switch to the full head when the slim head's rolling acceptance rate falls "
           "more than this many percentage points below the full head's calibrated rate"),
    Option("--device", "SPECSERVE_DEVICE", "cpu", MODEL_ROLES, "cpu, cuda or auto"),
    Option("--dtype", "SPECSERVE_DTYPE", "auto", MODEL_ROLES, "auto, float32, bfloat16, float16"),
    Option("--threads", "SPECSERVE_THREADS", "auto", MODEL_ROLES,
           "torch CPU threads: a number, or auto: 1 for the draft (its forwards are small, and the idle "
           "OpenMP workers of a second thread team spin on the cores the verifier's forward needs), "
           "one per core for the verifier (and a scheduler that verifies itself: --verifier-addrs local)"),
    Option("--weights", "SPECSERVE_WEIGHTS", "native", MODEL_ROLES,
           "native: a GGUF model's Q4_0/Q4_1/Q8_0 weights run as stored (int4 matmul, CPU); float32: "
           "dequantized at load"),
    Option("--draft-addrs", "SPECSERVE_DRAFT_ADDRS", "127.0.0.1:50052", ("scheduler",),
           "comma-separated draft replicas (host:port), or local: n-gram drafting inside the scheduler "
           "(no draft service, no draft hop)"),
    Option("--verifier-addrs", "SPECSERVE_VERIFIER_ADDRS", "127.0.0.1:50053", ("scheduler",),
           "comma-separated verifier replicas (host:port), or local: the target in the scheduler's process, "
           "stepped on its event loop (no verifier service, no verify hop; --device, --dtype, --weights and "
           "--threads apply to it; --max-step-tokens bounds how long a step holds the loop)"),
    Option("--scheduler-addrs", "SPECSERVE_SCHEDULER_ADDRS", "127.0.0.1:50051", ("gateway",),
           "comma-separated scheduler replicas (host:port)"),
    Option("--draft-length", "SPECSERVE_DRAFT_LENGTH", "adaptive", ("scheduler",),
           "draft length k per step: an integer, or adaptive (per request and step, from acceptance telemetry in Redis and a latency model)"),
    Option("--min-draft-length", "SPECSERVE_MIN_DRAFT_LENGTH", "0", ("scheduler",),
           "smallest k adaptive may choose (0 = it may decode plainly)"),
    Option("--max-draft-length", "SPECSERVE_MAX_DRAFT_LENGTH", "16", ("scheduler",),
           "largest k adaptive may choose"),
    Option("--adjust-interval-ms", "SPECSERVE_ADJUST_INTERVAL_MS", "0", ("scheduler",),
           "adaptive re-plans the draft lengths at most this often (0 = every step)"),
    Option("--rejection-alert", "SPECSERVE_REJECTION_ALERT", "0.85", ("scheduler",),
           "log a warning when more than this share of recent draft tokens is rejected"),
    Option("--tree-size", "SPECSERVE_TREE_SIZE", None, ("scheduler",), "draft nodes per step (default: k, a chain)"),
    Option("--max-batch", "SPECSERVE_MAX_BATCH", "16", ("scheduler",), "requests per step"),
    Option("--kv-budget-tokens", "SPECSERVE_KV_BUDGET_TOKENS", "65536", ("scheduler",),
           "KV tokens the running requests may reserve in all, each prompt + max_tokens + one draft tree "
           "(65536 = about 3 GB of fp32 KV for the default target); requests wait for room, first come first served"),
    Option("--max-waiting", "SPECSERVE_MAX_WAITING", "64", ("scheduler",),
           "requests that may wait for a batch slot or KV room; beyond, 429 with Retry-After"),
    Option("--max-step-tokens", "SPECSERVE_MAX_STEP_TOKENS", "0", ("scheduler",),
           "rows one verify forward may take (decode and draft-tree rows first, then prompt chunks; at "
           "least --max-batch); 0 = no row limit"),
    Option("--target-itl-ms", "SPECSERVE_TARGET_ITL_MS", "200", ("scheduler",),
           "while requests decode, a step takes the prompt tokens (chunked prefill) its predicted time has room "
           "for within this inter-token latency; 0 = prompts join whole"),
    Option("--step-log", "SPECSERVE_STEP_LOG", None, ("scheduler",),
           "append one JSON line per step to this file: its ms drafting and verifying, batch, plan, outcomes"),
    Option("--redis-url", "REDIS_URL", None, ("scheduler", "gateway"),
           "Redis for telemetry and rate limits; unset = none (make run starts a local one)"),
    Option("--api-keys", "SPECSERVE_API_KEYS", None, ("gateway",), "comma-separated bearer API keys; unset = open",
           secret=True),
    Option("--jwt-secret", "SPECSERVE_JWT_SECRET", None, ("gateway",),
           "accept HS256 JWT bearer tokens signed with this secret (at least 32 bytes)", secret=True),
    Option("--jwt-public-key", "SPECSERVE_JWT_PUBLIC_KEY", None, ("gateway",),
           "accept RS256 JWT bearer tokens signed for this RSA public key (PEM text or a file path)"),
    Option("--jwt-audience", "SPECSERVE_JWT_AUDIENCE", None, ("gateway",),
           "required JWT aud; unset = tokens naming an audience are refused"),
    Option("--jwt-issuer", "SPECSERVE_JWT_ISSUER", None, ("gateway",), "required JWT iss; unset = not checked"),
    Option("--jwt-leeway", "SPECSERVE_JWT_LEEWAY", "0", ("gateway",), "seconds of clock skew allowed on exp and nbf"),
    Option("--ip-allowlist", "SPECSERVE_IP_ALLOWLIST", None, ("gateway",),
           "comma-separated client networks (CIDRs) allowed to call; unset = any (403 otherwise)"),
    Option("--auth-metrics", "SPECSERVE_AUTH_METRICS", "false", ("gateway",),
           "true: /health and /metrics need credentials too"),
    Option("--rate-limit", "SPECSERVE_RATE_LIMIT", None, ("gateway",),
           "requests per key or token subject, e.g. 10/s, 600/m, 5/10s (Redis); unset = none"),
    Option("--token-limit", "SPECSERVE_TOKEN_LIMIT", None, ("gateway",),
           "prompt + max_tokens per key or token subject, e.g. 20000/m (Redis); unset = none"),
    Option("--rate-limit-on-redis-error", "SPECSERVE_RATE_LIMIT_ON_REDIS_ERROR", "open", ("gateway",),
           "open (admit unchecked) or closed (503) while Redis is unreachable"),
    Option("--deny-patterns", "SPECSERVE_DENY_PATTERNS", None, ("gateway",),
           "regular expressions refusing a prompt, one per line, or @FILE"),
    Option("--max-request-bytes", "SPECSERVE_MAX_REQUEST_BYTES", "2097152", ("gateway",),
           "largest HTTP body or gRPC request (413 beyond)"),
    Option("--max-prompt-tokens", "SPECSERVE_MAX_PROMPT_TOKENS", None, ("gateway",),
           "largest prompt in tokens; unset = the model's context"),
    Option("--served-model-name", "SPECSERVE_SERVED_MODEL_NAME", None, ("gateway",),
           "model id clients use; default: SmolLM2-135M-Instruct for default, else the target's basename"),
    Option("--max-concurrent-requests", "SPECSERVE_MAX_CONCURRENT_REQUESTS", "256", ("gateway",),
           "generation requests in flight per gateway (HTTP and gRPC together); beyond, 503 with Retry-After"),
    Option("--default-max-tokens", "SPECSERVE_DEFAULT_MAX_TOKENS", "256", ("gateway",),
           "max_tokens when a request gives none"),
    Option("--tls-cert", "SPECSERVE_TLS_CERT", None, ROLES,
           "PEM certificate (chain) served on this role's listeners (gRPC; on the gateway HTTPS too) and "
           "presented as its client certificate on internal calls; reloaded when it changes or on SIGHUP; "
           "unset = plain text"),
    Option("--tls-key", "SPECSERVE_TLS_KEY", None, ROLES, "PEM private key of --tls-cert"),
    Option("--tls-ca", "SPECSERVE_TLS_CA", None, ROLES,
           "PEM CA of the internal services: mutual TLS between them (internal listeners require client "
           "certificates it signed, internal calls verify the server with it); the gateway's public "
           "listeners never ask for client certificates"),
    Option("--log-level", "SPECSERVE_LOG_LEVEL", "INFO", ROLES, "DEBUG, INFO, WARNING, ERROR"),
    Option("--log-format", "SPECSERVE_LOG_FORMAT", "json", ROLES, "json (one object per line) or text"),
    Option("--grace-period", "SPECSERVE_GRACE_PERIOD", "30", ROLES,
           "seconds to finish in-flight work after SIGTERM"),
    Option("--metrics-port", "SPECSERVE_METRICS_PORT", None, tuple(DEFAULT_METRICS_PORTS),
           "Prometheus GET /metrics port; 0 = off (default per role: "
           + ", ".join(f"{r} {p}" for r, p in DEFAULT_METRICS_PORTS.items()) + ")"),
)


def add_role_options(parser: argparse.ArgumentParser, role: str) -> None:
    for opt in OPTIONS:
        if role in opt.roles:
            default = os.environ.get(opt.env, opt.default)
            if opt.flag == "--port" and default is None:
                default = str(DEFAULT_PORTS[role])
            if opt.flag == "--metrics-port" and default is None:
                default = str(DEFAULT_METRICS_PORTS[role])
            shown = ("(set)" if default else None) if opt.secret else default
            parser.add_argument(opt.flag, default=default, help=f"{opt.help} [{opt.env}, default: {shown}]")


def split_addrs(value: str | None) -> list[str]:
    return [a.strip() for a in (value or "").split(",") if a.strip()]


def positive_int(value: str | None, flag: str) -> int | None:
    """An option's positive integer, None when unset; a ValueError naming the flag otherwise."""
    if value in (None, ""):
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    return number
