// The feature head's draft forward in one call (services/draft/feature_head.py, served on the
// native kernels): a drafted level is a dozen small ops (two norms and a projection into the
// layer, the decoder layer, a norm and the LM head; for committed positions first the fusion of
// the target's states), and right after a target forward has streamed its weights through the
// caches each torch op's first call is slow: one call runs them all. The steps are the CPU
// kernels' own, in the order FeatureHead runs them.
#include <ATen/ATen.h>
#include <torch/library.h>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_q, m) {
  m.def("head_forward(Tensor state, Tensor embedding, Tensor cos, Tensor sin, Tensor[] norms, "
        "Tensor[] blocks, int[] kinds, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] offsets, "
        "int[] lengths, int[] starts, int[] tree_starts, Tensor[] visible, int heads, int kv_heads, "
        "float eps, Tensor logit_rows, bool fused) -> Tensor[]", &head_forward);
}
