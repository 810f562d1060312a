// Tree attention entry points: the extern "C" names the wrapper launches, one per kernel,
// dtype and head size.

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
