// The float vector the CPU kernels compute with: AVX-512 where the build machine has it, else
// AVX2 + FMA. Every lane runs the same instructions, so a value's result never depends on the
// lane or the vector it falls in.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace specserve {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kWidth = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec a, Vec b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
// Lane k of the result: the sum of v[k]'s 16 lanes, for k < 16. Halves, then quarters, pairs and
// neighbours are added, so every k's sum takes the same tree of additions.
inline Vec vsums(const Vec* v) {
  Vec w[8], x[4], y[2];
  for (int m = 0; m < 8; ++m)  // lanes 0-7: v[2m]'s halves added; 8-15: v[2m + 1]'s
    w[m] = _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0x44) +
           _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0xEE);
  for (int m = 0; m < 4; ++m)  // quarter q: slot 4m + q's four partial sums
    x[m] = _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0x88) +
           _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], 0xDD);
  for (int m = 0; m < 2; ++m)  // quarter q: two partial sums of slots q + 8m and q + 8m + 4
    y[m] = _mm512_shuffle_ps(x[2 * m], x[2 * m + 1], 0x44) +
           _mm512_shuffle_ps(x[2 * m], x[2 * m + 1], 0xEE);
  // quarter q, place p: slot q + 4p; back to slot order
  const Vec z = _mm512_shuffle_ps(y[0], y[1], 0x88) + _mm512_shuffle_ps(y[0], y[1], 0xDD);
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline bool vany_eq(Vec a, float b) { return _mm512_cmpeq_ps_mask(a, _mm512_set1_ps(b)) != 0; }
inline bool vany_nan(Vec a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }
inline float vmax_lanes(Vec a) { return _mm512_reduce_max_ps(a); }
#else
using Vec = __m256;
constexpr int kWidth = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec a, Vec b) {
  const __m256 s = _mm256_add_ps(a, b);
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}
// Lane k of the result: the sum of v[k]'s 8 lanes, for k < 8, by the same tree for every k.
inline Vec vsums(const Vec* v) {
  Vec w[4], y[2];
  for (int m = 0; m < 4; ++m)  // lanes 0-3: v[2m]'s halves added; 4-7: v[2m + 1]'s
    w[m] = _mm256_permute2f128_ps(v[2 * m], v[2 * m + 1], 0x20) +
           _mm256_permute2f128_ps(v[2 * m], v[2 * m + 1], 0x31);
  for (int m = 0; m < 2; ++m)  // half h: two partial sums of slots 4m + h and 4m + h + 2
    y[m] = _mm256_shuffle_ps(w[2 * m], w[2 * m + 1], 0x44) +
           _mm256_shuffle_ps(w[2 * m], w[2 * m + 1], 0xEE);
  // half h, place p: slot h + 2p; back to slot order
  const Vec z = _mm256_shuffle_ps(y[0], y[1], 0x88) + _mm256_shuffle_ps(y[0], y[1], 0xDD);
  return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline bool vany_eq(Vec a, float b) {
  return _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(b), _CMP_EQ_OQ)) != 0;
}
inline bool vany_nan(Vec a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0; }
inline float vmax_lanes(Vec a) {
  __m128 v = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  v = _mm_max_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_max_ss(v, _mm_movehdup_ps(v)));
}
#endif

// exp(x) lane by lane, about 2 ulp: x = n ln2 + r, a degree-6 polynomial in r (Cephes' expf
// coefficients), times 2^n built in the exponent bits. x is clamped to [-87, 88]: below, 2^-126
// rather than a subnormal (softmax zeroes masked lanes itself); above, about 1.7e38, not inf.
inline Vec vexp(Vec x) {
  using Ints = int32_t __attribute__((vector_size(sizeof(Vec))));
  const Vec lo = vset1(-87.0f), hi = vset1(88.0f), magic = vset1(12582912.0f);  // 1.5 * 2^23
  x = x < lo ? lo : x > hi ? hi : x;
  const Vec n = (x * vset1(1.44269504f) + magic) - magic;
  const Vec r = (x - n * vset1(0.693359375f)) - n * vset1(-2.12194440e-4f);
  Vec p = vset1(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    p = p * r + vset1(c);
  const Vec y = p * r * r + r + vset1(1.0f);
  const Ints bits = (__builtin_convertvector(n, Ints) + 127) << 23;
  return y * reinterpret_cast<const Vec&>(bits);
}

}  // namespace specserve
