"""Service settings: every option is a flag and a `SPECSERVE_*` environment variable (flags win).

One table for all four roles, so that the CLI, `make run`, docker-compose and the Kubernetes
manifests agree on names, ports and defaults (a test checks the deployment files against it).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

ROLES = ("draft", "verifier", "scheduler", "gateway")

# Default listening ports per role (gRPC; the gateway also serves HTTP).
DEFAULT_PORTS = {"gateway": 50050, "scheduler": 50051, "draft": 50052, "verifier": 50053}
DEFAULT_HTTP_PORT = 8000


@dataclass(frozen=True)
class Option:
    flag: str  # --flag-name
    env: str  # SPECSERVE_... (or a standard name such as REDIS_URL)
    default: str | None
    roles: tuple[str, ...]
    help: str


OPTIONS: tuple[Option, ...] = (
    Option("--host", "SPECSERVE_HOST", "127.0.0.1", ROLES, "address to listen on"),
    Option("--port", "SPECSERVE_PORT", None, ROLES, "gRPC port (default per role: "
           + ", ".join(f"{r} {p}" for r, p in DEFAULT_PORTS.items()) + ")"),
    Option("--http-port", "SPECSERVE_HTTP_PORT", str(DEFAULT_HTTP_PORT), ("gateway",), "HTTP port"),
    Option("--target", "SPECSERVE_TARGET", "default", ROLES,
           "target model: default, a .gguf file or a checkpoint directory"),
    Option("--draft", "SPECSERVE_DRAFT", "ngram", ("draft",), "proposer: ngram, self or a draft checkpoint path"),
    Option("--device", "SPECSERVE_DEVICE", "cpu", ("draft", "verifier"), "cpu, cuda or auto"),
    Option("--dtype", "SPECSERVE_DTYPE", "auto", ("draft", "verifier"), "auto, float32, bfloat16, float16"),
    Option("--draft-addrs", "SPECSERVE_DRAFT_ADDRS", "127.0.0.1:50052", ("scheduler",),
           "comma-separated draft replicas (host:port)"),
    Option("--verifier-addrs", "SPECSERVE_VERIFIER_ADDRS", "127.0.0.1:50053", ("scheduler",),
           "comma-separated verifier replicas (host:port)"),
    Option("--scheduler-addrs", "SPECSERVE_SCHEDULER_ADDRS", "127.0.0.1:50051", ("gateway",),
           "comma-separated scheduler replicas (host:port)"),
    Option("--draft-length", "SPECSERVE_DRAFT_LENGTH", "adaptive", ("scheduler",),
           "draft length k per step: an integer, or adaptive (chosen from Redis acceptance telemetry)"),
    Option("--max-draft-length", "SPECSERVE_MAX_DRAFT_LENGTH", "4", ("scheduler",),
           "largest k the adaptive rule may choose"),
    Option("--tree-size", "SPECSERVE_TREE_SIZE", None, ("scheduler",), "draft nodes per step (default: k, a chain)"),
    Option("--max-batch", "SPECSERVE_MAX_BATCH", "16", ("scheduler",), "requests per step"),
    Option("--redis-url", "REDIS_URL", None, ("scheduler", "gateway"),
           "Redis for telemetry and rate limits; unset = none (make run starts a local one)"),
    Option("--api-keys", "SPECSERVE_API_KEYS", None, ("gateway",), "comma-separated bearer API keys; unset = open"),
    Option("--served-model-name", "SPECSERVE_SERVED_MODEL_NAME", None, ("gateway",),
           "model id clients use; default: SmolLM2-135M-Instruct for default, else the target's basename"),
    Option("--default-max-tokens", "SPECSERVE_DEFAULT_MAX_TOKENS", "256", ("gateway",),
           "max_tokens when a request gives none"),
    Option("--log-level", "SPECSERVE_LOG_LEVEL", "INFO", ROLES, "DEBUG, INFO, WARNING, ERROR"),
    Option("--log-format", "SPECSERVE_LOG_FORMAT", "json", ROLES, "json (one object per line) or text"),
    Option("--grace-period", "SPECSERVE_GRACE_PERIOD", "30", ROLES,
           "seconds to finish in-flight work after SIGTERM"),
)


def add_role_options(parser: argparse.ArgumentParser, role: str) -> None:
    for opt in OPTIONS:
        if role in opt.roles:
            default = os.environ.get(opt.env, opt.default)
            if opt.flag == "--port" and default is None:
                default = str(DEFAULT_PORTS[role])
            parser.add_argument(opt.flag, default=default, help=f"{opt.help} [{opt.env}, default: {default}]")


def split_addrs(value: str | None) -> list[str]:
    return [a.strip() for a in (value or "").split(",") if a.strip()]
