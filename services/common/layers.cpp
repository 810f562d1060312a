// A native model's decoder stack in one call: for decode rows and small trees, torch's dispatcher
// and the Python loop around some dozen ops a layer cost about as much as the arithmetic. The ops
// are the CPU kernels' own, in the order LlamaModel.forward_states runs them, so this path and
// that one give the same bits.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_ops.h"

namespace specserve {

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t kind) {
  return kind == kTiles ? q8matmul(x, w) : qmatmul(x, w, kind);
}

// x [N, hidden] (the embedded rows) through every layer; returns the output of the last, then
// the outputs of the layers in `capture` (ascending). Per layer li: norms[2 li], norms[2 li + 1]
// (input and post-attention RMSNorm weights); blocks[4 li .. 4 li + 3] and kinds (the fused qkv,
// o, fused gate-up and down projections' GGUF blocks, or q8matmul's tiles). cos, sin [N, dim]:
// the rows' RoPE. Per chunk: k_caches[i], v_caches[i] [layers, kv_heads, capacity, dim] and
// attend_'s plan.
std::vector<at::Tensor> layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                               at::TensorList norms, at::TensorList blocks, at::IntArrayRef kinds,
                               at::TensorList k_caches, at::TensorList v_caches,
                               at::IntArrayRef offsets, at::IntArrayRef lengths,
                               at::IntArrayRef starts, at::IntArrayRef tree_starts,
                               at::TensorList visible, int64_t heads, int64_t kv_heads,
                               double eps, at::IntArrayRef capture) {
  const int64_t num_layers = static_cast<int64_t>(norms.size()) / 2;
  TORCH_CHECK(static_cast<int64_t>(blocks.size()) == 4 * num_layers &&
              kinds.size() == blocks.size(), "layers: 2 norms, 4 blocks and 4 kinds per layer");
  TORCH_CHECK(k_caches.size() == v_caches.size() && k_caches.size() == lengths.size(),
              "layers: one K and one V cache per chunk");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "layers: x must be contiguous [rows, hidden]");
  const int64_t rows = x.size(0), dim = cos.size(1), hq = heads * dim, hk = kv_heads * dim;
  const double scale = std::pow(static_cast<double>(dim), -0.5);  // as Python's dim ** -0.5
  std::vector<at::Tensor> out{x};
  std::vector<at::Tensor> kc(k_caches.size()), vc(v_caches.size());
  size_t next = 0;
  for (int64_t li = 0; li < num_layers; ++li) {
    at::Tensor qkv = linear(rms_norm(x, norms[2 * li], eps), blocks[4 * li], kinds[4 * li]);
    rope_(qkv, cos, sin, heads + kv_heads, dim);  // q and k rotated in place
    for (size_t i = 0; i < k_caches.size(); ++i) {
      kc[i] = k_caches[i][li];
      vc[i] = v_caches[i][li];
    }
    at::Tensor attn = at::empty({rows, heads, dim}, x.options());
    attend_(attn, qkv.narrow(1, 0, hq).view({rows, heads, dim}),
            qkv.narrow(1, hq, hk).view({rows, kv_heads, dim}),
            qkv.narrow(1, hq + hk, hk).view({rows, kv_heads, dim}), kc, vc, offsets, lengths, starts,
            tree_starts, visible, scale);
    x = x + linear(attn.view({rows, hq}), blocks[4 * li + 1], kinds[4 * li + 1]);
    at::Tensor gate_up =
        linear(rms_norm(x, norms[2 * li + 1], eps), blocks[4 * li + 2], kinds[4 * li + 2]);
    x = x + linear(silu_mul(gate_up), blocks[4 * li + 3], kinds[4 * li + 3]);
    if (next < capture.size() && capture[next] == li) {
      out.push_back(x);
      ++next;
    }
  }
  out[0] = x;
  return out;
}

}  // namespace specserve

TORCH_LIBRARY_FRAGMENT(specserve_q, m) {
  m.def("layers(Tensor x, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] blocks, int[] kinds, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] offsets, int[] lengths, int[] starts, "
        "int[] tree_starts, Tensor[] visible, int heads, int kv_heads, float eps, int[] capture) "
        "-> Tensor[]", &specserve::layers);
}
