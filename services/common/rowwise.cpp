// The small per-row steps of a decoder layer on CPU, one call each instead of torch's five to
// seven (a one-row forward spends more in their dispatch than in their arithmetic). Each row is
// computed on its own, in a fixed order, so a row's result does not depend on the others. And the
// argmax of each row of logits, which greedy verification takes (torch's took about 20 us a row).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_ops.h"
#include "simd.h"

namespace specserve {

// x [rows, hidden] -> x / sqrt(mean(x^2) + eps) * weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "rms_norm: x must be float32 [rows, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == at::kFloat &&
              weight.is_contiguous(), "rms_norm: weight must be float32 [hidden]");
  const int64_t rows = x.size(0), h = x.size(1), ld = x.stride(0);
  at::Tensor y = at::empty({rows, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * ld;
      float part[16] = {0};  // 16 running sums, added in a fixed order
      for (int64_t i = 0; i < h; ++i) part[i % 16] += xr[i] * xr[i];
      float ss = 0;
      for (float p : part) ss += p;
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
      float* yr = yp + r * h;
      for (int64_t i = 0; i < h; ++i) yr[i] = xr[i] * inv * wp[i];
    }
  });
  return y;
}

// In place: the first `heads` heads of each row of x [rows, >= heads * dim] rotated by
// RoPE, with cos, sin [rows, dim] (each half repeated, as Hugging Face's layout).
void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t dim) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
              x.size(1) >= heads * dim, "rope_: x must be float32 [rows, >= heads * dim]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == x.size(0) &&
              cos.size(1) == dim && cos.is_contiguous() && sin.is_contiguous() &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope_: cos and sin must be contiguous float32 [rows, dim]");
  const int64_t rows = x.size(0), ld = x.stride(0), half = dim / 2;
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cp + r * dim;
      const float* s = sp + r * dim;
      for (int64_t hd = 0; hd < heads; ++hd) {
        float* v = xp + r * ld + hd * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] - b * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// gate_up [rows, 2 I] (the fused gate and up projections) -> silu(gate) * up [rows, I], with
// simd.h's exp (torch's silu would round differently on the two forward paths of a native model).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat &&
              gate_up.is_contiguous() && gate_up.size(1) % (2 * kWidth) == 0,
              "silu_mul: gate_up must be contiguous float32 [rows, 2 I], I a multiple of ", kWidth);
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor y = at::empty({rows, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < inter; i += kWidth) {
        const Vec g = vload(gp + r * 2 * inter + i), u = vload(gp + r * 2 * inter + inter + i);
        vstore(yp + r * inter + i, g / (vset1(1.0f) + vexp(vzero() - g)) * u);
      }
    }
  });
  return y;
}

// Each row's index of its largest value, the first where several tie, as torch.argmax (a row
// holding NaN: its first NaN, likewise): the row's max, then the first value equal to it.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be float32 [rows, n > 0] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * ld;
      Vec top = vset1(-std::numeric_limits<float>::infinity());
      bool nan = false;
      int64_t i = 0;
      for (; i + kWidth <= n; i += kWidth) {
        const Vec v = vload(xr + i);
        top = vmax(top, v);
        nan = nan || vany_nan(v);
      }
      float best = vmax_lanes(top);
      for (; i < n; ++i) {
        best = xr[i] > best ? xr[i] : best;
        nan = nan || std::isnan(xr[i]);
      }
      int64_t at = 0;
      if (nan) {
        while (!std::isnan(xr[at])) ++at;
      } else {
        while (at + kWidth <= n && !vany_eq(vload(xr + at), best)) at += kWidth;
        while (!(xr[at] == best)) ++at;
      }
      op[r] = at;
    }
  });
  return out;
}

}  // namespace specserve

TORCH_LIBRARY_FRAGMENT(specserve_q, m) {
  m.def("argmax_rows(Tensor x) -> Tensor", &specserve::argmax_rows);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &specserve::rms_norm);
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int heads, int dim) -> ()", &specserve::rope_);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &specserve::silu_mul);
}
