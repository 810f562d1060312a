// x @ w.T on 4-bit and 8-bit blocks with integer dot products, as llama.cpp multiplies them: each
// row of x is rounded to int8 per block of 32 values (one float scale per block), and every weight
// block meets it in 32-bit integer sums (VNNI where the CPU has it, else multiply-add
// instructions, whose pairs of products a 4-bit block sums in 16 bits), scaled into float32 once
// per block.
//
// The weights are repacked at load (services/common/qmatmul.py, `pack_tiles`) into tiles of 16
// outputs, so that a vector's lanes are 16 outputs and not 16 inputs: one tile-block holds, for
// t = 0..3, the 4-byte groups q[o][4t..4t+3] of the 16 outputs in a 64-byte vector (low nibbles;
// the high nibbles hold q[o][16+4t..16+4t+3]), then the 16 scales d and the 16 offsets m as
// float16: 320 bytes, the size of the file's 16 blocks. A weight is q * d + m (Q4_0 packs with
// m = -8 d). So a row's 4 activations broadcast to every lane, and the sums need no horizontal
// reduction at the end. Q8_0 tiles hold, for t = 0..7, the 16 outputs' 4-byte groups
// q[o][4t..4t+3] (signed) and then their 16 scales d: 544 bytes, again the size of the file's 16
// blocks. The product units multiply unsigned by signed bytes: with VNNI a weight enters as
// q + 128 and the row's 128 * sum(x) comes off the integer sum; else as |q| against x carrying q's
// sign (a pair of products stays within int16, where (q + 128) * x would not).
//
// The integer sums are exact, and each (row, output) then runs the same float instructions in
// block order whatever the row count or tile: a row's outputs do not depend on the other rows of
// the call, so plain decoding and a verify tree agree bitwise.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_ops.h"

namespace {

constexpr int kBlock = 32;
constexpr int kTile = 16;                  // outputs per tile
constexpr int kTileBytes = 256 + 32 + 32;  // Q4: nibbles, d and m of 16 blocks
constexpr int kTile8Bytes = 512 + 32;      // Q8_0: bytes and d of 16 blocks

#if defined(__AVX512BW__)
using IVec = __m512i;
using FVec = __m512;
constexpr int kLanes = 16;
inline IVec iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IVec ilow(IVec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline IVec ihigh(IVec v) { return ilow(_mm512_srli_epi16(v, 4)); }
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec ibcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline IVec iadd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
// s + the sums of 4 unsigned-by-signed byte products per 32-bit lane (exact: |q x| <= 15 * 127)
inline IVec dot4(IVec s, IVec w, IVec x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(s, w, x);
#else
  return _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#endif
}
// Without VNNI: the pairs of products in 16-bit lanes, their sums, and those widened to 32 bits
inline IVec pairs(IVec w, IVec x) { return _mm512_maddubs_epi16(w, x); }
inline IVec iadd16(IVec a, IVec b) { return _mm512_add_epi16(a, b); }
inline IVec widen(IVec a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif
inline IVec iflip(IVec v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline IVec iabs(IVec v) { return _mm512_abs_epi8(v); }
// x negated where w < 0 (where w is 0, |w| is too: the product is 0 either way)
inline IVec isign(IVec x, IVec w) {
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
inline IVec isub(IVec a, IVec b) { return _mm512_sub_epi32(a, b); }
inline IVec iset1(int32_t v) { return _mm512_set1_epi32(v); }
inline FVec hload(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline FVec tofloat(IVec a) { return _mm512_cvtepi32_ps(a); }
inline FVec fzero() { return _mm512_setzero_ps(); }
inline FVec fset1(float x) { return _mm512_set1_ps(x); }
inline FVec fmul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
inline FVec ffma(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
inline void fstore(float* p, FVec a) { _mm512_storeu_ps(p, a); }
#else
using IVec = __m256i;
using FVec = __m256;
constexpr int kLanes = 8;
inline IVec iload(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline IVec ilow(IVec v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline IVec ihigh(IVec v) { return ilow(_mm256_srli_epi16(v, 4)); }
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec ibcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline IVec iadd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec dot4(IVec s, IVec w, IVec x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(s, w, x);
#else
  return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}
inline IVec pairs(IVec w, IVec x) { return _mm256_maddubs_epi16(w, x); }
inline IVec iadd16(IVec a, IVec b) { return _mm256_add_epi16(a, b); }
inline IVec widen(IVec a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
#if defined(__AVXVNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif
inline IVec iflip(IVec v) { return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))); }
inline IVec iabs(IVec v) { return _mm256_abs_epi8(v); }
// x negated where w < 0, 0 where w is 0
inline IVec isign(IVec x, IVec w) { return _mm256_sign_epi8(x, w); }
inline IVec isub(IVec a, IVec b) { return _mm256_sub_epi32(a, b); }
inline IVec iset1(int32_t v) { return _mm256_set1_epi32(v); }
inline FVec hload(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline FVec tofloat(IVec a) { return _mm256_cvtepi32_ps(a); }
inline FVec fzero() { return _mm256_setzero_ps(); }
inline FVec fset1(float x) { return _mm256_set1_ps(x); }
inline FVec fmul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline FVec ffma(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
inline void fstore(float* p, FVec a) { _mm256_storeu_ps(p, a); }
#endif
constexpr int kParts = kTile / kLanes;  // vectors per tile row: 1 (AVX-512) or 2 (AVX2)
// Rows per pass over a tile (AVX2 too: beyond 2 rows `tile` sums one part of the tile at a time).
constexpr int kMaxRows = 8;

// x as int8 blocks, per block its scale d, d * sum(q) (for m's term) and sum(q) (exact in a
// float). Block-major, the rows' blocks b side by side: one pointer and a constant offset reach
// every row of a pass (with a pointer per row, 8 rows ran out of registers and took 1.5x the time
// of 7).
constexpr int kScales = 3;
struct Rows {
  const int8_t* q;      // [blocks, stride, 32], at this pass's first row
  const float* scales;  // [blocks, stride, kScales], likewise
  int64_t stride, blocks;
};

// Per 32-bit lane (an output), the sum of a block's 32 products of 4-bit weights (lo: inputs
// 0-15, hi: 16-31) by a row's int8 values q. Without VNNI the products' pairs add up in 16-bit
// lanes and widen once: |w x| <= 15 * 127, so eight pair sums stay within int16 (30,480), and the
// multiply unit runs 9 instructions instead of 16. Exact either way: the same integer.
inline IVec dot32(const IVec* lo, const IVec* hi, const int8_t* q) {
  if constexpr (kVnni) {
    IVec s0 = izero(), s1 = izero();
    for (int t = 0; t < 4; ++t) {
      s0 = dot4(s0, lo[t], ibcast(q + 4 * t));
      s1 = dot4(s1, hi[t], ibcast(q + 16 + 4 * t));
    }
    return iadd(s0, s1);
  } else {
    IVec s = pairs(lo[0], ibcast(q));
    for (int t = 1; t < 4; ++t) s = iadd16(s, pairs(lo[t], ibcast(q + 4 * t)));
    for (int t = 0; t < 4; ++t) s = iadd16(s, pairs(hi[t], ibcast(q + 16 + 4 * t)));
    return widen(s);
  }
}

// The tile-block kAhead blocks on (in this tile or the next: a thread's tiles are adjacent),
// asked into cache before it is needed: on an AVX2 EPYC one- and two-row matmuls ran 7-20%
// faster than on the hardware's prefetch alone. A prefetch past the weights' end faults nothing.
constexpr int kAhead = 8;
template <int Bytes>
inline void prefetch_ahead(const uint8_t* p) {
  for (int i = 0; i < Bytes; i += 64) __builtin_prefetch(p + kAhead * Bytes + i);
}

// y[r, 16 outputs of one tile] for NR rows.
template <int NR>
void tile(const Rows& x, const uint8_t* w, float* y, int64_t ldy) {
  FVec acc[NR][kParts];
  for (int r = 0; r < NR; ++r)
    for (int h = 0; h < kParts; ++h) acc[r][h] = fzero();
  // Block b's lanes h * kLanes .. of the 16 outputs into the rows' sums.
  auto part = [&](int64_t b, int h) {
    const uint8_t* p = w + b * kTileBytes;
    if (h == 0) prefetch_ahead<kTileBytes>(p);
    IVec lo[4], hi[4];
    for (int t = 0; t < 4; ++t) {
      const IVec v = iload(p + 64 * t + 4 * kLanes * h);
      lo[t] = ilow(v);
      hi[t] = ihigh(v);
    }
    const FVec d = hload(p + 256 + 2 * kLanes * h), m = hload(p + 288 + 2 * kLanes * h);
    const int8_t* qb = x.q + b * x.stride * kBlock;  // the rows' blocks b, side by side
    const float* sb = x.scales + b * x.stride * kScales;
    for (int r = 0; r < NR; ++r) {
      const IVec s = dot32(lo, hi, qb + r * kBlock);
      const float* sc = sb + r * kScales;
      acc[r][h] = ffma(tofloat(s), fmul(d, fset1(sc[0])), acc[r][h]);
      acc[r][h] = ffma(m, fset1(sc[1]), acc[r][h]);
    }
  };
  // Either order gives the same bits. One or two rows: both parts in turn, so that AVX2's two
  // chains of dependent sums overlap. More: one part at a time, so that its sums stay in AVX2's 16
  // registers (3 and 4 rows: BENCHMARKS.md, the tile kernel on AVX2).
  if constexpr (kParts > 1 && NR > 2) {
    for (int h = 0; h < kParts; ++h)
      for (int64_t b = 0; b < x.blocks; ++b) part(b, h);
  } else {
    for (int64_t b = 0; b < x.blocks; ++b)
      for (int h = 0; h < kParts; ++h) part(b, h);
  }
  for (int r = 0; r < NR; ++r)
    for (int h = 0; h < kParts; ++h) fstore(y + r * ldy + h * kLanes, acc[r][h]);
}

// The same for a Q8_0 tile.
template <int NR>
void tile8(const Rows& x, const uint8_t* w, float* y, int64_t ldy) {
  FVec acc[NR][kParts];
  for (int r = 0; r < NR; ++r)
    for (int h = 0; h < kParts; ++h) acc[r][h] = fzero();
  for (int64_t b = 0; b < x.blocks; ++b) {
    for (int h = 0; h < kParts; ++h) {
      const uint8_t* p = w + b * kTile8Bytes;
      if (h == 0) prefetch_ahead<kTile8Bytes>(p);
      IVec wq[8], wu[8];  // the signed bytes; the unsigned operand (q + 128, or |q|)
      for (int t = 0; t < 8; ++t) {
        wq[t] = iload(p + 64 * t + 4 * kLanes * h);
        wu[t] = kVnni ? iflip(wq[t]) : iabs(wq[t]);
      }
      const FVec d = hload(p + 512 + 2 * kLanes * h);
      const int8_t* qb = x.q + b * x.stride * kBlock;
      const float* sb = x.scales + b * x.stride * kScales;
      for (int r = 0; r < NR; ++r) {
        const int8_t* q = qb + r * kBlock;
        const float* sc = sb + r * kScales;
        IVec s = izero();
        for (int t = 0; t < 8; ++t) {
          const IVec xv = ibcast(q + 4 * t);
          s = dot4(s, wu[t], kVnni ? xv : isign(xv, wq[t]));
        }
        if (kVnni) s = isub(s, iset1(128 * static_cast<int32_t>(sc[2])));
        acc[r][h] = ffma(tofloat(s), fmul(d, fset1(sc[0])), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int h = 0; h < kParts; ++h) fstore(y + r * ldy + h * kLanes, acc[r][h]);
}

// One tile (w) for `rows` rows (at most kMaxRows) starting at x, in one pass.
template <bool Q8, int NR = kMaxRows>
void rows_pass(const Rows& x, int64_t rows, const uint8_t* w, float* y, int64_t n) {
  if constexpr (NR > 1) {
    if (rows < NR) return rows_pass<Q8, NR - 1>(x, rows, w, y, n);
  }
  if constexpr (Q8)
    tile8<NR>(x, w, y, n);
  else
    tile<NR>(x, w, y, n);
}

// Row r of x [rows, in] as int8 per block of 32: scale d = max|x| / 127, q = round(x / d) (to
// nearest even), d * sum(q) and sum(q); q and scales point at its first block, `rows` rows apart.
void quantize_row(const float* x, int64_t in, int64_t rows, int8_t* q, float* scales) {
  for (int64_t b = 0; b < in / kBlock; ++b, q += rows * kBlock, scales += rows * kScales) {
    const float* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::abs(xb[i]));
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int32_t v = static_cast<int32_t>(__builtin_nearbyintf(xb[i] * inv));
      q[i] = static_cast<int8_t>(v);
      sum += v;
    }
    scales[0] = d;
    scales[1] = d * static_cast<float>(sum);
    scales[2] = static_cast<float>(sum);
  }
}

constexpr int64_t kRowSlab = 32;  // rows that stay in cache while a thread walks its tiles

}  // namespace

at::Tensor specserve::q8matmul(const at::Tensor& x, const at::Tensor& tiles) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "q8matmul: x must be a contiguous float32 [rows, in]");
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == at::kByte && tiles.is_contiguous(),
              "q8matmul: tiles must be contiguous uint8 [out / 16, blocks * 320 or 544]");
  const int64_t rows = x.size(0), in = x.size(1), ntiles = tiles.size(0), ldt = tiles.size(1);
  const int64_t n = ntiles * kTile, blocks = in / kBlock;
  // The tiles' width tells their kind: 320 bytes a block for 4-bit weights, 544 for Q8_0.
  const bool q8 = ldt == blocks * kTile8Bytes;
  TORCH_CHECK(in % kBlock == 0 && (q8 || ldt == blocks * kTileBytes),
              "q8matmul: x has ", in, " inputs, the tiles hold ", ldt, " bytes per 16 outputs");
  std::vector<int8_t> q(rows * in);
  std::vector<float> scales(rows * blocks * kScales);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(xp + r * in, in, rows, q.data() + r * kBlock, scales.data() + r * kScales);
  });
  at::Tensor y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = tiles.data_ptr<uint8_t>();
  at::parallel_for(0, ntiles, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t r = 0; r < rows; r += kRowSlab) {
      const int64_t slab = std::min(kRowSlab, rows - r);
      // Every pass of the slab's rows over one tile before the next: the tile stays in L1.
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t s = 0; s < slab; s += kMaxRows) {
          const Rows part{q.data() + (r + s) * kBlock, scales.data() + (r + s) * kScales, rows,
                          blocks};
          const int64_t nr = std::min<int64_t>(kMaxRows, slab - s);
          float* out = yp + (r + s) * n + t * kTile;
          if (q8)
            rows_pass<true>(part, nr, wp + t * ldt, out, n);
          else
            rows_pass<false>(part, nr, wp + t * ldt, out, n);
        }
      }
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(specserve_q, m) {
  m.def("q8matmul(Tensor x, Tensor tiles) -> Tensor", &specserve::q8matmul);
}
