// Tree attention, simple kernel (one warp per node and query head, for cross-checking):
// see tree_attention_common.cu.

namespace ta {

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
