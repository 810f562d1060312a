"""The project's CPU kernels: built for this machine, then loaded.

`qmatmul.cpp` (the float32 block matmul), `q8matmul.cpp` (4-bit tiles by int8 rows), `rowwise.cpp`
(RMSNorm, RoPE, silu * up), `attention.cpp` (the rows that yield tokens, over their KV caches),
`layers.cpp` (a native model's decoder stack through all of them, in one call) and `head.cpp` (the
feature head's draft forward likewise); `simd.h` and `cpu_ops.h` are shared. The sources compile
once per machine into one library (g++ -march=native: the matmul needs AVX2, FMA and F16C; OpenMP
through torch's own runtime, so its threads are torch's) against the installed torch, under
`$SPECSERVE_HOME/build/` with a name keyed by the sources, torch's version and the CPU's flags.
`make setup` builds it, a first load otherwise does (about 30 s). Without a compiler or those
instructions `available()` is False: native weights take torch's int4 route and the layers
torch's own ops.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
from pathlib import Path

import torch
from torch.utils import cpp_extension

from services.common.machine import cpu_flags

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# Their ops register under torch.ops.specserve_q.
SOURCES = [HERE / f"{name}.cpp" for name in ("qmatmul", "q8matmul", "rowwise", "attention", "layers", "head")]
HEADERS = [HERE / "simd.h", HERE / "cpu_ops.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]

_LOADED: bool | None = None


def library_path() -> Path:
    """Where this machine's build lives: the name changes with the sources, torch and the CPU."""
    from services.common.loading import specserve_home

    key = hashlib.sha256()
    parts = [s.read_bytes() for s in SOURCES + HEADERS]
    parts += [torch.__version__.encode(), cpu_flags().encode(), " ".join(FLAGS).encode()]
    for part in parts:
        key.update(part)
    return specserve_home() / "build" / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def build(target: Path) -> None:
    """Compile the sources into `target` (atomically: a concurrent loader sees all or nothing)."""
    torch_lib = Path(torch.__file__).parent / "lib"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [os.environ.get("CXX", "g++"), *FLAGS, abi, *includes, *map(str, SOURCES), "-o", str(partial),
           f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    partial.replace(target)


def available() -> bool:
    """Build (once per machine, under a lock) and load the kernels; False, with the reason in the
    log, where they cannot be built here."""
    global _LOADED
    if _LOADED is None:
        _LOADED = False
        target = library_path()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not target.exists():
                    log.info("building the CPU kernels into %s", target)
                    build(target)
            torch.ops.load_library(str(target))
            _LOADED = True
        except (OSError, subprocess.CalledProcessError) as e:
            lines = (getattr(e, "stderr", "") or str(e)).strip().splitlines()
            errors = [ln for ln in lines if "error" in ln] or lines[-1:] or [str(e)]
            log.warning("CPU kernels unavailable (%s): quantized weights take torch's int4 route",
                        errors[0])
    return _LOADED


def loaded() -> bool:
    """Whether this process has loaded the kernels (never builds them: a caller that can do
    without asks this, not `available`)."""
    return _LOADED is True


if __name__ == "__main__":  # `python -m services.common.cpu_kernels`: build now (make setup)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(library_path() if available() else "torch's own ops will serve")
