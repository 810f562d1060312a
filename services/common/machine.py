"""What machine this is, where caches and records must say so."""

from __future__ import annotations

import platform
from pathlib import Path


def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in Linux's /proc/cpuinfo; None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what platform knows of it."""
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "unknown cpu"


def cpu_flags() -> str:
    """The CPU's instruction-set flags as /proc/cpuinfo lists them ("" where it does not)."""
    return _cpuinfo("flags") or ""
