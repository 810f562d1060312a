// Attention of a step's new rows (decode tokens, draft trees, prompt chunks) over each sequence's
// KV cache, on CPU, in one call per layer: the new keys and values are written into the caches,
// then every (row, head) attends to the slots it sees. Torch's fused kernel spends more in its
// setup than in the arithmetic for a few rows, is no faster for a long prompt, and blocks a
// prompt's rows by the chunk's shape (other bits for a chunked or a prefix-shared prompt).
//
// Each (row, head) walks its visible slots in slot order with the same instructions, so its result
// depends only on those keys and values: a tree node on the accepted path gets bitwise the output
// that plain decoding gets for the same token at the same position. The rows of a block share
// each key read, and each value read of the slots before the tree (which every row sees); a row's
// dots are summed a whole vector of slots at a time.
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

// Rows of one block, as the weighted sums read them: a row's weights p (over slots, 0 where it
// does not see one), its seen slots from the tree's start on (every row sees the slots before it),
// 1 / the sum of its weights, and where its output goes.
struct RowWeights {
  const float* p;
  const std::vector<int64_t>* tree;
  float inv;
  float* out;
};

// The weighted sums keep two sets of NV accumulators per row for out[d0 .. d0 + NV vectors), the
// k-th slot a row sees going to set k % 2 in turn.
template <int NV>
using Sums = specserve::Vec[2][NV];

// The slots 0 .. end - 1 (end even, before the tree's start: seen by every row, in slot order)
// into NR rows' sums, each V vector read once for all NR rows.
template <int NR, int NV>
void shared_pass(const RowWeights* rows, int64_t end, const float* V, int64_t dim, int64_t d0,
                 Sums<NV>* sums) {
  using namespace specserve;
  Vec even[NR][NV], odd[NR][NV];
  for (int j = 0; j < NR; ++j)
    for (int k = 0; k < NV; ++k) even[j][k] = odd[j][k] = vzero();
  for (int64_t c = 0; c < end; c += 2) {
    const float* v0 = V + c * dim + d0;
    for (int j = 0; j < NR; ++j) {
      const Vec w0 = vset1(rows[j].p[c]), w1 = vset1(rows[j].p[c + 1]);
      for (int k = 0; k < NV; ++k) {
        even[j][k] = vfma(w0, vload(v0 + k * kWidth), even[j][k]);
        odd[j][k] = vfma(w1, vload(v0 + dim + k * kWidth), odd[j][k]);
      }
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int k = 0; k < NV; ++k) {
      sums[j][0][k] = even[j][k];
      sums[j][1][k] = odd[j][k];
    }
}

// One row's slots from `from` on (`from` even: the slots from there to the tree's start, then its
// own tree slots) into its sums; then out = their total / the row's total weight.
template <int NV>
void row_pass(const RowWeights& r, int64_t from, int64_t prefix, const float* V, int64_t dim,
              int64_t d0, Sums<NV>& sums) {
  using namespace specserve;
  Vec even[NV], odd[NV];
  for (int k = 0; k < NV; ++k) {
    even[k] = sums[0][k];
    odd[k] = sums[1][k];
  }
  const int64_t shared = prefix - from, count = shared + static_cast<int64_t>(r.tree->size());
  auto slot = [&](int64_t t) { return t < shared ? from + t : (*r.tree)[t - shared]; };
  int64_t t = 0;
  for (; t + 1 < count; t += 2) {
    const int64_t i0 = slot(t), i1 = slot(t + 1);
    const Vec w0 = vset1(r.p[i0]), w1 = vset1(r.p[i1]);
    for (int k = 0; k < NV; ++k) {
      even[k] = vfma(w0, vload(V + i0 * dim + d0 + k * kWidth), even[k]);
      odd[k] = vfma(w1, vload(V + i1 * dim + d0 + k * kWidth), odd[k]);
    }
  }
  if (t < count) {
    const int64_t i0 = slot(t);
    const Vec w0 = vset1(r.p[i0]);
    for (int k = 0; k < NV; ++k) even[k] = vfma(w0, vload(V + i0 * dim + d0 + k * kWidth), even[k]);
  }
  for (int k = 0; k < NV; ++k) vstore(r.out + d0 + k * kWidth, (even[k] + odd[k]) * vset1(r.inv));
}

// out [dim] of NR rows: the sum of p[i] V[i] over the slots i a row sees, divided by the sum of
// its p (inverse_total, below).
template <int NR>
void weighted_sums(const RowWeights* rows, int64_t prefix, const float* V, int64_t dim) {
  using namespace specserve;
  const int64_t shared = prefix / 2 * 2;
  int64_t d0 = 0;
  for (; d0 + 4 * kWidth <= dim; d0 += 4 * kWidth) {
    Sums<4> sums[NR];
    shared_pass<NR, 4>(rows, shared, V, dim, d0, sums);
    for (int j = 0; j < NR; ++j) row_pass<4>(rows[j], shared, prefix, V, dim, d0, sums[j]);
  }
  for (; d0 < dim; d0 += kWidth) {
    Sums<1> sums[NR];
    shared_pass<NR, 1>(rows, shared, V, dim, d0, sums);
    for (int j = 0; j < NR; ++j) row_pass<1>(rows[j], shared, prefix, V, dim, d0, sums[j]);
  }
}

// Rows whose V reads one pass shares: two where the vectors leave registers for both rows' sums
// (AVX-512's 32), else one.
constexpr int kPairRows = specserve::kWidth == 16 ? 2 : 1;

// 1 / the sum of a row's weights over the slots it sees: the k-th seen slot adds into lane
// k % kWidth of a running vector (the same for every row that sees the same slots, wherever its
// tree starts), whose lanes are then summed.
float inverse_total(const float* p, int64_t prefix, const std::vector<int64_t>& tree) {
  using namespace specserve;
  Vec total = vzero();
  int64_t k = 0;
  for (; k + kWidth <= prefix; k += kWidth) total = total + vload(p + k);
  alignas(64) float rest[kWidth];  // the seen slots from k on, a whole vector at a time
  int m = 0;
  auto add = [&](float w) {
    rest[m++] = w;
    if (m == kWidth) {
      total = total + vload(rest);
      m = 0;
    }
  };
  for (int64_t i = k; i < prefix; ++i) add(p[i]);
  for (int64_t i : tree) add(p[i]);
  if (m) {
    for (int t = m; t < kWidth; ++t) rest[t] = 0.0f;
    total = total + vload(rest);
  }
  return 1.0f / vsum(total, vzero());
}

// buf[j * Lp + i] = scale * q_j . K[i] for rows j < nr, slots i < L (and 0 up to the next whole
// vector). Two running sums per dot (even and odd vectors of the head), added; then a whole
// vector of slots at once has its lanes summed (vsums: the same tree of additions for every slot,
// and a slot's lane is fixed by its index), so every path here computes the same.
template <int NV>
void scores(const float* q, int64_t ldq, int64_t nr, const float* K, int64_t L, float scale,
            float* buf, int64_t Lp) {
  using namespace specserve;
  Vec qv[kRows][NV];  // the rows' queries stay in registers while the keys stream by
  for (int64_t j = 0; j < nr; ++j)
    for (int c = 0; c < NV; ++c) qv[j][c] = vload(q + j * ldq + c * kWidth);
  Vec part[kRows][kWidth];  // per row, each slot's dot still spread over the lanes
  for (int64_t i0 = 0; i0 < L; i0 += kWidth) {
    const int64_t count = std::min<int64_t>(kWidth, L - i0);
    for (int64_t k = 0; k < kWidth; ++k) {
      if (k >= count) {
        for (int64_t j = 0; j < nr; ++j) part[j][k] = vzero();
        continue;
      }
      Vec kv[NV];
      for (int c = 0; c < NV; ++c) kv[c] = vload(K + (i0 + k) * NV * kWidth + c * kWidth);
      for (int64_t j = 0; j < kRows; ++j) {
        if (j >= nr) break;
        Vec a = vzero(), b = vzero();
        for (int c = 0; c < NV; c += 2) {
          a = vfma(qv[j][c], kv[c], a);
          b = vfma(qv[j][c + 1], kv[c + 1], b);
        }
        part[j][k] = a + b;
      }
    }
    for (int64_t j = 0; j < nr; ++j) vstore(buf + j * Lp + i0, vsums(part[j]) * vset1(scale));
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
                 std::vector<int64_t> (&tree)[kRows], float* out, int64_t ldo) {
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
  RowWeights rows[kRows];
  for (int64_t j = 0; j < nr; ++j) {
    float* p = buf.data() + j * Lp;
    for (int64_t i = s.tree_start; i < Lp; ++i)  // every row sees the prefix
      if (i >= L || !sees(s, r0 + j, i)) p[i] = neg_inf;
    Vec top = vset1(neg_inf);
    for (int64_t i = 0; i < Lp; i += kWidth) top = vmax(top, vload(p + i));
    const float mx = vmax_lanes(top);
    for (int64_t i = 0; i < Lp; i += kWidth) {  // weights; unseen slots exactly 0, seen ones not
      const Vec x = vload(p + i);
      vstore(p + i, x == vset1(neg_inf) ? vzero() : vexp(x - vset1(mx)));
    }
    tree[j].clear();
    for (int64_t i = s.tree_start; i < L; ++i)
      if (p[i] != 0.0f) tree[j].push_back(i);
    rows[j] = {p, &tree[j], inverse_total(p, s.tree_start, tree[j]), out + j * ldo};
  }
  int64_t j = 0;
  for (; j + kPairRows <= nr; j += kPairRows)
    weighted_sums<kPairRows>(rows + j, s.tree_start, V, dim);
  for (; j < nr; ++j) weighted_sums<1>(rows + j, s.tree_start, V, dim);
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
    std::vector<int64_t> tree[kRows];
    for (int64_t u = u0; u < u1; ++u) {
      const auto [i, r0, r1] = blocks[u % nblocks];
      const Seq& s = seqs[i];
      const int64_t h = u / nblocks, g = h / group;
      const int64_t head_at = g * s.capacity * dim, row = s.offset + r0;
      attend_rows(s, r0, r1, qp + row * ldq + h * dim, ldq, s.k + head_at, s.v + head_at, dim,
                  static_cast<float>(scale), buf, tree, op + (row * heads + h) * dim, heads * dim);
    }
  });
}

TORCH_LIBRARY_FRAGMENT(specserve_q, m) {
  m.def("attend_(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor(b!)[] k_caches, "
        "Tensor(c!)[] v_caches, int[] offsets, int[] lengths, int[] starts, int[] tree_starts, "
        "Tensor[] visible, float scale) -> ()", &specserve::attend_);
}
