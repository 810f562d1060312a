// Tree attention for speculative-decoding verification (CuPy RawModule source, sm_80+).
//
// Semantics: kernels/reference.py. Node j of request b attends to the L_b prefix rows of its own
// KV cache, to its ancestors in the draft tree and to itself; softmax in fp32; fp16 or bf16 I/O.
//
// Shapes (all 16-bit tensors handled as raw bits: no cuda_fp16.h / cuda_bf16.h needed)
//   q, out    [N, H, D]   contiguous; request b owns rows q_off_b .. q_off_b + T_b - 1
//   parents   [N] int32   parent index within its own tree, -1 = root (child of the prefix)
//   meta      [B, 9] int64, per request: k_ptr, v_ptr, k_head_stride, k_row_stride,
//             v_head_stride, v_row_stride (elements), prefix_len L, tree_size T, q_off.
//             K of request b, kv head g, row r: ((T*)k_ptr)[g * k_head_stride + r * k_row_stride]
//             (a strided [KVH, C, D] view read in place; rows >= L + T never read).
//
// Two kernels, each instantiated for {fp16, bf16} x D in {64, 128} behind extern "C" names
// tree_attention_{mma,simple}_{f16,bf16}_d{64,128}:
//
// mma (the fast one). grid = (row tiles, KVH, B), block = 256 threads = 8 warps.
//   The G = H / KVH query heads of kv head g and the T nodes of request b form T*G query rows,
//   row r = node * G + head_in_group (a node's G heads are adjacent in q). A block owns 128 rows
//   (8 warps x 16 rows), so every node and every query head of the GQA group shares each K/V tile
//   that the block streams from global memory into shared memory (64 keys per tile, 3-stage
//   cp.async pipeline, rows padded by 16 bytes so ldmatrix is bank-conflict free).
//   Each warp: S = Q K^T with mma.sync m16n8k16 (Q fragments held in registers for the whole
//   KV loop), mask, online softmax in fp32 (exp2 domain), O += P V with P reused from the S
//   accumulators as the A operand. The ancestor mask is built per block in shared memory from
//   `parents`: one thread per node of the tile walks its parent chain into a 4 x uint64 bitset
//   (T <= 256). Only tiles that reach past the prefix are masked; keys beyond the tile's last
//   node are never loaded (zero-filled), so garbage rows cannot leak in, not even as NaN.
//
// simple (a plain fallback, for cross-checking on a GPU). grid = (ceil(H / 4), N),
//   block = 128 threads: one warp per (node, query head), lanes split D; it walks the prefix
//   and then the parent chain, one key at a time, with an online softmax.

namespace ta {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockM = kWarps * 16;  // query rows per block (16 per warp)
constexpr int kBlockN = 64;           // keys per K/V tile
constexpr int kStages = 3;            // cp.async pipeline depth
constexpr int kMaxTree = 256;         // ancestors fit in 4 x 64-bit words
constexpr int kMetaFields = 9;
constexpr int kSimpleWarps = 4;

typedef unsigned short bits16;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float fmax2(float a, float b) { return a > b ? a : b; }

__device__ __forceinline__ float exp2_approx(float x) {  // ex2(-inf) = +0
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ unsigned smem_u32(const void* ptr) {
  unsigned addr;
  asm volatile("{ .reg .u64 a64; cvta.to.shared.u64 a64, %1; cvt.u32.u64 %0, a64; }\n"
               : "=r"(addr) : "l"(ptr));
  return addr;
}

// 16-byte global -> shared copy; src_bytes = 0 zero-fills the destination without reading.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i. Lane l receives
// row l/4, columns 2(l%4), 2(l%4)+1 of each (with .trans: column l/4, rows 2(l%4), 2(l%4)+1).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// c[16x8, f32] += a[16x16, row] * b[16x8, col]. Lane l (group = l/4, t = l%4) holds
// a: {row g, cols 2t..2t+1}, {row g+8, same}, {row g, cols 2t+8..}, {row g+8, cols 2t+8..};
// b: {rows 2t..2t+1, col g}, {rows 2t+8..2t+9, col g}; c: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
template <bool kBf16>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats -> packed 16-bit pair, `lo` in the low half (the lower column index).
template <bool kBf16>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  unsigned r;
  if constexpr (kBf16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

template <bool kBf16>
__device__ __forceinline__ float to_float(bits16 x) {
  if constexpr (kBf16) {
    return __uint_as_float(static_cast<unsigned>(x) << 16);
  } else {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
    return f;
  }
}

__device__ __forceinline__ float quad_max(float x) {  // over the 4 lanes that share a row
  x = fmax2(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmax2(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Shared-memory bytes the mma kernel needs beyond its static arrays (K and V tiles, all stages).
template <int D>
struct MmaSmem {
  static constexpr int kStride = D + 8;                 // elements per padded K/V row
  static constexpr int kTile = kBlockN * kStride;       // elements per K (or V) tile
  static constexpr int kBytes = kStages * 2 * kTile * 2;
};

template <bool kBf16, int D>
__device__ __forceinline__ void tree_attention_mma(
    const bits16* __restrict__ q, bits16* __restrict__ out, const int* __restrict__ parents,
    const long long* __restrict__ meta, int num_heads, int num_kv_heads, float scale_log2) {
  constexpr int kStride = MmaSmem<D>::kStride;
  constexpr int kTile = MmaSmem<D>::kTile;
  constexpr int kChunksPerRow = D / 8;  // 16-byte chunks per K/V row
  static_assert(kBlockN * kChunksPerRow % kThreads == 0, "tile copy must split evenly");
  extern __shared__ __align__(16) bits16 kv_smem[];  // [kStages][K|V][kBlockN][kStride]
  __shared__ int parents_s[kMaxTree];                 // [T]
  __shared__ unsigned long long anc_s[kBlockM][4];    // [nodes of this tile][4] ancestor bits

  const int b = blockIdx.z, g = blockIdx.y, m0 = blockIdx.x * kBlockM;
  const long long* req = meta + static_cast<long long>(b) * kMetaFields;
  const int tree = static_cast<int>(req[7]);
  const int group = num_heads / num_kv_heads;
  const int rows = tree * group;  // query rows of (request b, kv head g)
  if (m0 >= rows) return;         // whole block: this request has fewer rows
  const int prefix = static_cast<int>(req[6]);
  const long long q_off = req[8];
  const bits16* k_base = reinterpret_cast<const bits16*>(req[0]) + g * req[2];
  const bits16* v_base = reinterpret_cast<const bits16*>(req[1]) + g * req[4];
  const long long k_row = req[3], v_row = req[5];

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int quad = lane >> 2, tq = lane & 3;  // mma fragment coordinates

  // Nodes covered by this block's rows; ancestors of a node never have a larger index, so keys
  // past prefix + last_node + 1 are invisible to the whole block and are not loaded.
  const int first_node = m0 / group;
  const int last_node = min(tree - 1, (m0 + kBlockM - 1) / group);
  const int kv_len = prefix + last_node + 1;
  const int num_tiles = (kv_len + kBlockN - 1) / kBlockN;

  for (int i = tid; i < tree; i += kThreads) parents_s[i] = parents[q_off + i];
  __syncthreads();
  if (tid <= last_node - first_node) {  // one thread per node: walk the parent chain
    const int node = first_node + tid;
    unsigned long long w0 = 0, w1 = 0, w2 = 0, w3 = 0;
    for (int x = node; x >= 0;) {
      const unsigned long long bit = 1ull << (x & 63);
      const int word = x >> 6;
      w0 |= word == 0 ? bit : 0ull;
      w1 |= word == 1 ? bit : 0ull;
      w2 |= word == 2 ? bit : 0ull;
      w3 |= word == 3 ? bit : 0ull;
      const int p = parents_s[x];
      x = p < x ? p : -1;  // malformed parents end the walk instead of looping
    }
    anc_s[tid][0] = w0; anc_s[tid][1] = w1; anc_s[tid][2] = w2; anc_s[tid][3] = w3;
  }
  // anc_s is read only after the first __syncthreads of the KV loop.

  // This lane's two rows (fragment rows quad and quad + 8 of the warp's 16).
  const bool warp_active = m0 + warp * 16 < rows;
  const int row_a = m0 + warp * 16 + quad, row_b = row_a + 8;
  const int node_a = min(row_a / group, tree - 1), node_b = min(row_b / group, tree - 1);
  const int local_a = node_a - first_node, local_b = node_b - first_node;
  auto row_offset = [&](int r) -> long long {  // element offset of query row r in q / out
    return ((q_off + r / group) * num_heads + g * group + r % group) * static_cast<long long>(D);
  };

  unsigned q_frag[D / 16][4];  // A fragments of Q [16 rows x D], for the whole KV loop
  {
    const unsigned* qa = reinterpret_cast<const unsigned*>(q + (row_a < rows ? row_offset(row_a) : 0));
    const unsigned* qb = reinterpret_cast<const unsigned*>(q + (row_b < rows ? row_offset(row_b) : 0));
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
      q_frag[kc][0] = row_a < rows ? qa[kc * 8 + tq] : 0u;
      q_frag[kc][1] = row_b < rows ? qb[kc * 8 + tq] : 0u;
      q_frag[kc][2] = row_a < rows ? qa[kc * 8 + 4 + tq] : 0u;
      q_frag[kc][3] = row_b < rows ? qb[kc * 8 + 4 + tq] : 0u;
    }
  }

  float o_acc[D / 8][4];  // O [16 rows x D]: d-tile dt holds columns dt*8 .. dt*8+7
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) o_acc[dt][0] = o_acc[dt][1] = o_acc[dt][2] = o_acc[dt][3] = 0.f;
  float max_a = neg_inf(), max_b = neg_inf(), sum_a = 0.f, sum_b = 0.f;  // sums: this lane's part

  auto load_tile = [&](int tile, int stage) {  // K and V rows tile*64 .. +63 -> stage
    const int kv0 = tile * kBlockN;
    bits16* ks = kv_smem + stage * 2 * kTile;
    bits16* vs = ks + kTile;
#pragma unroll
    for (int i = 0; i < kBlockN * kChunksPerRow / kThreads; ++i) {
      const int c = tid + i * kThreads;  // 16-byte chunk: row c / kChunksPerRow
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      const bool valid = kv0 + r < kv_len;
      const long long src_row = valid ? kv0 + r : 0;
      cp_async_16(smem_u32(ks + r * kStride + col), k_base + src_row * k_row + col, valid);
      cp_async_16(smem_u32(vs + r * kStride + col), v_base + src_row * v_row + col, valid);
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) load_tile(s, s);
    cp_async_commit();  // one group per stage, even if empty, to keep the wait count uniform
  }

  for (int tile = 0; tile < num_tiles; ++tile) {
    cp_async_wait<kStages - 2>();  // this thread's copies of `tile` have landed
    __syncthreads();               // everyone's have; everyone is done with tile - 1's stage
    if (tile + kStages - 1 < num_tiles) load_tile(tile + kStages - 1, (tile + kStages - 1) % kStages);
    cp_async_commit();
    if (!warp_active) continue;

    const bits16* ks = kv_smem + (tile % kStages) * 2 * kTile;
    const bits16* vs = ks + kTile;
    const int kv0 = tile * kBlockN;

    float s_acc[kBlockN / 8][4];  // S [16 rows x 64 keys]: n-tile nt holds keys nt*8 .. nt*8+7
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) s_acc[nt][0] = s_acc[nt][1] = s_acc[nt][2] = s_acc[nt][3] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        // matrices: (keys +0..7, d +0..7), (keys +0..7, d +8..15), (keys +8..15, d +0..7), (+8, +8)
        const int key = np * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int col = kc * 16 + (((lane >> 3) & 1) << 3);
        unsigned kf[4];
        ldmatrix_x4(kf, smem_u32(ks + key * kStride + col));
        mma_16816<kBf16>(s_acc[2 * np], q_frag[kc], kf[0], kf[1]);
        mma_16816<kBf16>(s_acc[2 * np + 1], q_frag[kc], kf[2], kf[3]);
      }
    }

    const bool needs_mask = kv0 + kBlockN > prefix;  // tile reaches the tree (or past kv_len)
    float tile_max_a = neg_inf(), tile_max_b = neg_inf();
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s_acc[nt][e] * scale_log2;
        if (needs_mask) {
          const int t = kv0 + nt * 8 + tq * 2 + (e & 1) - prefix;  // tree index of this key
          const int local = e < 2 ? local_a : local_b;
          const int node = local + first_node;
          const bool visible =
              t < 0 || (t <= node && ((anc_s[local][t >> 6] >> (t & 63)) & 1ull));
          x = visible ? x : neg_inf();
        }
        s_acc[nt][e] = x;
      }
      tile_max_a = fmax2(tile_max_a, fmax2(s_acc[nt][0], s_acc[nt][1]));
      tile_max_b = fmax2(tile_max_b, fmax2(s_acc[nt][2], s_acc[nt][3]));
    }
    const float new_max_a = fmax2(max_a, quad_max(tile_max_a));
    const float new_max_b = fmax2(max_b, quad_max(tile_max_b));
    // A row with no visible key yet keeps max -inf; use 0 as its base so no inf - inf appears.
    const float base_a = new_max_a == neg_inf() ? 0.f : new_max_a;
    const float base_b = new_max_b == neg_inf() ? 0.f : new_max_b;
    const float alpha_a = exp2_approx(max_a - base_a), alpha_b = exp2_approx(max_b - base_b);
    max_a = new_max_a;
    max_b = new_max_b;
    float part_a = 0.f, part_b = 0.f;
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) {
      s_acc[nt][0] = exp2_approx(s_acc[nt][0] - base_a);
      s_acc[nt][1] = exp2_approx(s_acc[nt][1] - base_a);
      s_acc[nt][2] = exp2_approx(s_acc[nt][2] - base_b);
      s_acc[nt][3] = exp2_approx(s_acc[nt][3] - base_b);
      part_a += s_acc[nt][0] + s_acc[nt][1];
      part_b += s_acc[nt][2] + s_acc[nt][3];
    }
    sum_a = sum_a * alpha_a + part_a;
    sum_b = sum_b * alpha_b + part_b;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o_acc[dt][0] *= alpha_a; o_acc[dt][1] *= alpha_a;
      o_acc[dt][2] *= alpha_b; o_acc[dt][3] *= alpha_b;
    }

#pragma unroll
    for (int kc = 0; kc < kBlockN / 16; ++kc) {  // 16 keys at a time: P (registers) x V (smem)
      const unsigned p_frag[4] = {
          pack2<kBf16>(s_acc[2 * kc][0], s_acc[2 * kc][1]),
          pack2<kBf16>(s_acc[2 * kc][2], s_acc[2 * kc][3]),
          pack2<kBf16>(s_acc[2 * kc + 1][0], s_acc[2 * kc + 1][1]),
          pack2<kBf16>(s_acc[2 * kc + 1][2], s_acc[2 * kc + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        // matrices (transposed): (keys +0..7, d +0..7), (keys +8..15, d +0..7), (+0, +8), (+8, +8)
        const int key = kc * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        const int col = dp * 16 + ((lane >> 4) << 3);
        unsigned vf[4];
        ldmatrix_x4_trans(vf, smem_u32(vs + key * kStride + col));
        mma_16816<kBf16>(o_acc[2 * dp], p_frag, vf[0], vf[1]);
        mma_16816<kBf16>(o_acc[2 * dp + 1], p_frag, vf[2], vf[3]);
      }
    }
  }
  cp_async_wait<0>();  // drain the (empty) trailing groups before the block exits

  if (!warp_active) return;
  sum_a = quad_sum(sum_a);
  sum_b = quad_sum(sum_b);
  const float inv_a = sum_a > 0.f ? 1.f / sum_a : 0.f;
  const float inv_b = sum_b > 0.f ? 1.f / sum_b : 0.f;
  if (row_a < rows) {
    unsigned* dst = reinterpret_cast<unsigned*>(out + row_offset(row_a));
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      dst[dt * 4 + tq] = pack2<kBf16>(o_acc[dt][0] * inv_a, o_acc[dt][1] * inv_a);
  }
  if (row_b < rows) {
    unsigned* dst = reinterpret_cast<unsigned*>(out + row_offset(row_b));
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      dst[dt * 4 + tq] = pack2<kBf16>(o_acc[dt][2] * inv_b, o_acc[dt][3] * inv_b);
  }
}

template <bool kBf16, int D>
__device__ __forceinline__ void tree_attention_simple(
    const bits16* __restrict__ q, bits16* __restrict__ out, const int* __restrict__ parents,
    const long long* __restrict__ meta, int num_requests, int num_heads, int num_kv_heads,
    float scale_log2) {
  constexpr int kPerLane = D / 32;  // lane holds columns lane*kPerLane .. +kPerLane-1
  const int node_global = blockIdx.y;
  const int head = blockIdx.x * kSimpleWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (head >= num_heads) return;  // no block-level barriers in this kernel
  const long long* req = meta;
  for (int b = 0; b < num_requests; ++b, req += kMetaFields) {
    if (node_global >= req[8] && node_global < req[8] + req[7]) break;
  }
  const int prefix = static_cast<int>(req[6]);
  const long long q_off = req[8];
  const int node = static_cast<int>(node_global - q_off);
  const int g = head / (num_heads / num_kv_heads);
  const bits16* k_base = reinterpret_cast<const bits16*>(req[0]) + g * req[2] + lane * kPerLane;
  const bits16* v_base = reinterpret_cast<const bits16*>(req[1]) + g * req[4] + lane * kPerLane;
  const long long q_row = (static_cast<long long>(node_global) * num_heads + head) * D + lane * kPerLane;

  float q_reg[kPerLane], acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) { q_reg[i] = to_float<kBf16>(q[q_row + i]); acc[i] = 0.f; }
  float run_max = neg_inf(), run_sum = 0.f;
  auto visit = [&](long long pos) {  // one visible key / value row
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) dot += q_reg[i] * to_float<kBf16>(k_base[pos * req[3] + i]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const float s = dot * scale_log2;
    const float new_max = fmax2(run_max, s);
    const float alpha = exp2_approx(run_max - new_max), p = exp2_approx(s - new_max);
    run_sum = run_sum * alpha + p;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      acc[i] = acc[i] * alpha + p * to_float<kBf16>(v_base[pos * req[5] + i]);
    run_max = new_max;
  };
  for (int pos = 0; pos < prefix; ++pos) visit(pos);
  for (int x = node; x >= 0;) {  // the node itself, then its ancestors
    visit(prefix + x);
    const int p = parents[q_off + x];
    x = p < x ? p : -1;
  }
  const float inv = 1.f / run_sum;
#pragma unroll
  for (int i = 0; i < kPerLane; i += 2) {
    *reinterpret_cast<unsigned*>(out + q_row + i) = pack2<kBf16>(acc[i] * inv, acc[i + 1] * inv);
  }
}

}  // namespace ta

#define TA_DEFINE(SUFFIX, BF16, D)                                                              \
  extern "C" __global__ void __launch_bounds__(ta::kThreads, 1) tree_attention_mma_##SUFFIX(   \
      const unsigned short* q, unsigned short* out, const int* parents, const long long* meta,  \
      int num_heads, int num_kv_heads, float scale_log2) {                                      \
    ta::tree_attention_mma<BF16, D>(q, out, parents, meta, num_heads, num_kv_heads, scale_log2); \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(ta::kSimpleWarps * 32)                           \
      tree_attention_simple_##SUFFIX(const unsigned short* q, unsigned short* out,              \
                                     const int* parents, const long long* meta,                 \
                                     int num_requests, int num_heads, int num_kv_heads,         \
                                     float scale_log2) {                                        \
    ta::tree_attention_simple<BF16, D>(q, out, parents, meta, num_requests, num_heads,          \
                                       num_kv_heads, scale_log2);                               \
  }

TA_DEFINE(f16_d64, false, 64)
TA_DEFINE(f16_d128, false, 128)
TA_DEFINE(bf16_d64, true, 64)
TA_DEFINE(bf16_d128, true, 128)
