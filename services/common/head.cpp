// The feature head's draft forward in one call (services/draft/feature_head.py, served on the
// native kernels): a drafted level is a dozen small ops (two norms and a projection into the
// layer, the decoder layer, a norm and the LM head; for committed positions first the fusion of
// the target's states), and right after a target forward has streamed its weights through the
// caches each torch op's first call is slow: one call runs them all. The steps are the CPU
// kernels' own, in the order FeatureHead runs them. head_chain drafts whole greedy chains in one
// call: the Python between two levels also slows the target's next forward on a CPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_ops.h"

namespace {

using namespace specserve;

// The target's states [N, layers * hidden] -> the head's input states [N, hidden]: each layer's
// part RMS-normalized by its own weights (feature_norms [layers, hidden]), then the fuse linear.
at::Tensor fuse(const at::Tensor& states, const at::Tensor& feature_norms, const at::Tensor& block,
                int64_t kind, double eps) {
  const int64_t layers = feature_norms.size(0), hidden = feature_norms.size(1);
  TORCH_CHECK(states.dim() == 2 && states.size(1) == layers * hidden,
              "head_forward: the target's states must be [rows, ", layers * hidden, "]");
  std::vector<at::Tensor> parts;
  for (int64_t l = 0; l < layers; ++l)
    parts.push_back(rms_norm(states.narrow(1, l * hidden, hidden), feature_norms[l], eps));
  return linear(at::cat(parts, 1), block, kind);
}

// state [N, hidden] (each row's input state: the head's own output for a tree node), or with
// `fused` the target's states [N, layers * hidden] of committed positions; embedding [N, hidden]:
// each row's token's. norms: the head's embed_norm, state_norm, ln1, ln2, final norm and
// feature_norm; blocks and kinds: input_proj, wqkv, wo, wgu, wd, lm_head and fuse (the last of each
// read only with `fused`). The caches and the plan as layers.cpp takes them. logit_rows [R]: the
// rows whose draft logits are wanted (R = N: all of them, in order). Returns the output states
// [N, hidden] and those rows' logits [R, lm_head's outputs].
std::vector<at::Tensor> head_forward(const at::Tensor& state, const at::Tensor& embedding,
                                     const at::Tensor& cos, const at::Tensor& sin,
                                     at::TensorList norms, at::TensorList blocks,
                                     at::IntArrayRef kinds, at::TensorList k_caches,
                                     at::TensorList v_caches, at::IntArrayRef offsets,
                                     at::IntArrayRef lengths, at::IntArrayRef starts,
                                     at::IntArrayRef tree_starts, at::TensorList visible,
                                     int64_t heads, int64_t kv_heads, double eps,
                                     const at::Tensor& logit_rows, bool fused) {
  TORCH_CHECK(norms.size() == 6 && blocks.size() == 7 && kinds.size() == 7,
              "head_forward: 6 norms, 7 blocks and 7 kinds");
  const at::Tensor g = fused ? fuse(state, norms[5], blocks[6], kinds[6], eps) : state;
  TORCH_CHECK(g.sizes() == embedding.sizes() && g.dim() == 2,
              "head_forward: the states and the embeddings must both be [rows, hidden]");
  const at::Tensor u = linear(at::cat({rms_norm(embedding, norms[0], eps), rms_norm(g, norms[1], eps)}, 1),
                              blocks[0], kinds[0]);
  const at::Tensor out = layers(u, cos, sin, norms.slice(2, 2), blocks.slice(1, 4), kinds.slice(1, 4),
                                k_caches, v_caches, offsets, lengths, starts, tree_starts, visible,
                                heads, kv_heads, eps, {})[0];
  const at::Tensor rows = logit_rows.numel() == out.size(0) ? out : out.index_select(0, logit_rows);
  return {out, linear(rms_norm(rows, norms[4], eps), blocks[5], kinds[5])};
}

// The most likely draft id of each row of logits [P, vocab] (argmax_rows: the first of equal ones)
// and its probability, 1 / sum exp(l - max) over the row.
void top1(const at::Tensor& lg, int64_t vocab, std::vector<int64_t>& ids, std::vector<float>& probs) {
  const at::Tensor best = argmax_rows(lg);
  const float* data = lg.data_ptr<float>();
  const int64_t* at = best.data_ptr<int64_t>();
  ids.assign(at, at + lg.size(0));
  probs.assign(lg.size(0), 0.0f);
  for (int64_t r = 0; r < lg.size(0); ++r) {
    const float* row = data + r * vocab;
    double total = 0.0;
    for (int64_t j = 0; j < vocab; ++j) total += std::exp(static_cast<double>(row[j] - row[ids[r]]));
    probs[r] = static_cast<float>(1.0 / total);
  }
}

// A sampled part's warping (tree_growth.distributions at temperature > 0): temperature, top-k (0:
// none) and top-p over the whole draft vocabulary, then its `support` most likely ids, renormalized.
struct Warp {
  double temperature;
  int64_t top_k;
  double top_p;
  int64_t support;
};

// q of one row of draft logits [vocab] under w, into ids (draft ids, most likely first) and q;
// returns the index drawn with the uniform u in [0, 1).
int64_t sample_row(const float* row, int64_t vocab, const Warp& w, double u, std::vector<int64_t>& ids,
                   std::vector<double>& q) {
  const int64_t cut = w.top_k > 0 && w.top_k < vocab ? w.top_k : vocab;  // top-k's survivors
  const int64_t m = std::min(vocab, std::max(w.support, cut < vocab ? cut : int64_t{0}));
  std::vector<int64_t> order(vocab);
  for (int64_t j = 0; j < vocab; ++j) order[j] = j;
  std::partial_sort(order.begin(), order.begin() + m, order.end(),
                    [row](int64_t a, int64_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  const double top = row[order[0]], kth = cut < vocab ? row[order[cut - 1]] : -INFINITY;
  // exp((l - top) / T): the softmax at temperature T without overflow however small T is
  auto weight = [&](int64_t j) { return std::exp((row[j] - top) / w.temperature); };
  const bool nucleus = w.top_p < 1.0;
  double total = 0.0;  // the top-k survivors' mass, which top-p's cumulative sums divide
  for (int64_t j = 0; j < vocab && nucleus; ++j)
    if (row[j] >= kth) total += weight(j);
  ids.clear();
  q.clear();
  double before = 0.0, kept = 0.0;  // top-p keeps a token while the mass before it is below top_p
  for (int64_t i = 0; i < std::min(m, w.support) && row[order[i]] >= kth && before < w.top_p; ++i) {
    const double v = weight(order[i]);
    if (v == 0.0) break;  // and every later one (a tiny temperature): the level path drops them too
    ids.push_back(order[i]);
    q.push_back(v);
    before += nucleus ? v / total : 0.0;
    kept += v;
  }
  for (double& v : q) v /= kept;
  double below = 0.0;  // the inverse of q's distribution function at u
  for (size_t i = 0; i + 1 < q.size(); ++i)
    if (u < (below += q[i])) return static_cast<int64_t>(i);
  return static_cast<int64_t>(q.size()) - 1;
}

// What a level of head_chain reads besides its rows: head_forward's weights and sizes, the
// parts' caches, the target's embeddings and the rope tables [positions, head_dim].
struct ChainArgs {
  at::TensorList norms, blocks;
  at::IntArrayRef kinds;
  at::TensorList k_caches, v_caches;
  int64_t heads, kv_heads;
  double eps;
  const at::Tensor &embed, &cos_table, &sin_table;
};

// One level of the chains: a row for each part p of `next` (in order) at position last[p] + d,
// reading its parent's output state (row row_of[p] of `out`) and the embedding of its depth-d
// token tokens[p][d - 1], written at slot length[p] of its cache (each part's tree so far is
// causal: every row sees all slots before it). Returns head_forward's output states and logits of
// the rows; row_of and length move on to them.
std::vector<at::Tensor> chain_level(const ChainArgs& a, const std::vector<int64_t>& next, int64_t d,
                                    const at::Tensor& out, at::TensorAccessor<int64_t, 2> tokens,
                                    at::IntArrayRef last, std::vector<int64_t>& row_of,
                                    std::vector<int64_t>& length) {
  const int64_t n = static_cast<int64_t>(next.size());
  std::vector<int64_t> rows(n), targets(n), positions(n), offsets(n), ones(n, 1), starts(n);
  std::vector<at::Tensor> kc(n), vc(n), causal(n, at::empty({0}, at::kBool));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = next[i];
    rows[i] = row_of[p];
    row_of[p] = i;
    targets[i] = tokens[p][d - 1];
    positions[i] = last[p] + d;
    offsets[i] = i;
    starts[i] = length[p]++;
    kc[i] = a.k_caches[p];
    vc[i] = a.v_caches[p];
  }
  const at::Tensor pos = at::tensor(positions, at::kLong);
  return head_forward(out.index_select(0, at::tensor(rows, at::kLong)),
                      a.embed.index_select(0, at::tensor(targets, at::kLong)),
                      a.cos_table.index_select(0, pos), a.sin_table.index_select(0, pos), a.norms, a.blocks,
                      a.kinds, kc, vc, offsets, ones, starts, starts, causal, a.heads, a.kv_heads, a.eps,
                      at::arange(n, at::kLong), false);
}

// Chains for every part at once: head_forward over the parts' committed rows (fused), then one row
// per part and level (chain_level), each reading its parent's output state and the embedding of
// the token its parent's logits chose: the most likely one for a greedy part (temperatures[p] 0),
// until it has `depths[p]` tokens or its path probability falls below `min_mass`; for a sampled
// part one drawn from q (sample_row, with top_ks[p], top_ps[p], the `support_size` most likely
// ids and the uniform uniforms[p][d]), to depths[p]. `last[p]`: the position of the part's last
// committed row (logit_rows[p] of the committed rows); d2t [draft vocab]: draft id -> target id.
// Returns the committed rows' output states [N, hidden] and their last rows' logits [P, lm_head's
// outputs] (as head_forward), each part's target ids [P, max depth] (-1 past its end) and their
// probabilities [P, max depth] (the confidence the trim calibrates), and a sampled part's q per
// level: target ids [P, max depth, support_size] (-1 past its support) and their probabilities
// (float64: the q drawn from), likewise.
std::vector<at::Tensor> head_chain(const at::Tensor& states, const at::Tensor& embedding,
                                   const at::Tensor& cos, const at::Tensor& sin, at::TensorList norms,
                                   at::TensorList blocks, at::IntArrayRef kinds,
                                   at::TensorList k_caches, at::TensorList v_caches,
                                   at::IntArrayRef offsets, at::IntArrayRef lengths,
                                   at::IntArrayRef starts, at::IntArrayRef tree_starts,
                                   at::TensorList visible, int64_t heads, int64_t kv_heads,
                                   double eps, const at::Tensor& logit_rows, const at::Tensor& embed,
                                   const at::Tensor& d2t, const at::Tensor& cos_table,
                                   const at::Tensor& sin_table, at::IntArrayRef depths,
                                   at::IntArrayRef last, double min_mass, int64_t vocab,
                                   at::ArrayRef<double> temperatures, at::IntArrayRef top_ks,
                                   at::ArrayRef<double> top_ps, const at::Tensor& uniforms,
                                   int64_t support_size) {
  const int64_t parts = static_cast<int64_t>(depths.size());
  TORCH_CHECK(parts > 0 && logit_rows.numel() == parts && static_cast<int64_t>(last.size()) == parts &&
              static_cast<int64_t>(lengths.size()) == parts &&
              *std::min_element(depths.begin(), depths.end()) > 0,
              "head_chain: one logit row, last position and depth (at least 1) per part");
  TORCH_CHECK(d2t.scalar_type() == at::kLong && d2t.numel() == vocab && embed.dim() == 2 &&
              embed.scalar_type() == at::kFloat, "head_chain: d2t [vocab] int64, embed [ids, hidden] float32");
  const std::vector<at::Tensor> first = head_forward(states, embedding, cos, sin, norms, blocks, kinds,
                                                     k_caches, v_caches, offsets, lengths, starts,
                                                     tree_starts, visible, heads, kv_heads, eps, logit_rows, true);
  const int64_t most = *std::max_element(depths.begin(), depths.end());
  TORCH_CHECK(static_cast<int64_t>(temperatures.size()) == parts && static_cast<int64_t>(top_ks.size()) == parts &&
              static_cast<int64_t>(top_ps.size()) == parts && uniforms.dim() == 2 && uniforms.size(0) == parts &&
              uniforms.size(1) >= most && uniforms.scalar_type() == at::kDouble && support_size > 0,
              "head_chain: a temperature, top-k, top-p and row of uniforms (float64) per part, a support");
  at::Tensor tokens = at::full({parts, most}, -1, at::kLong), confs = at::zeros({parts, most}, at::kFloat);
  at::Tensor q_ids = at::full({parts, most, support_size}, -1, at::kLong);
  at::Tensor q_probs = at::zeros({parts, most, support_size}, at::kDouble);
  auto tok = tokens.accessor<int64_t, 2>();
  auto conf = confs.accessor<float, 2>();
  auto q_id = q_ids.accessor<int64_t, 3>();
  auto q_prob = q_probs.accessor<double, 3>();
  auto u = uniforms.accessor<double, 2>();
  std::vector<int64_t> support;
  std::vector<double> q;
  const bool greedy_parts = std::count(temperatures.begin(), temperatures.end(), 0.0) > 0;
  const int64_t* target_id = d2t.data_ptr<int64_t>();
  std::vector<double> path(parts, 1.0);
  std::vector<int64_t> next, row_of(parts), length(parts), ids;  // next: the parts drafting a token now
  std::vector<float> probs;
  for (int64_t p = 0; p < parts; ++p) {
    row_of[p] = p;
    length[p] = starts[p] + lengths[p];
    next.push_back(p);
  }
  const ChainArgs args{norms, blocks, kinds, k_caches, v_caches, heads, kv_heads, eps, embed, cos_table, sin_table};
  at::Tensor out = first[0].index_select(0, logit_rows);  // each part's parent state: row row_of[p]
  at::Tensor logits = first[1];  // row i: the logits of the token next[i] drafts now
  for (int64_t d = 0; !next.empty(); ++d) {
    TORCH_CHECK(logits.size(1) >= vocab, "head_chain: logits narrower than the draft vocabulary");
    const at::Tensor lg = logits.narrow(1, 0, vocab).contiguous();
    if (greedy_parts) top1(lg, vocab, ids, probs);
    ids.resize(next.size());
    probs.resize(next.size());
    std::vector<int64_t> going;  // the parts that draft a token at depth d + 2 too
    for (size_t i = 0; i < next.size(); ++i) {
      const int64_t p = next[i];
      if (temperatures[p] > 0.0) {  // drawn from q, which the node records for rejection sampling
        const Warp w{temperatures[p], top_ks[p], top_ps[p], support_size};
        const int64_t j = sample_row(lg.data_ptr<float>() + i * vocab, vocab, w, u[p][d], support, q);
        ids[i] = support[j];
        probs[i] = static_cast<float>(q[j]);
        for (size_t s = 0; s < q.size(); ++s) {
          q_id[p][d][s] = target_id[support[s]];
          q_prob[p][d][s] = q[s];
        }
      }
      tok[p][d] = target_id[ids[i]];
      conf[p][d] = probs[i];
      path[p] *= probs[i];
      // a greedy chain stops where its path is too unlikely to pay; a sampled one where asked
      if (d + 1 < depths[p] && (temperatures[p] > 0.0 || path[p] >= min_mass)) going.push_back(p);
    }
    next = std::move(going);
    if (next.empty()) break;
    std::vector<at::Tensor> level = chain_level(args, next, d + 1, out, tok, last, row_of, length);
    out = level[0];
    logits = level[1];
  }
  return {first[0], first[1], tokens, confs, q_ids, q_probs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_q, m) {
  m.def("head_forward(Tensor state, Tensor embedding, Tensor cos, Tensor sin, Tensor[] norms, "
        "Tensor[] blocks, int[] kinds, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] offsets, "
        "int[] lengths, int[] starts, int[] tree_starts, Tensor[] visible, int heads, int kv_heads, "
        "float eps, Tensor logit_rows, bool fused) -> Tensor[]", &head_forward);
  m.def("head_chain(Tensor states, Tensor embedding, Tensor cos, Tensor sin, Tensor[] norms, "
        "Tensor[] blocks, int[] kinds, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] offsets, "
        "int[] lengths, int[] starts, int[] tree_starts, Tensor[] visible, int heads, int kv_heads, "
        "float eps, Tensor logit_rows, Tensor embed, Tensor d2t, Tensor cos_table, Tensor sin_table, "
        "int[] depths, int[] last, float min_mass, int vocab, float[] temperatures, int[] top_ks, "
        "float[] top_ps, Tensor uniforms, int support) -> Tensor[]", &head_chain);
}
