// Fused float32 CPU ops for the decoder's glue: each replaces a chain of small torch ops
// (one dispatch and one pass over memory instead of four to six). Row-independent, so a
// row's result does not depend on its batch. Same operation order as layers.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "../../kernels/include/rope_row.h"
#include "../../kernels/include/silu_mul_row.h"

namespace {

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), what, " must be a float32 CPU tensor");
}

// yr = w * (xr * (1 / sqrt(mean(xr^2) + eps))) for one row of H values.
inline void norm_row(const float* xr, const float* w, int64_t H, float eps, float* yr) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) yr[i] = w[i] * (xr[i] * inv);
}

void check_norm_args(const at::Tensor& x, const at::Tensor& w) {
  check_rows(x, "x");
  check_rows(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(),
              "rms_norm wants x (T, H) with unit stride rows and w (H,)");
}

// y = w * (x * (1 / sqrt(mean(x^2) + eps))) per row of x (T, H).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm_args(x, w);
  const int64_t T = x.size(0), H = x.size(1), ld = x.stride(0);
  at::Tensor y = at::empty({T, H}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * ld, wp, H, static_cast<float>(eps), yp + r * H);
  });
  return y;
}

// The residual stream's update and the next norm in one pass: sum = residual + x, then
// y = rms_norm(sum). Returns (y, sum), each (T, H); the same bits as the two ops apart.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& w, double eps) {
  check_norm_args(x, w);
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1, "residual must match x (T, H)");
  const int64_t T = x.size(0), H = x.size(1), ldx = x.stride(0), ldr = residual.stride(0);
  at::Tensor y = at::empty({T, H}, x.options()), sum = at::empty({T, H}, x.options());
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *sp = sum.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* sr = sp + r * H;
      const float *xr = xp + r * ldx, *res = rp + r * ldr;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) sr[i] = res[i] + xr[i];
      norm_row(sr, wp, H, static_cast<float>(eps), yp + r * H);
    }
  });
  return {y, sum};
}

// Rotate-half RoPE: x (T, heads, D) with unit-stride heads, cos/sin (T, 1, R) contiguous, R <= D
// even: the first R dims of each head turned (rope_row.h), the rest copied. Returns a new (T, heads, D).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope wants x (T, heads, D) rows");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), ld = x.stride(0);
  const int64_t R = T > 0 ? cos.numel() / T : D;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * R && sin.numel() == T * R &&
              R <= D && R % 2 == 0, "cos/sin must be contiguous (T, 1, R), R even and at most head_dim");
  at::Tensor y = at::empty({T, NH, D}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *c = cp + r * R, *s = sp + r * R;
      for (int64_t h = 0; h < NH; ++h) rope_row(xp + r * ld + h * D, c, s, yp + (r * NH + h) * D, D, R);
    }
  });
  return y;
}

// silu(gate) * up for gate_up (T, 2I) = [gate | up] -> (T, I) (silu_mul_row.h).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, "silu_mul wants (T, 2I)");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, ld = gate_up.stride(0);
  at::Tensor y = at::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) tokenloom_silu::silu_mul_row(gp + r * ld, gp + r * ld + I, yp + r * I, I);
  });
  return y;
}

// The better of two (value, index) candidates for the first maximum, NaN above everything
// (torch.max's order): b wins if strictly greater, or NaN where a is not; ties keep a, so
// candidates met in index order give the first index.
inline bool beats(float b, float a) { return b > a || (std::isnan(b) && !std::isnan(a)); }

// (value, index) of the first maximum of x[0, n) (index relative to x): the maximum in one
// pass (four independent max chains, NaN noted aside), then the first position holding it.
std::pair<float, int64_t> first_max(const float* x, int64_t n) {
  int64_t i = 0;
  float top = -INFINITY;
  bool nan = false;
  if (n >= 32) {
    __m256 m[4], bad = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) m[j] = _mm256_set1_ps(-INFINITY);
    for (; i + 32 <= n; i += 32)
      for (int j = 0; j < 4; ++j) {
        const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
        m[j] = _mm256_max_ps(m[j], v);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
    for (float v : lanes) top = std::max(top, v);
    nan = _mm256_movemask_ps(bad) != 0;
  }
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    top = std::max(top, x[i]);
  }
  if (nan) {
    for (i = 0; !std::isnan(x[i]); ++i) {}
    return {x[i], i};
  }
  const __m256 t = _mm256_set1_ps(top);
  for (i = 0; i + 8 <= n; i += 8)
    if (const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_EQ_OQ)))
      return {top, i + __builtin_ctz(hit)};
  while (x[i] != top) ++i;
  return {top, i};
}

// Index of the first maximum of each row of x (B, V), NaN counting as the maximum: the same
// as torch.argmax. Each thread scans one range of columns for every row (the ranges the
// column-split LM head wrote, so each core reads what sits in its own cache), then the
// ranges' winners are compared in order.
at::Tensor row_argmax(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1, "row_argmax wants x (B, V), V > 0, unit-stride rows");
  const int64_t B = x.size(0), V = x.size(1), ld = x.stride(0);
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, V / 4096));
  const int64_t span = (V + parts - 1) / parts;
  std::vector<std::pair<float, int64_t>> found(parts * B);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c0 = p * span, c1 = std::min(V, c0 + span);
      for (int64_t b = 0; b < B; ++b) {
        auto [value, index] = first_max(xp + b * ld + c0, c1 - c0);
        found[p * B + b] = {value, c0 + index};
      }
    }
  });
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    auto best = found[b];
    for (int64_t p = 1; p < parts; ++p)
      if (found[p * B + b].second >= 0 && beats(found[p * B + b].first, best.first)) best = found[p * B + b];
    op[b] = best.second;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenloom_fused, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("row_argmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
  m.impl("row_argmax", &row_argmax);
}
