// The CPU kernels' ops as C++ functions, for one translation unit to call another's without
// torch's dispatcher (layers.cpp runs a whole decoder stack through them).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace specserve {

// qmatmul.cpp: x [rows, in] float32 @ the GGUF blocks raw [out, bytes] of `kind` -> [rows, out].
at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& raw, int64_t kind);
// qmatmul.cpp: rows `ids` of those blocks decoded to float32 -> [len(ids), in].
at::Tensor block_rows(const at::Tensor& raw, const at::Tensor& ids, int64_t kind);

// q8matmul.cpp: x [rows, in] float32 @ 4-bit or Q8_0 weights packed in tiles of 16 outputs
// -> [rows, out].
at::Tensor q8matmul(const at::Tensor& x, const at::Tensor& tiles);

// rowwise.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t dim);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& x);

// layers.cpp: x @ a weight of `kind` (qmatmul.py's KINDS, or kTiles: q8matmul's tiles), and a
// native model's decoder layers over x [rows, hidden] (see there).
constexpr int64_t kTiles = 3;  // qmatmul.py's TILES
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t kind);
std::vector<at::Tensor> layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                               at::TensorList norms, at::TensorList blocks, at::IntArrayRef kinds,
                               at::TensorList k_caches, at::TensorList v_caches,
                               at::IntArrayRef offsets, at::IntArrayRef lengths,
                               at::IntArrayRef starts, at::IntArrayRef tree_starts,
                               at::TensorList visible, int64_t heads, int64_t kv_heads,
                               double eps, at::IntArrayRef capture);

// attention.cpp
void attend_(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef offsets,
             at::IntArrayRef lengths, at::IntArrayRef starts, at::IntArrayRef tree_starts,
             at::TensorList visible, double scale);

}  // namespace specserve
