// Paged attention for one query per sequence (decode), float32, reading the KV cache's
// blocks where they lie instead of gathering them into a padded copy.
//
// q (B, H, D); k_cache, v_cache (num_blocks + 1, block_size, KVH, D); tables (B, W) int64
// block ids; ctx_lens (B,) int64; window: attend to the last `window` positions (<= 0: all).
// Returns (B, H, D). Each sequence is one task; query head h reads kv head h / (H / KVH).
// Two passes per task: scores (q.k * scale) for every position, then softmax and the
// weighted sum of values. A sequence's result does
// not depend on what else is in the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

struct Shapes {
  int64_t H, KVH, G, D, BS, W;
};

// One sequence: its H query heads q (H, D) against positions [start, ctx) -> out (H, D).
// Slots are read whole (all kv heads: KVH * D contiguous floats), in block order, so each
// block (block_size * KVH * D floats) streams from memory once per pass.
void attend(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t start, int64_t ctx,
            const Shapes& s, float scale, float* out, std::vector<float>& scores) {
  const int64_t n = ctx - start, H = s.H, G = s.G, D = s.D, row = s.KVH * D;
  scores.resize(static_cast<size_t>(n * H));
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = start + t;
    const float* k = kc + (table[p / s.BS] * s.BS + p % s.BS) * row;
    if (p % s.BS == 0 && p + s.BS < ctx)               // the next block starts elsewhere: ask for it early
      __builtin_prefetch(kc + table[p / s.BS + 1] * s.BS * row);
    for (int64_t h = 0; h < H; ++h) scores[t * H + h] = dot(q + h * D, k + (h / G) * D, D) * scale;
  }
  std::vector<float> top(H, -INFINITY), total(H, 0.f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < H; ++h) top[h] = std::max(top[h], scores[t * H + h]);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float e = std::exp(scores[t * H + h] - top[h]);
      scores[t * H + h] = e;
      total[h] += e;
    }
  std::fill(out, out + H * D, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = start + t;
    const float* v = vc + (table[p / s.BS] * s.BS + p % s.BS) * row;
    if (p % s.BS == 0 && p + s.BS < ctx)
      __builtin_prefetch(vc + table[p / s.BS + 1] * s.BS * row);
    for (int64_t h = 0; h < H; ++h) axpy(scores[t * H + h], v + (h / G) * D, out + h * D, D);
  }
  for (int64_t h = 0; h < H; ++h) {
    const float inv = 1.f / total[h];
    for (int64_t d = 0; d < D; ++d) out[h * D + d] *= inv;
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& ctx_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous (B, H, D) float32");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "caches must be contiguous (blocks, block_size, kv_heads, head_dim) float32");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous() &&
              tables.size(0) == q.size(0), "tables must be (B, W) int64");
  TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.scalar_type() == at::kLong && ctx_lens.size(0) == q.size(0),
              "ctx_lens must be (B,) int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head_dim or head counts disagree");
  const Shapes s{H, KVH, H / KVH, D, k_cache.size(1), tables.size(1)};
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= s.W * s.BS, "a context length exceeds its block table");
  at::Tensor out = at::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scores;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
      attend(qp + b * H * D, kc, vc, tp + b * s.W, start, lens[b], s, static_cast<float>(scale), op + b * H * D,
             scores);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenloom_attention, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor ctx_lens, float scale, "
        "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_attention, CPU, m) { m.impl("paged_decode", &paged_decode); }
