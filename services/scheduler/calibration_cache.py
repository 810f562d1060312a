"""The warm-up's fitted latency model, cached under `$SPECSERVE_HOME/calibration/` so that the
next start on the same machine reuses it (and goes on refining it online) instead of measuring
again.

Keyed by what decides the costs it measured: the model pair, the verifier's matmul route step,
the native matmul route asked for, the sizes measured (the deepest draft and the tree width), the
machine (CPU model, cores, this process's torch threads) and the code (a digest of the sources
under services/). With remote
workers the machine is this scheduler's: the key assumes the workers run on the same kind of
machine (as `make run` starts them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from functools import lru_cache
from pathlib import Path

from services.common.loading import specserve_home
from services.common.machine import cpu_model
from services.common.quant import HEAD_WEIGHTS_ENV, ROUTE_ENV

log = logging.getLogger(__name__)

SOURCES = Path(__file__).resolve().parents[1]  # services/


@lru_cache(maxsize=1)
def code_version() -> str:
    """A digest of every source of the services (Python and the CPU kernels' C++): any change
    measures afresh."""
    digest = hashlib.sha256()
    for path in sorted([*SOURCES.rglob("*.py"), *SOURCES.rglob("*.cpp"), *SOURCES.rglob("*.h")]):
        digest.update(str(path.relative_to(SOURCES)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cache_key(pair: str, route_rows: int, max_k: int, width: int) -> dict:
    import torch  # only for its thread count (this module is used by the scheduler, not the policy)

    return {"pair": pair, "route_rows": route_rows, "max_k": max_k, "width": width, "cpu": cpu_model(),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "code": code_version(),
            "native_matmul": os.environ.get(ROUTE_ENV, "auto"), "head_weights": os.environ.get(HEAD_WEIGHTS_ENV, "auto")}


def _path(key: dict) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return specserve_home() / "calibration" / f"{name}.json"


def load(key: dict) -> dict | None:
    """The cached latency state for `key`, or None (missing, unreadable, or another key's)."""
    path = _path(key)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry.get("latency") if entry.get("key") == key else None


def save(key: dict, latency_state: dict) -> None:
    """Write atomically (a concurrent start reads the old file or the new one); a cache that
    cannot be written costs only the next start's warm-up."""
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "latency": latency_state}))
        tmp.replace(path)
    except OSError as e:
        log.warning("warm-up: could not cache the calibration in %s (%s)", path, e)
