"""The quantized-weight kernels one op at a time: GGUF blocks decoded exactly, torch's int4 route,
the float block kernel (qmatmul.cpp), the tile kernel on int8 rows (q8matmul.cpp), the rowwise
kernels and greedy's argmax; each against a float reference, bitwise where it is exact, and a
row's output independent of the other rows of the call. Whole models on these weights:
test_native_weights.py."""

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from gguf.quants import dequantize, quantize

from services.common.gguf_blocks import BlockTensor
from services.common import cpu_kernels, qmatmul
from services.common.quant import int4_linear, pack

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels do not build "
                                  "here (no g++, or a CPU without AVX2/FMA/F16C); the log says which")

@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_each_block_kind_decodes_exactly_and_multiplies_within_bfloat16(kind):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    raw = quantize(w.numpy(), gguf.GGMLQuantizationType[kind])
    block = BlockTensor(kind, torch.from_numpy(raw))
    values = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[kind]).copy())
    assert block.shape == (96, 128) and torch.equal(block.dequantize(), values)
    rows = torch.tensor([5, 0, 95])
    assert torch.equal(block.dequantize(rows), values[rows])
    native = pack(block)
    x = torch.randn(37, 128)
    y, ref = int4_linear(x, native), x @ values.T
    assert y.dtype == torch.float32 and y.shape == (37, 96)
    assert float((y - ref).abs().max() / ref.abs().max()) < 2e-2
    # a row's output does not depend on the other rows of the call (verify == plain decoding)
    assert all(torch.equal(int4_linear(x[i : i + 1], native), y[i : i + 1]) for i in (0, 17, 36))
    assert torch.equal(int4_linear(x[3:11], native), y[3:11])


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_rows_decode_the_embeddings_rows_bitwise(kind):
    """qmatmul.cpp's block_rows (the embedding lookup of a model kept in its blocks) gives
    BlockTensor.dequantize's float32 rows bit for bit, Q8_0 quants of -128 and 127 included, and
    names a row out of range."""
    torch.manual_seed(0)
    w = torch.randn(96, 160) * 0.05
    block = BlockTensor(kind, torch.from_numpy(quantize(w.numpy(), gguf.GGMLQuantizationType[kind])))
    if kind == "Q8_0":
        block.raw.view(96, 5, 34)[:4, 1, 2:10] = torch.tensor([128, 127] * 4, dtype=torch.uint8)
    ids = torch.tensor([3, 0, 95, 3, 1, 2])
    got = torch.ops.specserve_q.block_rows(block.raw, ids, qmatmul.KINDS[kind])
    assert got.dtype == torch.float32 and torch.equal(got, block.dequantize(ids))
    assert torch.equal(qmatmul.block_rows(block, torch.arange(96)), block.dequantize())
    if kind == "Q8_0":
        assert float(got[0, 32:40].min()) < 0 and float(got[0, 32:40].max()) > 0  # the extreme quants are there
    with pytest.raises(RuntimeError, match="row 96 outside the weight's 96"):
        torch.ops.specserve_q.block_rows(block.raw, torch.tensor([1, 96]), qmatmul.KINDS[kind])


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_block_kernel_multiplies_by_the_dequantized_weights_in_float32(kind):
    torch.manual_seed(0)
    w = torch.randn(100, 160) * 0.05  # outputs not a multiple of the kernel's tiles
    block = BlockTensor(kind, torch.from_numpy(quantize(w.numpy(), gguf.GGMLQuantizationType[kind])))
    native = qmatmul.BlockWeight(block)
    x = torch.randn(37, 160)
    y, ref = native.linear(x), (x.double() @ block.dequantize().double().T)
    assert y.dtype == torch.float32 and y.shape == (37, 100)
    assert float((y - ref).abs().max() / ref.abs().max()) < 1e-6
    # a row's output does not depend on the other rows of the call (verify == plain decoding)
    assert all(torch.equal(native.linear(x[i : i + 1]), y[i : i + 1]) for i in (0, 17, 36))
    for part in (slice(3, 11), slice(4, 7), slice(0, 7)):  # 8, 3 and 7 rows: other tilings
        assert torch.equal(native.linear(x[part]), y[part])


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] as q8matmul.cpp rounds it: int8 per block of 32, scale max|x| / 127."""
    xb = x.view(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return ((xb * inv).round() * d).flatten(1)


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_tile_kernel_multiplies_int8_rows_by_the_dequantized_weights(kind):
    """q8matmul.cpp: exact integer sums of int8 activations (rounded per block) and the 4-bit or
    8-bit weights, so float64 arithmetic on the same rounded rows is the reference."""
    torch.manual_seed(0)
    w = torch.randn(96, 160) * 0.05
    block = BlockTensor(kind, torch.from_numpy(quantize(w.numpy(), gguf.GGMLQuantizationType[kind])))
    if kind == "Q8_0":  # quants of -128 and 127 (a file may hold -128; the quantizer stops at -127)
        block.raw.view(96, 5, 34)[:4, 1, 2:10] = torch.tensor([128, 127] * 4, dtype=torch.uint8)
    native = qmatmul.pack_tiles(block)
    per_block = 34 if kind == "Q8_0" else 20  # a 4-bit block takes 20 bytes (Q4_0 gains offsets m)
    assert native.nbytes() == 96 * 5 * per_block and native.shape == (96, 160)
    x = torch.randn(37, 160)
    x[5, :32] = 0  # an all-zero block: scale 0, not a division by zero
    y, ref = native.linear(x), _int8_rows(x).double() @ block.dequantize().double().T
    assert y.dtype == torch.float32 and y.shape == (37, 96)
    assert float((y - ref).abs().max() / ref.abs().max()) < 1e-6
    assert float((y - x @ block.dequantize().T).abs().max() / ref.abs().max()) > 1e-4  # it rounds
    assert all(torch.equal(native.linear(x[i : i + 1]), y[i : i + 1]) for i in (0, 17, 36))
    for part in (slice(3, 11), slice(4, 7), slice(2, 6), slice(0, 7), slice(0, 33)):  # other row tilings
        assert torch.equal(native.linear(x[part]), y[part])


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_the_tile_kernels_4_bit_sums_are_exact_at_their_largest(kind):
    """Without VNNI a 4-bit block's products add up in 16-bit lanes: with every quant at 15 and
    every row value at +-127 a lane reaches 8 pairs x 2 x 15 x 127 = 30,480, near int16's limit.
    Rows of 1 to 9 (one pass, and a pass of 8 then 1) give the float64 sums of the same values."""
    rows, out, k = 9, 32, 96
    per_block = 18 if kind == "Q4_0" else 20  # the block's scale (and Q4_1's min), then 16 bytes of nibbles
    raw = torch.zeros(out, k // 32, per_block, dtype=torch.uint8)
    raw[..., 1] = 0x38  # scale d = 0.5 (float16 0x3800)
    if kind == "Q4_1":
        raw[..., 3] = 0xB4  # min m = -0.25 (float16 0xB400)
    raw[..., per_block - 16 :] = 0xFF  # every quant 15
    raw[:, 1, per_block - 16 :] = 0x0F  # block 1: inputs 0-15 at 15, 16-31 at 0
    block = BlockTensor(kind, raw.view(out, -1))
    x = torch.ones(rows, k)
    x[1] = -1
    x[2, ::2] = -1
    x[3] = torch.arange(k) % 7 - 3.0
    y, ref = qmatmul.pack_tiles(block).linear(x), _int8_rows(x).double() @ block.dequantize().double().T
    assert float((y - ref).abs().max() / ref.abs().max()) < 1e-6
    assert all(torch.equal(qmatmul.pack_tiles(block).linear(x[: n]), y[: n]) for n in (1, 4, 8))


@needs_kernel
def test_the_tile_kernel_names_what_is_wrong_with_its_inputs():
    tiles = qmatmul.pack_tiles(BlockTensor("Q4_1", torch.zeros(16, 2 * 20, dtype=torch.uint8))).tiles
    with pytest.raises(RuntimeError, match="x has 32 inputs, the tiles hold 640 bytes"):
        torch.ops.specserve_q.q8matmul(torch.zeros(1, 32), tiles)
    assert not qmatmul.supports_tiles(BlockTensor("Q4_1", torch.zeros(8, 20, dtype=torch.uint8)))
    assert not qmatmul.supports_tiles(BlockTensor("Q8_0", torch.zeros(8, 34, dtype=torch.uint8)))


@needs_kernel
def test_the_block_kernel_names_what_is_wrong_with_its_inputs():
    block = BlockTensor("Q4_1", torch.zeros(8, 2 * 20, dtype=torch.uint8))  # [8 outputs, 64 inputs]
    with pytest.raises(RuntimeError, match="x has 32 inputs, the blocks hold 40 bytes"):
        torch.ops.specserve_q.qmatmul(torch.zeros(1, 32), block.raw, qmatmul.KINDS["Q4_1"])
    with pytest.raises(RuntimeError, match="unknown block kind 7"):
        torch.ops.specserve_q.qmatmul(torch.zeros(1, 64), block.raw, 7)


@needs_kernel
def test_the_rowwise_kernels_match_torchs_norm_rope_and_silu():
    """rowwise.cpp's RMSNorm, in-place RoPE and silu(gate) * up (native models' layers) against
    torch's ops, row by row the same whatever the rows beside it."""
    torch.manual_seed(0)
    x, w = torch.randn(7, 576) * 3, torch.randn(576)
    y = torch.ops.specserve_q.rms_norm(x, w, 1e-5)
    assert torch.allclose(y, torch.nn.functional.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.ops.specserve_q.rms_norm(x[2:3], w, 1e-5), y[2:3])
    qkv, pos = torch.randn(5, 4 * 64 + 16), torch.arange(5, dtype=torch.float32)
    freqs = pos[:, None] * (1e4 ** (-torch.arange(32) / 32))[None]
    cos, sin = torch.cat([freqs, freqs], 1).cos(), torch.cat([freqs, freqs], 1).sin()  # [5, 64]
    half = qkv[:, :192].view(5, 3, 64)
    ref = half * cos[:, None] + torch.cat([-half[..., 32:], half[..., :32]], -1) * sin[:, None]
    rotated = qkv.clone()
    torch.ops.specserve_q.rope_(rotated, cos, sin, 3, 64)
    assert torch.allclose(rotated[:, :192].view(5, 3, 64), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(rotated[:, 192:], qkv[:, 192:])  # heads past the count stay as they were
    with pytest.raises(RuntimeError, match="weight must be float32 \\[hidden\\]"):
        torch.ops.specserve_q.rms_norm(x, w[:10], 1e-5)
    gate_up = torch.randn(4, 2 * 1536) * 4
    y = torch.ops.specserve_q.silu_mul(gate_up)
    ref = torch.nn.functional.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    assert torch.allclose(y, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.ops.specserve_q.silu_mul(gate_up[1:2].contiguous()), y[1:2])


@needs_kernel
def test_the_argmax_kernel_answers_as_torch_does_ties_and_nan_included():
    """Greedy verification's argmax (rowwise.cpp): the first index of the max, as torch.argmax."""
    from services.verifier.rejection import argmax_rows

    torch.manual_seed(0)
    x = torch.randn(9, 49157)  # rows longer than, and not a multiple of, a vector
    x[1, [7, 300, 49156]] = 9.0  # ties: the first wins
    x[2, [49155, 49156]] = 9.0  # the max only in the tail past the last whole vector
    x[3] = float("-inf")  # a row masked whole (a grammar with no legal token): index 0
    x[4, 20:] = float("-inf")
    x[5, [40, 900]] = float("nan")  # NaN: torch answers its first NaN
    x[6, 4] = float("inf")
    x[7] = 0.0
    x[7, 33] = -0.0  # -0 equals 0: the first of the row
    wide = torch.randn(3, 60000)[:, 5:49162]  # rows not contiguous with each other
    for m in (x, wide, x[2:3]):
        ref = m.argmax(-1)
        assert torch.equal(torch.ops.specserve_q.argmax_rows(m), ref)
        assert argmax_rows(m) == ref.tolist()
    assert torch.ops.specserve_q.argmax_rows(x).tolist()[1:8] == [7, 49155, 0, int(x[4, :20].argmax()), 40, 4, 0]


def test_without_a_compiler_quantized_weights_take_the_int4_route(tmp_path):
    """A machine that cannot build the kernel still serves natively, through torch's int4 op."""
    script = ("import torch; from services.common import cpu_kernels, gguf_blocks, quant\n"
              "block = gguf_blocks.BlockTensor('Q4_1', torch.zeros(16, 2 * 20, dtype=torch.uint8))\n"
              "print(cpu_kernels.available(), type(quant.native_weight(block)).__name__)")
    env = {**os.environ, "CXX": "false", "SPECSERVE_HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.stdout.split() == ["False", "Int4Weight"], run.stderr
    assert "CPU kernels unavailable" in run.stderr
