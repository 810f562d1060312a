"""The native matmul on a GGUF file's own blocks, in float32: `qmatmul.cpp`, built for this CPU.

Each block is decoded to exactly the float32 weights of the dequantized model and multiplied
into float32 accumulators, so the only difference from float32 weights is the order of a sum;
torch's int4 route (`services.common.quant`) instead rounds activations to bfloat16. A row's
result does not depend on the other rows of the call (the kernel's comment says why).

The source compiles once per machine (g++ -march=native: it needs AVX2, FMA and F16C) against the
installed torch into `$SPECSERVE_HOME/build/`, under a name keyed by the source, torch's version
and the CPU's flags; `make setup` builds it, a first load otherwise does (about 20 s). Without a
compiler or those instructions `available()` is False and the int4 route serves.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import cpp_extension

from services.common.gguf_blocks import BlockTensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qmatmul.cpp")
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # the kernel's block kinds
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]

_LOADED: bool | None = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def library_path() -> Path:
    """Where this machine's build lives: the name changes with the source, torch and the CPU."""
    from services.common.loading import specserve_home

    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), _cpu_flags().encode(),
                 " ".join(FLAGS).encode()):
        key.update(part)
    return specserve_home() / "build" / f"qmatmul-{key.hexdigest()[:16]}.so"


def build(target: Path) -> None:
    """Compile the source into `target` (atomically: a concurrent loader sees all or nothing)."""
    torch_lib = Path(torch.__file__).parent / "lib"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    cmd = [os.environ.get("CXX", "g++"), *FLAGS, abi, *includes, str(SOURCE), "-o", str(partial),
           f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    partial.replace(target)


def available() -> bool:
    """Build (once per machine, under a lock) and load the kernel; False, with the reason in the
    log, where it cannot be built here."""
    global _LOADED
    if _LOADED is None:
        _LOADED = False
        target = library_path()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not target.exists():
                    log.info("building the native matmul kernel into %s", target)
                    build(target)
            torch.ops.load_library(str(target))
            _LOADED = True
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            log.warning("native matmul kernel unavailable (%s); quantized weights take torch's int4 "
                        "route", detail.strip().splitlines()[-1] if detail.strip() else e)
    return _LOADED


@dataclass
class BlockWeight:
    """A linear weight [out, in] as the file's blocks; multiplied by `qmatmul.cpp`."""

    block: BlockTensor

    rounds_activations = False  # float32 in, float32 accumulation

    @property
    def shape(self) -> tuple[int, int]:
        return self.block.shape

    def nbytes(self) -> int:
        return self.block.nbytes()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] @ w.T (+ bias) -> [rows, out] in x's dtype."""
        y = torch.ops.specserve_q.qmatmul(x.float().contiguous(), self.block.raw, KINDS[self.block.kind])
        y = y.to(x.dtype)
        return y if bias is None else y + bias


def supports(block: BlockTensor) -> bool:
    return block.kind in KINDS and available()


if __name__ == "__main__":  # `python -m services.common.qmatmul`: build now (make setup)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(library_path() if available() else "the int4 route will serve quantized weights")
