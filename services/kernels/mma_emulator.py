"""CPU desk-check of the mma kernel: a line-by-line numpy transcription of tree_attention_mma.

No GPU was available when the kernel was written, so its index math (fragment layouts, ldmatrix
addressing, P reuse, masking, online softmax, pipeline stages, row/node mapping) is checked here
against the reference. The "hardware" helpers (mma, ldmatrix, shfl) implement the PTX ISA's
documented fragment layouts independently of the kernel; the kernel part mirrors the .cu source
statement by statement. It cannot catch races or compiler issues: gpu_check.py on a GPU
does that. When you change tree_attention_mma, change this transcription the same way.

    out = emulate_tree_attention_mma(q, k_caches, v_caches, prefix_lens, tree_sizes, parents)
"""

from __future__ import annotations

import math

import numpy as np
import torch

WARPS, BLOCK_M, BLOCK_N, STAGES = 8, 128, 64, 3
LANES = np.arange(32)
QUAD, TQ = LANES >> 2, LANES & 3  # fragment row group and thread-in-group
NEG_INF = np.float32(-np.inf)


def _round(x, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(dtype).float().numpy()


# ---------------------------------------------------------------- PTX semantics


def mma_16816(c: np.ndarray, a: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """c [32, 4] f32 += A[16x16] B[16x8]; a [32, 4 regs, 2 halves]; b0, b1 [32, 2]."""
    g, t = QUAD, TQ
    mat_a = np.zeros((16, 16)); mat_b = np.zeros((16, 8)); mat_c = np.zeros((16, 8))
    for i in range(2):
        mat_a[g, 2 * t + i] = a[:, 0, i]; mat_a[g + 8, 2 * t + i] = a[:, 1, i]
        mat_a[g, 2 * t + 8 + i] = a[:, 2, i]; mat_a[g + 8, 2 * t + 8 + i] = a[:, 3, i]
        mat_b[2 * t + i, g] = b0[:, i]; mat_b[2 * t + 8 + i, g] = b1[:, i]
        mat_c[g, 2 * t + i] = c[:, i]; mat_c[g + 8, 2 * t + i] = c[:, 2 + i]
    mat_d = mat_a @ mat_b + mat_c
    return np.stack([mat_d[g, 2 * t], mat_d[g, 2 * t + 1], mat_d[g + 8, 2 * t],
                     mat_d[g + 8, 2 * t + 1]], axis=1).astype(np.float32)


def ldmatrix_x4(smem: np.ndarray, row_addr: np.ndarray, trans: bool) -> np.ndarray:
    """Lanes 8i..8i+7 address the rows of matrix i -> [32 lanes, 4 matrices, 2 halves]."""
    out = np.zeros((32, 4, 2), np.float32)
    for i in range(4):
        for k in range(2):
            if trans:
                out[:, i, k] = smem[row_addr[8 * i + 2 * TQ + k] + QUAD]
            else:
                out[:, i, k] = smem[row_addr[8 * i + QUAD] + 2 * TQ + k]
    return out


def shfl_xor(x: np.ndarray, mask: int) -> np.ndarray:
    return x[LANES ^ mask]


# ---------------------------------------------------------------- the kernel, transcribed


def _flat(view: torch.Tensor) -> np.ndarray:
    """The storage span a strided view reads, as float32 starting at the view's first element."""
    span = 1 + sum((size - 1) * stride for size, stride in zip(view.shape, view.stride()))
    return torch.as_strided(view, (span,), (1,), view.storage_offset()).float().numpy()


def _ancestor_bits(parents, q_off: int, first_node: int, last_node: int) -> list[int]:
    """Per node of the block, the bitset of itself and its ancestors (the kernel's anc[])."""
    anc = []
    for node in range(first_node, last_node + 1):
        bits, x = 0, node
        while x >= 0:
            bits |= 1 << x
            p = int(parents[q_off + x])
            x = p if p < x else -1
        anc.append(bits)
    return anc


def _load_tile(smem, req, g: int, dim: int, kv_len: int, tile_idx: int, stage: int) -> None:
    """cp.async of one K and one V tile into pipeline stage `stage` (zeros past kv_len)."""
    k_mem, v_mem, k_row, v_row, k_head, v_head = req[:6]
    stride, tile = dim + 8, BLOCK_N * (dim + 8)
    kv0, ks = tile_idx * BLOCK_N, stage * 2 * tile
    for r in range(BLOCK_N):
        valid = kv0 + r < kv_len
        src = kv0 + r if valid else 0
        k_src = k_mem[g * k_head + src * k_row:][:dim] if valid else 0
        v_src = v_mem[g * v_head + src * v_row:][:dim] if valid else 0
        smem[ks + r * stride:][:dim] = k_src
        smem[ks + tile + r * stride:][:dim] = v_src


def _warp_state(q, row_offset, warp: int, m0: int, rows: int, tree: int, group: int,
                first_node: int, dim: int) -> dict:
    """One warp's q fragments and its zeroed online-softmax state (the kernel's prologue)."""
    row_a = m0 + warp * 16 + QUAD
    row_b = row_a + 8
    q_frag = np.zeros((dim // 16, 32, 4, 2), np.float32)
    for lane in range(32):
        for reg, row, col0 in ((0, row_a, 0), (1, row_b, 0), (2, row_a, 8), (3, row_b, 8)):
            if row[lane] < rows:
                for kc in range(dim // 16):
                    base = row_offset(row[lane]) + kc * 16 + col0 + 2 * TQ[lane]
                    q_frag[kc, lane, reg] = q[base:base + 2]
    return dict(
        active=m0 + warp * 16 < rows, row_a=row_a, row_b=row_b, q=q_frag,
        local_a=np.minimum(row_a // group, tree - 1) - first_node,
        local_b=np.minimum(row_b // group, tree - 1) - first_node,
        o=np.zeros((dim // 8, 32, 4), np.float32), max_a=np.full(32, NEG_INF),
        max_b=np.full(32, NEG_INF), sum_a=np.zeros(32, np.float32),
        sum_b=np.zeros(32, np.float32))


def _scores(w: dict, smem, ks: int, dim: int, scale_log2: float) -> np.ndarray:
    """S = Q K^T of one tile, scaled to log2 units: [BLOCK_N / 8, 32 lanes, 4]."""
    stride = dim + 8
    s_acc = np.zeros((BLOCK_N // 8, 32, 4), np.float32)
    for kc in range(dim // 16):
        for npair in range(BLOCK_N // 16):
            key = npair * 16 + (LANES & 7) + ((LANES >> 4) << 3)
            col = kc * 16 + (((LANES >> 3) & 1) << 3)
            kf = ldmatrix_x4(smem, ks + key * stride + col, trans=False)
            s_acc[2 * npair] = mma_16816(s_acc[2 * npair], w["q"][kc], kf[:, 0], kf[:, 1])
            s_acc[2 * npair + 1] = mma_16816(s_acc[2 * npair + 1], w["q"][kc], kf[:, 2], kf[:, 3])
    return s_acc * np.float32(scale_log2)


def _mask(s_acc: np.ndarray, w: dict, kv0: int, prefix: int, first_node: int, anc: list[int]) -> None:
    """Tree slots a row's node does not descend from -> -inf (the prefix stays visible)."""
    if kv0 + BLOCK_N <= prefix:
        return
    for nt in range(BLOCK_N // 8):
        for e in range(4):
            t = kv0 + nt * 8 + TQ * 2 + (e & 1) - prefix
            local = w["local_a"] if e < 2 else w["local_b"]
            visible = [t[l] < 0 or (t[l] <= local[l] + first_node and (anc[local[l]] >> int(t[l])) & 1)
                       for l in range(32)]
            s_acc[nt, :, e] = np.where(visible, s_acc[nt, :, e], NEG_INF)


def _online_softmax(s_acc: np.ndarray, w: dict) -> None:
    """New running max (quad shuffles), rescale sums and output, s_acc -> exp2 weights."""
    tile_max_a, tile_max_b = s_acc[:, :, 0:2].max(axis=(0, 2)), s_acc[:, :, 2:4].max(axis=(0, 2))
    for mask in (1, 2):
        tile_max_a = np.maximum(tile_max_a, shfl_xor(tile_max_a, mask))
        tile_max_b = np.maximum(tile_max_b, shfl_xor(tile_max_b, mask))
    new_a, new_b = np.maximum(w["max_a"], tile_max_a), np.maximum(w["max_b"], tile_max_b)
    base_a, base_b = np.where(new_a == NEG_INF, 0, new_a), np.where(new_b == NEG_INF, 0, new_b)
    alpha_a, alpha_b = np.exp2(w["max_a"] - base_a), np.exp2(w["max_b"] - base_b)
    w["max_a"], w["max_b"] = new_a, new_b
    s_acc[:, :, 0:2] = np.exp2(s_acc[:, :, 0:2] - base_a[None, :, None])
    s_acc[:, :, 2:4] = np.exp2(s_acc[:, :, 2:4] - base_b[None, :, None])
    w["sum_a"] = w["sum_a"] * alpha_a + s_acc[:, :, 0:2].sum(axis=(0, 2))
    w["sum_b"] = w["sum_b"] * alpha_b + s_acc[:, :, 2:4].sum(axis=(0, 2))
    w["o"][:, :, 0:2] *= alpha_a[None, :, None]
    w["o"][:, :, 2:4] *= alpha_b[None, :, None]


def _accumulate_pv(s_acc: np.ndarray, w: dict, smem, vs: int, dim: int, dtype) -> None:
    """O += P V, P reused from the score registers (rounded to the kernel's dtype)."""
    stride = dim + 8
    for kc in range(BLOCK_N // 16):
        p_frag = np.stack([s_acc[2 * kc][:, 0:2], s_acc[2 * kc][:, 2:4],
                           s_acc[2 * kc + 1][:, 0:2], s_acc[2 * kc + 1][:, 2:4]], axis=1)
        p_frag = _round(p_frag, dtype)
        for dp in range(dim // 16):
            key = kc * 16 + (LANES & 7) + (((LANES >> 3) & 1) << 3)
            col = dp * 16 + ((LANES >> 4) << 3)
            vf = ldmatrix_x4(smem, vs + key * stride + col, trans=True)
            w["o"][2 * dp] = mma_16816(w["o"][2 * dp], p_frag, vf[:, 0], vf[:, 1])
            w["o"][2 * dp + 1] = mma_16816(w["o"][2 * dp + 1], p_frag, vf[:, 2], vf[:, 3])


def _write_out(w: dict, out, row_offset, rows: int, dim: int, dtype) -> None:
    """The epilogue: quad-sum the row sums, O / sum into out (0 for a row that saw nothing)."""
    sum_a, sum_b = w["sum_a"], w["sum_b"]
    for mask in (1, 2):
        sum_a, sum_b = sum_a + shfl_xor(sum_a, mask), sum_b + shfl_xor(sum_b, mask)
    for row, total, half in ((w["row_a"], sum_a, 0), (w["row_b"], sum_b, 2)):
        inv = np.where(total > 0, 1 / np.where(total > 0, total, 1), 0)
        for lane in range(32):
            if row[lane] < rows:
                for dt in range(dim // 8):
                    base = row_offset(row[lane]) + dt * 8 + 2 * TQ[lane]
                    out[base:base + 2] = _round(w["o"][dt, lane, half:half + 2] * inv[lane], dtype)


def _block(q, out, parents, req, b, g, m0, num_heads, group, dim, dtype, scale_log2):
    """One thread block: BLOCK_M (node, head) rows of kv head g of request b."""
    prefix, tree, q_off = req[6:]
    rows = tree * group
    if m0 >= rows:
        return
    tile = BLOCK_N * (dim + 8)
    first_node = m0 // group
    last_node = min(tree - 1, (m0 + BLOCK_M - 1) // group)
    kv_len = prefix + last_node + 1
    num_tiles = (kv_len + BLOCK_N - 1) // BLOCK_N
    anc = _ancestor_bits(parents, q_off, first_node, last_node)
    smem = np.zeros(STAGES * 2 * tile, np.float32)

    def row_offset(r):
        return ((q_off + r // group) * num_heads + g * group + r % group) * dim

    warps = [_warp_state(q, row_offset, warp, m0, rows, tree, group, first_node, dim)
             for warp in range(WARPS)]
    for s in range(STAGES - 1):
        if s < num_tiles:
            _load_tile(smem, req, g, dim, kv_len, s, s)
    for tile_idx in range(num_tiles):
        if tile_idx + STAGES - 1 < num_tiles:
            _load_tile(smem, req, g, dim, kv_len, tile_idx + STAGES - 1, (tile_idx + STAGES - 1) % STAGES)
        ks = (tile_idx % STAGES) * 2 * tile
        for w in warps:
            if w["active"]:
                s_acc = _scores(w, smem, ks, dim, scale_log2)
                _mask(s_acc, w, tile_idx * BLOCK_N, prefix, first_node, anc)
                _online_softmax(s_acc, w)
                _accumulate_pv(s_acc, w, smem, ks + tile, dim, dtype)
    for w in warps:
        if w["active"]:
            _write_out(w, out, row_offset, rows, dim, dtype)


def emulate_tree_attention_mma(q, k_caches, v_caches, prefix_lens, tree_sizes, parents,
                               scale=None) -> torch.Tensor:
    """Same call and result as services.kernels.reference (fp16/bf16, D in {64, 128}); slow."""
    _, num_heads, dim = q.shape
    num_kv_heads = k_caches[0].shape[0]
    group = num_heads // num_kv_heads
    scale_log2 = (1.0 / math.sqrt(dim) if scale is None else scale) * math.log2(math.e)
    q_flat = q.float().contiguous().numpy().ravel()
    out = np.full(q_flat.shape, np.nan, np.float32)
    parents_np = parents.numpy()
    q_off = 0
    for b, (prefix, tree) in enumerate(zip(prefix_lens, tree_sizes)):
        k, v = k_caches[b], v_caches[b]
        req = (_flat(k), _flat(v), k.stride(1), v.stride(1), k.stride(0), v.stride(0), prefix,
               tree, q_off)
        for g in range(num_kv_heads):
            for m0 in range(0, max(tree_sizes) * group, BLOCK_M):
                _block(q_flat, out, parents_np, req, b, g, m0, num_heads, group, dim, q.dtype,
                       scale_log2)
        q_off += tree
    return torch.from_numpy(out).view(q.shape).to(q.dtype)
