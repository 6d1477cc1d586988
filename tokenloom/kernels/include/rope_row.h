// Rotate-half RoPE of one head row, shared by the fused rope op (fused_cpu.cpp) and the
// fused decode attention (attention/csrc/paged_decode_cpu.cpp), so a key rotated while
// decoding has the same bits as the same key rotated in a prefill chunk.
#pragma once
#include <algorithm>
#include <cstdint>

// The first R (rotary) of D dims rotated with cos/sin rows c, s of width R: y[d] = x[d] c[d] -
// x[d + R/2] s[d] (first half), x[d] c[d] + x[d - R/2] s[d] (second); dims R..D-1 copied
// unturned (partial rotary, e.g. Phi-4-mini). y may not alias x.
inline void rope_row(const float* x, const float* c, const float* s, float* y, int64_t D, int64_t R) {
  const int64_t half = R / 2;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) y[d] = x[d] * c[d] + (-x[d + half]) * s[d];
#pragma omp simd
  for (int64_t d = half; d < R; ++d) y[d] = x[d] * c[d] + x[d - half] * s[d];
  std::copy(x + R, x + D, y + R);
}
