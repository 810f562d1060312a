// Attention of a step's few new rows (decode tokens, draft trees) over each sequence's KV cache,
// on CPU, in one call per layer: the new keys and values are written into the caches, then every
// (row, head) attends to the slots it sees. For a few rows torch's fused kernel spends more in its
// setup than in the arithmetic; a long prompt chunk still goes to torch (a GEMM serves it better).
//
// Each (row, head) walks its visible slots in slot order with the same instructions, so its result
// depends only on those keys and values: a tree node on the accepted path gets bitwise the output
// that plain decoding gets for the same token at the same position.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_ops.h"
#include "simd.h"

namespace {

struct Seq {  // one chunk of the step, as the kernel reads it
  float* k;  // this layer's cache [kv_heads, capacity, dim]
  float* v;
  int64_t capacity;
  int64_t offset, n, start, tree_start;  // rows offset..offset+n; slots start..start+n are new
  const bool* visible;  // [n, start + n - tree_start]: tree slots each row sees; null = causal
};

constexpr int64_t kRows = 4;  // rows of one chunk that share each key read

// Whether row r of s sees slot i (i <= s.start + r).
inline bool sees(const Seq& s, int64_t r, int64_t i) {
  if (i < s.tree_start) return true;
  if (s.visible == nullptr) return i <= s.start + r;
  return s.visible[r * (s.start + s.n - s.tree_start) + i - s.tree_start];
}

// out[d0 .. d0 + NV vectors) of weighted_sum: two sets of NV accumulators, taking the seen slots
// in turn (the k-th goes to set k % 2).
template <int NV>
void weighted_pass(const float* p, const std::vector<int64_t>& seen, const float* V, int64_t dim,
                   int64_t d0, specserve::Vec inv, float* out) {
  using namespace specserve;
  Vec even[NV], odd[NV];
  for (int k = 0; k < NV; ++k) even[k] = odd[k] = vzero();
  const int64_t count = static_cast<int64_t>(seen.size());
  int64_t c = 0;
  for (; c + 1 < count; c += 2) {
    const Vec w0 = vset1(p[seen[c]]), w1 = vset1(p[seen[c + 1]]);
    const float* v0 = V + seen[c] * dim + d0;
    const float* v1 = V + seen[c + 1] * dim + d0;
    for (int k = 0; k < NV; ++k) {
      even[k] = vfma(w0, vload(v0 + k * kWidth), even[k]);
      odd[k] = vfma(w1, vload(v1 + k * kWidth), odd[k]);
    }
  }
  if (c < count) {
    const Vec w0 = vset1(p[seen[c]]);
    const float* v0 = V + seen[c] * dim + d0;
    for (int k = 0; k < NV; ++k) even[k] = vfma(w0, vload(v0 + k * kWidth), even[k]);
  }
  for (int k = 0; k < NV; ++k) vstore(out + d0 + k * kWidth, (even[k] + odd[k]) * inv);
}

// out [dim] = sum of p[i] V[i] over the slots i in `seen`, divided by the sum of their p; the
// k-th seen slot goes to running sum k % 4 of the scalar: independent chains for the core, and
// the same assignment for every row that sees the same slots.
void weighted_sum(const float* p, const std::vector<int64_t>& seen, const float* V, int64_t dim,
                  float* out) {
  using namespace specserve;
  float part[4] = {0, 0, 0, 0};
  for (size_t c = 0; c < seen.size(); ++c) part[c % 4] += p[seen[c]];
  const Vec inv = vset1(1.0f / ((part[0] + part[1]) + (part[2] + part[3])));
  int64_t d0 = 0;
  for (; d0 + 4 * kWidth <= dim; d0 += 4 * kWidth) weighted_pass<4>(p, seen, V, dim, d0, inv, out);
  for (; d0 < dim; d0 += kWidth) weighted_pass<1>(p, seen, V, dim, d0, inv, out);
}

// buf[j * Lp + i] = scale * q_j . K[i] for rows j < nr, slots i < L. Two running sums per dot
// (even and odd vectors of the head), added at the end: every path here computes the same.
template <int NV>
void scores(const float* q, int64_t ldq, int64_t nr, const float* K, int64_t L, float scale,
            float* buf, int64_t Lp) {
  using namespace specserve;
  Vec qv[kRows][NV];  // the rows' queries stay in registers while the keys stream by
  for (int64_t j = 0; j < nr; ++j)
    for (int c = 0; c < NV; ++c) qv[j][c] = vload(q + j * ldq + c * kWidth);
  for (int64_t i = 0; i < L; ++i) {
    Vec kv[NV];
    for (int c = 0; c < NV; ++c) kv[c] = vload(K + i * NV * kWidth + c * kWidth);
    for (int64_t j = 0; j < kRows; ++j) {
      if (j >= nr) break;
      Vec a = vzero(), b = vzero();
      for (int c = 0; c < NV; c += 2) {
        a = vfma(qv[j][c], kv[c], a);
        b = vfma(qv[j][c + 1], kv[c + 1], b);
      }
      buf[j * Lp + i] = vsum(a, b) * scale;
    }
  }
}

void scores_any(const float* q, int64_t ldq, int64_t nr, const float* K, int64_t dim, int64_t L,
                float scale, float* buf, int64_t Lp) {
  using namespace specserve;
  for (int64_t i = 0; i < L; ++i) {
    const float* kr = K + i * dim;
    for (int64_t j = 0; j < nr; ++j) {
      const float* qr = q + j * ldq;
      Vec a = vzero(), b = vzero();
      for (int64_t d = 0; d < dim; d += 2 * kWidth) {
        a = vfma(vload(qr + d), vload(kr + d), a);
        b = vfma(vload(qr + d + kWidth), vload(kr + d + kWidth), b);
      }
      buf[j * Lp + i] = vsum(a, b) * scale;
    }
  }
}

// Rows r0..r1 of s, one head: out = softmax(scale * q . K) @ V over the slots each row sees. The
// scores cover slots 0..start + r1 - 1 padded to whole vectors; a slot a row does not see gets
// weight exactly 0 and is skipped, so what a row computes depends only on the slots it sees, in
// slot order: not on the block's other rows, nor on unseen slots between them.
void attend_rows(const Seq& s, int64_t r0, int64_t r1, const float* q, int64_t ldq, const float* K,
                 const float* V, int64_t dim, float scale, std::vector<float>& buf,
                 std::vector<int64_t>& seen, float* out, int64_t ldo) {
  using namespace specserve;
  const int64_t nr = r1 - r0, L = s.start + r1, Lp = (L + kWidth - 1) / kWidth * kWidth;
  buf.resize(nr * Lp);
  const int64_t nv = dim / kWidth;
  if (nv == 4) {
    scores<4>(q, ldq, nr, K, L, scale, buf.data(), Lp);
  } else if (nv == 8) {
    scores<8>(q, ldq, nr, K, L, scale, buf.data(), Lp);
  } else {
    scores_any(q, ldq, nr, K, dim, L, scale, buf.data(), Lp);
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < nr; ++j) {
    float* p = buf.data() + j * Lp;
    for (int64_t i = s.tree_start; i < Lp; ++i)  // every row sees the prefix
      if (i >= L || !sees(s, r0 + j, i)) p[i] = neg_inf;
    float mx = neg_inf;
    for (int64_t i = 0; i < Lp; ++i) mx = std::max(mx, p[i]);
    for (int64_t i = 0; i < Lp; i += kWidth) {  // weights; unseen slots exactly 0
      const Vec x = vload(p + i);
      vstore(p + i, x == vset1(neg_inf) ? vzero() : vexp(x - vset1(mx)));
    }
    seen.clear();
    for (int64_t i = 0; i < L; ++i)
      if (p[i] != 0.0f) seen.push_back(i);
    weighted_sum(p, seen, V, dim, out + j * ldo);
  }
}

// Copy rows offset..offset+n of x [N, kv_heads, dim] (row stride ld) into cache slots start...
void write_cache(const float* x, int64_t ld, const Seq& s, float* cache, int64_t kv_heads,
                 int64_t dim) {
  for (int64_t r = 0; r < s.n; ++r)
    for (int64_t h = 0; h < kv_heads; ++h)
      std::memcpy(cache + (h * s.capacity + s.start + r) * dim, x + (s.offset + r) * ld + h * dim,
                  dim * sizeof(float));
}

void check_rows(const at::Tensor& x, const char* name, int64_t heads, int64_t dim) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.size(1) == heads &&
              x.size(2) == dim && x.stride(2) == 1 && x.stride(1) == dim,
              "attend_: ", name, " must be float32 [rows, heads, dim] with contiguous heads");
}

}  // namespace

// Fills the rows of `out` [N, heads, dim] that the given chunks own. q [N, heads, dim], k and v
// [N, kv_heads, dim]: the step's new rows. Per chunk i: rows offsets[i] .. + lengths[i];
// k_caches[i], v_caches[i] [kv_heads, capacity, dim] (this layer's); starts[i] (its cache length
// before this forward), tree_starts[i], visible[i] ([n, m] bool, or empty: causal).
void specserve::attend_(at::Tensor out, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, at::TensorList k_caches, at::TensorList v_caches,
                        at::IntArrayRef offsets, at::IntArrayRef lengths, at::IntArrayRef starts,
                        at::IntArrayRef tree_starts, at::TensorList visible, double scale) {
  TORCH_CHECK(q.dim() == 3, "attend_: q must be [rows, heads, dim]");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const size_t chunks = lengths.size();
  TORCH_CHECK(k_caches.size() == chunks && v_caches.size() == chunks && offsets.size() == chunks &&
              starts.size() == chunks && tree_starts.size() == chunks && visible.size() == chunks,
              "attend_: one offset, cache, start and mask per chunk");
  check_rows(q, "q", heads, dim);
  TORCH_CHECK(dim % (2 * specserve::kWidth) == 0, "attend_: head_dim must be a multiple of ",
              2 * specserve::kWidth);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == at::kFloat,
              "attend_: out must be contiguous float32 shaped like q");
  const int64_t kv_heads = k.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0,
              "attend_: heads must be a multiple of kv_heads");
  check_rows(k, "k", kv_heads, dim);
  check_rows(v, "v", kv_heads, dim);
  TORCH_CHECK(k.size(0) == rows && v.size(0) == rows,
              "attend_: q, k and v must have the same rows");
  std::vector<Seq> seqs(chunks);
  // (chunk, rows r0..r1) of each block: a chunk's rows in blocks of even sizes (5 rows: 3 + 2,
  // not 4 + 1), so that the threads, taking (head, block) units in turn, get even shares
  std::vector<std::tuple<size_t, int64_t, int64_t>> blocks;
  for (size_t i = 0; i < chunks; ++i) {
    const at::Tensor &kc = k_caches[i], &vc = v_caches[i], &vis = visible[i];
    const int64_t n = lengths[i], start = starts[i], tree_start = tree_starts[i];
    TORCH_CHECK(kc.dim() == 3 && kc.sizes() == vc.sizes() && kc.size(0) == kv_heads &&
                kc.size(2) == dim && kc.is_contiguous() && vc.is_contiguous() &&
                kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat,
                "attend_: caches must be contiguous float32 [kv_heads, capacity, dim]");
    TORCH_CHECK(0 <= tree_start && tree_start <= start && start + n <= kc.size(1) &&
                0 <= offsets[i] && offsets[i] + n <= rows, "attend_: chunk ", i, " does not fit");
    const int64_t m = start + n - tree_start;
    TORCH_CHECK(vis.numel() == 0 || (vis.scalar_type() == at::kBool && vis.is_contiguous() &&
                                     vis.dim() == 2 && vis.size(0) == n && vis.size(1) == m),
                "attend_: visible[", i, "] must be empty or bool [n, start + n - tree_start]");
    TORCH_CHECK(vis.numel() != 0 || tree_start == start, "attend_: a causal chunk starts its tree");
    seqs[i] = {kc.data_ptr<float>(), vc.data_ptr<float>(), kc.size(1), offsets[i], n, start,
               tree_start, vis.numel() ? vis.data_ptr<bool>() : nullptr};
    write_cache(k.data_ptr<float>(), k.stride(0), seqs[i], seqs[i].k, kv_heads, dim);
    write_cache(v.data_ptr<float>(), v.stride(0), seqs[i], seqs[i].v, kv_heads, dim);
    const int64_t parts = (n + kRows - 1) / kRows, size = (n + parts - 1) / parts;
    for (int64_t r = 0; r < n; r += size) blocks.emplace_back(i, r, std::min(r + size, n));
  }
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = heads / kv_heads, ldq = q.stride(0);
  const int64_t nblocks = static_cast<int64_t>(blocks.size()), units = nblocks * heads;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> buf;
    std::vector<int64_t> seen;
    for (int64_t u = u0; u < u1; ++u) {
      const auto [i, r0, r1] = blocks[u % nblocks];
      const Seq& s = seqs[i];
      const int64_t h = u / nblocks, g = h / group;
      const int64_t head_at = g * s.capacity * dim, row = s.offset + r0;
      attend_rows(s, r0, r1, qp + row * ldq + h * dim, ldq, s.k + head_at, s.v + head_at, dim,
                  static_cast<float>(scale), buf, seen, op + (row * heads + h) * dim, heads * dim);
    }
  });
}

TORCH_LIBRARY_FRAGMENT(specserve_q, m) {
  m.def("attend_(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor(b!)[] k_caches, "
        "Tensor(c!)[] v_caches, int[] offsets, int[] lengths, int[] starts, int[] tree_starts, "
        "Tensor[] visible, float scale) -> ()", &specserve::attend_);
}
