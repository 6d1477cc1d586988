// silu(g) * u over one row, the one copy of this arithmetic: fused_cpu.cpp's silu_mul, the
// GGUF kernels' gate_up epilogue (quant/csrc/ggml_cpu.cpp) and the AVX2 float32 panel kernel's
// (panel_linear.cpp) give the same bits through it.
// silu(g) = g / (1 + exp(-g)), eight lanes at a time through SLEEF's exp as in ATen's silu.
#pragma once

#include <immintrin.h>
#include <cmath>
#include <cstdint>

extern "C" __m256 Sleef_expf8_u10avx2(__m256);  // in libtorch_cpu: the exp ATen's own silu uses

namespace tokenloom_silu {

// silu(g) of eight lanes.
inline __m256 silu8(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

// y[i] = silu(g[i]) * u[i], i < n.
inline void silu_mul_row(const float* g, const float* u, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
  for (; i < n; ++i) y[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// y (M, I) = silu(g) * u for g = y2[:, :I], u = y2[:, I:] of a gate_up product y2 (M, 2I).
inline void silu_mul_rows(const float* y2, float* y, int64_t M, int64_t I) {
  for (int64_t r = 0; r < M; ++r) silu_mul_row(y2 + r * 2 * I, y2 + r * 2 * I + I, y + r * I, I);
}

}  // namespace tokenloom_silu
