// Decode attention over a latent cache (DeepSeek's MLA, absorbed): one cached key a token, shared
// by every query head, whose last value_dim dims are its value. Each sequence's keys are read in
// place through its block table, tile by tile, with an online softmax: one pass over the keys per
// task of kHeads query heads (the keys of a tile stay in L1 for the values' pass over it).
//
// q (B, H, D), k_cache (blocks, block_size, 1, D), tables (B, W), ctx_lens (B,) -> (B, H, value_dim):
// out[b, h] = sum_t softmax_t(scale q[b, h] . k_t) k_t[D - value_dim:], over the sequence's last
// `window` positions (0: all).
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include "../../kernels/include/int8_dot.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

using tokenloom_int8::hsum;

constexpr int64_t kHeads = 4;  // query heads a task scores against each key row it loads
constexpr int64_t kTile = 16;  // positions scored before their values are added

// scores[h] = q[h] . k for N heads (D a multiple of 8); N a constant, so the accumulators stay in registers.
template <int N>
inline void dots(const float* const* q, const float* k, int64_t D, float* scores) {
  __m256 acc[N];
  for (int h = 0; h < N; ++h) acc[h] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 kv = _mm256_loadu_ps(k + i);
    for (int h = 0; h < N; ++h) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + i), kv, acc[h]);
  }
  for (int h = 0; h < N; ++h) scores[h] = hsum(acc[h]);
}

// scores0[h] = q[h] . k0 and scores1[h] = q[h] . k1: two key rows against N heads, each q load used twice.
template <int N>
inline void dots2(const float* const* q, const float* k0, const float* k1, int64_t D, float* scores0, float* scores1) {
  __m256 a0[N], a1[N];
  for (int h = 0; h < N; ++h) a0[h] = a1[h] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 x0 = _mm256_loadu_ps(k0 + i), x1 = _mm256_loadu_ps(k1 + i);
    for (int h = 0; h < N; ++h) {
      const __m256 qv = _mm256_loadu_ps(q[h] + i);
      a0[h] = _mm256_fmadd_ps(qv, x0, a0[h]);
      a1[h] = _mm256_fmadd_ps(qv, x1, a1[h]);
    }
  }
  for (int h = 0; h < N; ++h) {
    scores0[h] = hsum(a0[h]);
    scores1[h] = hsum(a1[h]);
  }
}

// acc[h] = acc[h] * keep[h] + sum_j w[j][h] * rows[j][off:] for N heads, 8 values at a time with the
// heads' sums in registers across the tile's rows (in L1 from the scores): the same operations, in the
// same order, as rescaling and then adding row after row.
template <int N>
inline void tile_values(float* const* acc, const float (*w)[kHeads], const float* const* rows, int64_t count,
                        int64_t off, int64_t Dv, const float* keep) {
  for (int64_t i = 0; i < Dv; i += 8) {
    __m256 a[N];
    for (int h = 0; h < N; ++h) a[h] = _mm256_mul_ps(_mm256_loadu_ps(acc[h] + i), _mm256_set1_ps(keep[h]));
    for (int64_t j = 0; j < count; ++j) {
      const __m256 v = _mm256_loadu_ps(rows[j] + off + i);
      for (int h = 0; h < N; ++h) a[h] = _mm256_fmadd_ps(_mm256_set1_ps(w[j][h]), v, a[h]);
    }
    for (int h = 0; h < N; ++h) _mm256_storeu_ps(acc[h] + i, a[h]);
  }
}

inline void dots_n(const float* const* q, int64_t n, const float* k, int64_t D, float* scores) {
  if (n == kHeads) return dots<kHeads>(q, k, D, scores);
  for (int64_t h = 0; h < n; ++h) dots<1>(q + h, k, D, scores + h);
}

struct Task {
  const float* q;       // (H, D) of the task's sequence
  const int64_t* table; // the sequence's block ids
  int64_t length, first, h0, n;
};

void attend(const Task& t, const float* k_cache, int64_t block_size, int64_t D, int64_t Dv, float scale, float* out) {
  const float* q[kHeads];
  float* acc[kHeads];
  std::vector<float> sums(kHeads * Dv, 0.0f);
  float m[kHeads], l[kHeads];
  for (int64_t h = 0; h < t.n; ++h) {
    q[h] = t.q + (t.h0 + h) * D;
    acc[h] = sums.data() + h * Dv;
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.0f;
  }
  float s[kTile][kHeads];
  const float* rows[kTile];
  float keep[kHeads];
  for (int64_t t0 = t.first; t0 < t.length; t0 += kTile) {
    const int64_t count = std::min(kTile, t.length - t0);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t pos = t0 + j;
      rows[j] = k_cache + (t.table[pos / block_size] * block_size + pos % block_size) * D;
    }
    int64_t j = 0;
    if (t.n == kHeads) {
      for (; j + 1 < count; j += 2) dots2<kHeads>(q, rows[j], rows[j + 1], D, s[j], s[j + 1]);
    }
    for (; j < count; ++j) dots_n(q, t.n, rows[j], D, s[j]);
    for (int64_t h = 0; h < t.n; ++h) {  // the online softmax: what came before rescaled to the new max
      float top = m[h];
      for (int64_t j = 0; j < count; ++j) top = std::max(top, s[j][h] * scale);
      keep[h] = std::exp(m[h] - top);
      l[h] *= keep[h];
      m[h] = top;
      for (int64_t j = 0; j < count; ++j) {
        s[j][h] = std::exp(s[j][h] * scale - top);
        l[h] += s[j][h];
      }
    }
    if (t.n == kHeads) {
      tile_values<kHeads>(acc, s, rows, count, D - Dv, Dv, keep);
    } else {
      for (int64_t h = 0; h < t.n; ++h) {
        float w[kTile][kHeads];
        for (int64_t j = 0; j < count; ++j) w[j][0] = s[j][h];
        tile_values<1>(acc + h, w, rows, count, D - Dv, Dv, keep + h);
      }
    }
  }
  for (int64_t h = 0; h < t.n; ++h) {
    float* o = out + (t.h0 + h) * Dv;
    const float inv = 1.0f / l[h];
    for (int64_t i = 0; i < Dv; ++i) o[i] = acc[h][i] * inv;
  }
}

at::Tensor latent_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& tables,
                         const at::Tensor& ctx_lens, double scale, int64_t value_dim, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous (B, H, D) float32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                  k_cache.size(2) == 1 && k_cache.size(3) == D,
              "k_cache must be contiguous (blocks, block_size, 1, D) float32");
  TORCH_CHECK(D % 8 == 0 && value_dim % 8 == 0 && value_dim > 0 && value_dim <= D,
              "head and value dims must be multiples of 8, the value dims at most the key's");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.size(0) == B,
              "tables must be contiguous (B, W) int64");
  TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.scalar_type() == at::kLong && ctx_lens.size(0) == B,
              "ctx_lens must be (B,) int64");
  const int64_t block_size = k_cache.size(1), W = tables.size(1), blocks = k_cache.size(0);
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= W * block_size, "a context length exceeds its block table");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tp[b * W + i] >= 0 && tp[b * W + i] < blocks, "a block id is out of range");
  }
  at::Tensor out = at::empty({B, H, value_dim}, q.options());
  const int64_t chunks = (H + kHeads - 1) / kHeads;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t task = 0; task < B * chunks; ++task) {
    const int64_t b = task / chunks, h0 = (task % chunks) * kHeads;
    const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    const Task t{qp + b * H * D, tp + b * W, lens[b], first, h0, std::min(kHeads, H - h0)};
    attend(t, kp, block_size, D, value_dim, static_cast<float>(scale), op + b * H * value_dim);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenloom_latent, m) {
  m.def("latent_decode(Tensor q, Tensor k_cache, Tensor tables, Tensor ctx_lens, float scale, int value_dim, "
        "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_latent, CPU, m) { m.impl("latent_decode", &latent_decode); }
