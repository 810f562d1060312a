"""CPU-side parts of the CUDA wrapper, the SDPA baselines and the GPU check script."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from services.kernels import baselines, gpu_check
from services.kernels import tree_attention as wrapper
from services.kernels.reference import tree_attention_reference


def test_wrapper_validates_before_touching_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # any `import cupy` would now fail
    q = torch.randn(3, 4, 64, dtype=torch.float16)
    cache = torch.randn(2, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        wrapper.tree_attention_cuda(q, [cache], [cache], [2], [3], torch.tensor([-1, 0, 1]))
    with pytest.raises(ValueError, match="variant"):
        wrapper.tree_attention_cuda(q, [cache], [cache], [2], [3], torch.tensor([-1, 0, 1]),
                                    variant="fast")
    assert wrapper.cupy_available() is False


def test_build_metadata_points_at_the_caches_in_place():
    store = torch.zeros(3, 40, 2, 64, dtype=torch.bfloat16)  # [B, C, KVH, D]
    k_caches = [store[i].transpose(0, 1) for i in range(3)]  # [KVH, C, D], strided heads
    v_caches = [torch.zeros(2, 30, 64, dtype=torch.bfloat16) for _ in range(3)]
    meta = wrapper.build_metadata(k_caches, v_caches, [7, 0, 20], [4, 1, 9])
    assert meta.shape == (3, wrapper.META_FIELDS) and meta.dtype == torch.int64
    assert meta[1, 0] == store[1].data_ptr() == store.data_ptr() + 40 * 2 * 64 * 2
    assert meta[2, 1] == v_caches[2].data_ptr()
    assert meta[0, 2:6].tolist() == [64, 128, 30 * 64, 64]  # head/row strides of K then V
    assert meta[:, 6].tolist() == [7, 0, 20]
    assert meta[:, 7].tolist() == [4, 1, 9]
    assert meta[:, 8].tolist() == [0, 4, 5]  # q row offset of each request


def test_python_constants_mirror_the_cuda_source():
    source = wrapper.cuda_source()

    def constant(name: str) -> int:
        return int(re.search(rf"constexpr int {name} = (\d+);", source).group(1))

    warps = constant("kWarps")
    assert warps * 32 == wrapper.MMA_THREADS
    assert warps * 16 == wrapper.MMA_BLOCK_M
    assert constant("kBlockN") == wrapper.MMA_BLOCK_N
    assert constant("kStages") == wrapper.MMA_STAGES
    assert constant("kMetaFields") == wrapper.META_FIELDS
    assert constant("kSimpleWarps") == wrapper.SIMPLE_WARPS
    assert constant("kMaxTree") == 256
    assert "static constexpr int kStride = D + 8;" in source
    assert wrapper.mma_smem_bytes(128) == 3 * 2 * 64 * 136 * 2


def _small_batch(dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    requests = [(5, 7, [-1, 0, 0, 1, -1, 4, 2]), (0, 3, [-1, 0, 1]), (9, 1, [-1])]
    k_caches = [torch.randn(2, p + t + 3, 64, generator=gen).to(dtype) for p, t, _ in requests]
    v_caches = [torch.randn(2, p + t + 3, 64, generator=gen).to(dtype) for p, t, _ in requests]
    parents = torch.tensor([x for _, _, par in requests for x in par])
    q = torch.randn(11, 8, 64, generator=gen).to(dtype)
    return q, k_caches, v_caches, [r[0] for r in requests], [r[1] for r in requests], parents


def test_padded_sdpa_baseline_computes_tree_attention():
    batch = _small_batch()
    padded = baselines.build_padded_inputs(*batch)
    assert padded.mask.shape == (3, 1, 7, 12)
    out = baselines.unpad(baselines.run_padded(padded), padded.tree_sizes)
    torch.testing.assert_close(out, tree_attention_reference(*batch), atol=1e-5, rtol=1e-5)


def test_loop_sdpa_baseline_computes_tree_attention():
    batch = _small_batch()
    out = baselines.loop_output(baselines.run_loop(baselines.build_loop_inputs(*batch)))
    torch.testing.assert_close(out, tree_attention_reference(*batch), atol=1e-5, rtol=1e-5)


def test_gpu_check_help_runs_on_cpu():
    result = subprocess.run([sys.executable, "-m", "services.kernels.gpu_check", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--out" in result.stdout and "--dry-run" in result.stdout


def test_gpu_check_inputs_poison_only_rows_past_the_tree():
    shape = gpu_check.Shape("t", (0, 3), (4, 2), "mixed", 4, 2, 64)
    q, k_caches, v_caches, prefix_lens, tree_sizes, parents = gpu_check.make_inputs(
        shape, torch.bfloat16, 0, heads_outer=False, device="cpu")
    assert q.shape == (6, 4, 64) and parents.tolist()[:4] == [-1, 0, 1, 2]  # first tree: chain
    for cache, p, t in zip(k_caches, prefix_lens, tree_sizes):
        assert cache.shape[0] == 2 and cache.stride(-1) == 1
        assert torch.isfinite(cache[:, :p + t]).all() and torch.isnan(cache[:, p + t:]).all()
    assert torch.isfinite(tree_attention_reference(q, k_caches, v_caches, prefix_lens,
                                                   tree_sizes, parents)).all()


def test_gpu_check_dry_run_writes_the_report(tmp_path):
    code = gpu_check.main(["--out", str(tmp_path), "--dry-run", "--iters", "2", "--warmup", "1"])
    assert code == 0
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| dry_mixed | reference | bf16 |" in markdown
    import json

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["all_correct"] is True and report["dry_run"] is True
    assert len(report["correctness"]) == 4 and all(c["nan"] == 0 for c in report["correctness"])
    assert all("kernel_us" in row for row in report["timing"])
