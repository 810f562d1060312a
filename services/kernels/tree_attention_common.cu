// Tree attention for speculative-decoding verification (CuPy RawModule source, sm_80+).
// This file: the overview, the constants and the device helpers. The kernels are in
// tree_attention_{mma,simple}.cu, their extern "C" names in tree_attention_entry.cu; the wrapper
// joins the four in that order into one NVRTC source (no headers, so no include paths).
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

}  // namespace ta
