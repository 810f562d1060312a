// x @ w.T on a GGUF file's own blocks (Q4_0, Q4_1, Q8_0), float32 activations; AVX-512 where the
// build machine has it, else AVX2 + FMA + F16C.
//
// Each block of 32 weights is decoded to exactly the float32 values the dequantized model holds
// (q * d + m in one FMA: the product is exact), then multiplied into float32 accumulators. Every
// (row, output) pair runs the same instruction sequence whatever the row count and the tile it
// falls in: two accumulators (a block's vectors alternate between them), summed in a fixed order
// at the end. So a row's outputs do not depend on the other rows of the call (plain decoding and
// a verify tree agree bitwise). Tiles of several outputs (one row) or rows x outputs only give
// the core independent dependency chains, and decode each block once for the rows of a tile.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu_ops.h"
#include "simd.h"

namespace {

using specserve::Vec;
using specserve::vfma;
using specserve::vload;
using specserve::vstore;
using specserve::vsum;
using specserve::vzero;

constexpr int kBlock = 32;
enum Kind : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

inline int block_bytes(int64_t kind) { return kind == kQ4_1 ? 20 : kind == kQ4_0 ? 18 : 34; }

// One block's 32 weights decoded into kVecs of simd.h's vectors, per instruction set.
#if defined(__AVX512F__)
constexpr int kVecs = 2;

template <int64_t KIND>
inline void decode(const uint8_t* blk, Vec w[kVecs]) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  uint32_t head;
  std::memcpy(&head, blk, 4);
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(head)));  // [d, m or q, ..]
  const __m512 d = _mm512_broadcastss_ps(dm);
  if (KIND == kQ8_0) {
    for (int i = 0; i < 2; ++i) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * i));
      w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
    }
    return;
  }
  // The 16 values a nibble can take, q * d + m (Q4_1) or (q - 8) * d (Q4_0): one rounding, as
  // dequantization; each byte then picks its two from the table (the permute reads 4 index bits).
  const __m512 table = KIND == kQ4_1
      ? _mm512_fmadd_ps(iota, d, _mm512_broadcastss_ps(_mm_movehdup_ps(dm)))
      : _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.0f)), d);
  const __m512i bytes = _mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (KIND == kQ4_1 ? 4 : 2))));
  w[0] = _mm512_permutexvar_ps(bytes, table);  // low nibbles: values 0..15 of the block
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);  // high: 16..31
}
#else
constexpr int kVecs = 4;

inline float half_at(const uint8_t* p) {
  return _cvtsh_ss(static_cast<unsigned short>(p[0] | (p[1] << 8)));
}

inline __m256 widen(__m128i bytes8, bool is_signed) {  // the low 8 bytes -> 8 floats
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}

template <int64_t KIND>
inline void decode(const uint8_t* blk, Vec w[kVecs]) {
  const __m256 d = _mm256_set1_ps(half_at(blk));
  if (KIND == kQ8_0) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    w[0] = _mm256_mul_ps(widen(a, true), d);
    w[1] = _mm256_mul_ps(widen(_mm_srli_si128(a, 8), true), d);
    w[2] = _mm256_mul_ps(widen(b, true), d);
    w[3] = _mm256_mul_ps(widen(_mm_srli_si128(b, 8), true), d);
    return;
  }
  // Low nibbles hold values 0..15 of the block, high nibbles 16..31.
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (KIND == kQ4_1 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(qs, mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
  if (KIND == kQ4_0) {  // value (q - 8) * d
    const __m128i eight = _mm_set1_epi8(8);
    lo = _mm_sub_epi8(lo, eight);
    hi = _mm_sub_epi8(hi, eight);
  }
  const bool sgn = KIND == kQ4_0;
  w[0] = widen(lo, sgn), w[1] = widen(_mm_srli_si128(lo, 8), sgn);
  w[2] = widen(hi, sgn), w[3] = widen(_mm_srli_si128(hi, 8), sgn);
  if (KIND == kQ4_1) {  // value q * d + m: one rounding, as dequantization
    const __m256 m = _mm256_set1_ps(half_at(blk + 2));
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(w[i], d, m);
  } else {
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(w[i], d);
  }
}
#endif

// y[r, o] for NR rows from x and NO consecutive outputs from w.
template <int64_t KIND, int NR, int NO>
inline void tile(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t blocks,
                 float* y, int64_t ldy) {
  constexpr int bb = KIND == kQ4_1 ? 20 : KIND == kQ4_0 ? 18 : 34;
  constexpr int lanes = kBlock / kVecs;
  Vec acc[NR][NO][2];
  for (int r = 0; r < NR; ++r)
    for (int o = 0; o < NO; ++o) acc[r][o][0] = acc[r][o][1] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int o = 0; o < NO; ++o) {  // one block's vectors live at a time
      // Weights four tiles ahead (a hint: past the end it is dropped, not a fault): several
      // rows' blocks read side by side defeat the hardware prefetcher.
      _mm_prefetch(reinterpret_cast<const char*>(w + (o + 4 * NO) * ldw + b * bb), _MM_HINT_T0);
      Vec wv[kVecs];
      decode<KIND>(w + o * ldw + b * bb, wv);
      for (int r = 0; r < NR; ++r) {
        const float* xb = x + r * ldx + b * kBlock;
        for (int i = 0; i < kVecs; ++i)
          acc[r][o][i & 1] = vfma(vload(xb + lanes * i), wv[i], acc[r][o][i & 1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int o = 0; o < NO; ++o) y[r * ldy + o] = vsum(acc[r][o][0], acc[r][o][1]);
}

// Outputs per tile for NR rows: enough independent sums to keep the core busy, few enough that
// the accumulators (2 per row and output) and the decoded blocks fit AVX-512's 32 registers.
constexpr int outputs_per_tile(int nr) { return nr == 1 ? 4 : nr <= 4 ? 2 : 1; }

// Outputs [o0, o1) of NR rows: outputs_per_tile(NR) per tile, then one by one.
template <int64_t KIND, int NR>
void row_tile(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t blocks, float* y,
              int64_t n, int64_t o0, int64_t o1) {
  constexpr int NO = outputs_per_tile(NR);
  int64_t o = o0;
  for (; o + NO <= o1; o += NO) tile<KIND, NR, NO>(x, ldx, w + o * ldw, ldw, blocks, y + o, n);
  for (; o < o1; ++o) tile<KIND, NR, 1>(x, ldx, w + o * ldw, ldw, blocks, y + o, n);
}

// Outputs [o0, o1) of every row: rows by kMaxRows (each decoded block serves every row of its
// tile), the rest in one tile of as many rows: a 5-row verify reads the weights once, not twice.
#if defined(__AVX512F__)
constexpr int kMaxRows = 8;
#else
constexpr int kMaxRows = 2;
#endif

template <int64_t KIND, int NR = kMaxRows>
void rest(const float* x, int64_t ldx, int64_t rows, const uint8_t* w, int64_t ldw, int64_t blocks,
          float* y, int64_t n, int64_t o0, int64_t o1) {
  if constexpr (NR > 1) {
    if (rows < NR) return rest<KIND, NR - 1>(x, ldx, rows, w, ldw, blocks, y, n, o0, o1);
  }
  row_tile<KIND, NR>(x, ldx, w, ldw, blocks, y, n, o0, o1);
}

template <int64_t KIND>
void outputs(const float* x, int64_t rows, const uint8_t* w, int64_t ldw, int64_t blocks, float* y,
             int64_t n, int64_t o0, int64_t o1) {
  const int64_t ldx = blocks * kBlock;
  int64_t r = 0;
  for (; r + kMaxRows <= rows; r += kMaxRows)
    row_tile<KIND, kMaxRows>(x + r * ldx, ldx, w, ldw, blocks, y + r * n, n, o0, o1);
  if (r < rows) rest<KIND>(x + r * ldx, ldx, rows - r, w, ldw, blocks, y + r * n, n, o0, o1);
}

// Rows of x in slabs that stay in cache while a thread walks its outputs.
constexpr int64_t kRowSlab = 32;

}  // namespace

at::Tensor specserve::qmatmul(const at::Tensor& x, const at::Tensor& raw, int64_t kind) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "qmatmul: x must be a contiguous float32 [rows, in]");
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(),
              "qmatmul: raw must be contiguous uint8 [out, blocks * block bytes]");
  TORCH_CHECK(kind == kQ4_0 || kind == kQ4_1 || kind == kQ8_0, "qmatmul: unknown block kind ", kind);
  const int64_t rows = x.size(0), k = x.size(1), n = raw.size(0), ldw = raw.size(1);
  TORCH_CHECK(k % kBlock == 0 && ldw == k / kBlock * block_bytes(kind),
              "qmatmul: x has ", k, " inputs, the blocks hold ", ldw, " bytes per output");
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = raw.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = k / kBlock;
  // Threads split the outputs (each reads its share of the weights once per row slab).
  at::parallel_for(0, n / 4 + (n % 4 != 0), 16, [&](int64_t c0, int64_t c1) {
    const int64_t o0 = c0 * 4, o1 = std::min(n, c1 * 4);
    for (int64_t r = 0; r < rows; r += kRowSlab) {
      const int64_t nr = std::min(kRowSlab, rows - r);
      const float* xs = xp + r * k;
      float* ys = yp + r * n;
      if (kind == kQ4_0) outputs<kQ4_0>(xs, nr, wp, ldw, blocks, ys, n, o0, o1);
      else if (kind == kQ4_1) outputs<kQ4_1>(xs, nr, wp, ldw, blocks, ys, n, o0, o1);
      else outputs<kQ8_0>(xs, nr, wp, ldw, blocks, ys, n, o0, o1);
    }
  });
  return y;
}

// Rows `ids` of the blocks raw [out, blocks * block bytes] decoded as the matmul decodes them
// (the embedding's lookup: one call instead of torch's ten small ops, which run cold after a kernel).
at::Tensor specserve::block_rows(const at::Tensor& raw, const at::Tensor& ids, int64_t kind) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(),
              "block_rows: raw must be contiguous uint8 [out, blocks * block bytes]");
  TORCH_CHECK(kind == kQ4_0 || kind == kQ4_1 || kind == kQ8_0, "block_rows: unknown block kind ", kind);
  TORCH_CHECK(raw.size(1) % block_bytes(kind) == 0, "block_rows: rows of ", raw.size(1),
              " bytes are not whole blocks");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "block_rows: ids must be a contiguous int64 vector");
  const int64_t n = ids.size(0), out = raw.size(0), ldw = raw.size(1), bb = block_bytes(kind);
  const int64_t blocks = ldw / bb;
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(0 <= ip[r] && ip[r] < out, "block_rows: row ", ip[r], " outside the weight's ", out);
  at::Tensor y = at::empty({n, blocks * kBlock}, raw.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  constexpr int kLanes = kBlock / kVecs;
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = raw.data_ptr<uint8_t>() + ip[r] * ldw;
    for (int64_t b = 0; b < blocks; ++b) {
      Vec w[kVecs];
      if (kind == kQ4_0) decode<kQ4_0>(row + b * bb, w);
      else if (kind == kQ4_1) decode<kQ4_1>(row + b * bb, w);
      else decode<kQ8_0>(row + b * bb, w);
      float* yb = yp + (r * blocks + b) * kBlock;
      for (int i = 0; i < kVecs; ++i) vstore(yb + i * kLanes, w[i]);
    }
  }
  return y;
}

TORCH_LIBRARY(specserve_q, m) {
  m.def("qmatmul(Tensor x, Tensor raw, int kind) -> Tensor", &specserve::qmatmul);
  m.def("block_rows(Tensor raw, Tensor ids, int kind) -> Tensor", &specserve::block_rows);
}
