"""services/kernels/tree_attention_*.cu (joined as the wrapper joins them) compiles with nvcc for sm_80 and sm_90, warnings as errors, no
spills.

Nothing here runs the kernel (no GPU on CI); services/kernels/gpu_check.py does that on a GPU
machine.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from services.kernels.tree_attention import VARIANTS, cuda_source, kernel_name

NVCC = shutil.which("nvcc")
# Warnings from the front end, the host compiler and ptxas (incl. spills) all fail the build.
STRICT = ["-std=c++17", "-Werror", "all-warnings", "-Xptxas", "-v,-warn-spills,-warn-lmem-usage"]
ENTRY_POINTS = [kernel_name(variant, dtype, dim) for variant in VARIANTS
                for dtype in (torch.float16, torch.bfloat16) for dim in (64, 128)]


@pytest.fixture
def nvcc() -> str:
    if NVCC is None:
        pytest.skip("nvcc not found on PATH: cannot compile services/kernels/tree_attention_*.cu")
    return NVCC


def _source(tmp_path) -> str:
    """The one source the wrapper hands NVRTC, as a file for nvcc."""
    path = tmp_path / "tree_attention.cu"
    path.write_text(cuda_source())
    return str(path)


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
    return result


def _resources(ptxas_log: str) -> dict[str, tuple[int, int]]:
    """ptxas -v log -> {entry: (stack frame bytes, registers)}."""
    found = {}
    pattern = re.compile(r"Function properties for (\w+)\n\s+(\d+) bytes stack frame.*?\n"
                         r".*?Used (\d+) registers")
    for name, stack, regs in pattern.findall(ptxas_log):
        found[name] = (int(stack), int(regs))
    return found


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_nvcc_compiles_with_warnings_as_errors(nvcc, tmp_path, target):
    if target == "sm_80":  # a full object: the host pass runs too, with -Werror
        out = tmp_path / "tree_attention.o"
        cmd = [nvcc, *STRICT, "-arch=sm_80", "-c", "-Xcompiler", "-Wall,-Wextra,-Werror"]
    else:
        out = tmp_path / "tree_attention.cubin"
        cmd = [nvcc, *STRICT, "-gencode", "arch=compute_90,code=sm_90", "-cubin"]
    result = _run(cmd + ["-o", str(out), _source(tmp_path)])
    assert out.stat().st_size > 0
    resources = _resources(result.stdout + result.stderr)
    assert set(resources) == set(ENTRY_POINTS), f"ptxas saw {sorted(resources)}"
    for name, (stack, regs) in resources.items():
        assert stack == 0, f"{name}: {stack}-byte stack frame (local memory) on {target}"
        assert regs <= 255, f"{name}: {regs} registers"


def test_ptx_exports_every_entry_point_the_wrapper_calls(nvcc, tmp_path):
    out = tmp_path / "tree_attention.ptx"
    _run([nvcc, "-std=c++17", "-arch=sm_90", "-ptx", "-o", str(out), _source(tmp_path)])
    ptx = out.read_text()
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    assert entries == set(ENTRY_POINTS)
    # the fast path really is the tensor-core / async-copy one
    for instruction in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                        "cp.async.cg.shared.global", "cp.async.wait_group"):
        assert instruction in ptx, instruction
