// Grouped matrix-vector products over int8 weights with a float32 scale (and offset) per 32
// values: out[t, g, :] = W[g] x[t, g, :] for G independent (N, K) matrices, each applied to its
// own input. DeepSeek's latent attention needs this per head at decode time (the query through
// k_b, the latent output through v_b): one call instead of a kernel call per head, reading
// GGUF blocks' codes as stored (Q8_0, Q5_0, ... held exactly as int8 codes and scales).
//
// W[g][n][k] = codes[g][n][k] * scales[g][n][k / 32] (+ offsets[g][n][k / 32]).
// Each (group, 16 rows) is one task; a row's codes are read once for all T inputs.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include "../../kernels/include/int8_dot.h"

namespace {

using tokenloom_int8::hsum;

constexpr int64_t kBlock = 32;
constexpr int64_t kRowsPerTask = 16;

// One row of W (K codes, K / 32 scales and offsets) against one input row x (K floats).
inline float row_dot(const int8_t* codes, const float* scales, const float* offsets, const float* x, int64_t K) {
  __m256 acc = _mm256_setzero_ps();
  __m256 acc_offset = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m256 dot = _mm256_setzero_ps();
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < kBlock; j += 8) {
      const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + b * kBlock + j));
      const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8));
      const __m256 xv = _mm256_loadu_ps(x + b * kBlock + j);
      dot = _mm256_fmadd_ps(c, xv, dot);
      if (offsets) sum = _mm256_add_ps(sum, xv);
    }
    acc = _mm256_fmadd_ps(dot, _mm256_set1_ps(scales[b]), acc);
    if (offsets) acc_offset = _mm256_fmadd_ps(sum, _mm256_set1_ps(offsets[b]), acc_offset);
  }
  return hsum(acc) + (offsets ? hsum(acc_offset) : 0.0f);
}

at::Tensor grouped_matvec(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const std::optional<at::Tensor>& offsets) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous (T, G, K) float32");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "codes must be contiguous (G, N, K) int8");
  const int64_t T = x.size(0), G = x.size(1), K = x.size(2), N = codes.size(1);
  TORCH_CHECK(codes.size(0) == G && codes.size(2) == K && K % kBlock == 0, "codes must be (G, N, K) with K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 && scales.size(0) == G &&
                  scales.size(1) == N && scales.size(2) == K / kBlock,
              "scales must be contiguous (G, N, K / 32) float32");
  if (offsets) {
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->scalar_type() == at::kFloat && offsets->is_contiguous(),
                "offsets must be like scales");
  }
  at::Tensor out = at::empty({T, G, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets ? offsets->data_ptr<float>() : nullptr;
  float* outp = out.data_ptr<float>();
  const int64_t tasks_per_group = (N + kRowsPerTask - 1) / kRowsPerTask;
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < G * tasks_per_group; ++task) {
    const int64_t g = task / tasks_per_group;
    const int64_t n0 = (task % tasks_per_group) * kRowsPerTask;
    const int64_t n1 = std::min(N, n0 + kRowsPerTask);
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t row = g * N + n;
      for (int64_t t = 0; t < T; ++t) {
        outp[(t * G + g) * N + n] = row_dot(cp + row * K, sp + row * (K / kBlock),
                                            op ? op + row * (K / kBlock) : nullptr, xp + (t * G + g) * K, K);
      }
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenloom_grouped, m) {
  m.def("grouped_matvec(Tensor x, Tensor codes, Tensor scales, Tensor? offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_grouped, CPU, m) { m.impl("grouped_matvec", &grouped_matvec); }
