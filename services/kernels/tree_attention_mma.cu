// Tree attention, mma kernel (tensor cores): see tree_attention_common.cu for the layout
// and the design; the wrapper joins the four tree_attention_*.cu files into one NVRTC source.

namespace ta {

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

}  // namespace ta
