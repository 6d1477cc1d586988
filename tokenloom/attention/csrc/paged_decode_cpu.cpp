// Paged attention for one query per sequence (decode), float32, reading the KV cache's
// blocks where they lie instead of gathering them into a padded copy.
//
// q (B, H, D); k_cache, v_cache (num_blocks + 1, block_size, KVH, D); tables (B, W) int64
// block ids; ctx_lens (B,) int64; window: attend to the last `window` positions (<= 0: all);
// softcap > 0: scores -> tanh(scores / softcap) * softcap before the softmax (Gemma 2);
// sinks (H,) float32 or undefined: head h's softmax also counts exp(sinks[h]) in its
// denominator, a score with no value behind it (gpt-oss's attention sinks).
// Returns (B, H, D). Query head h reads kv head h / (H / KVH). Each sequence is one task
// (with fewer sequences than threads: shared by all of them, or split by kv head when short;
// decode_all): scores (q.k * scale) of
// its heads for every position, a softmax (exp vectorized through SLEEF, which libtorch
// exports), then the weighted sum of values. Each head's arithmetic is fixed, so a
// sequence's result does not depend on what else is in the batch or how it was split.
// The AVX-512 build computes head sizes 32/64/128/256 with 16-lane vectors (attend512), other
// head sizes as the AVX2 build does.
// paged_decode_int8 and paged_decode_int4 are the same attention over an int8 cache (codes and
// per-(slot, kv head) scales) and an int4 one (q4_0: codes two a byte, a float16 scale per group
// of 32 elements), read in place (their section below): 16 lanes where the AVX-512 build's head
// size is a multiple of 16, else 8 where it is a multiple of 8, else (int8 only) scalar.
// paged_decode_half is the same over a 16-bit cache (float16 or bfloat16 elements, no scales),
// each element widened to float32 exactly as it is read.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../kernels/include/rope_row.h"
#include "paged_rows.h"
#include "stored_checks.h"
#include "stored_lanes.h"

extern "C" __m256 Sleef_expf8_u10avx2(__m256);   // in libtorch_cpu (1-ulp exp, 8 lanes)
extern "C" __m256 Sleef_tanhf8_u10avx2(__m256);  // in libtorch_cpu (1-ulp tanh, 8 lanes)

// Built twice: for AVX2, and as tokenloom_attention512 with AVX-512 paths for head sizes 32/64/128/256.
#if defined(__AVX512F__)
#define TOKENLOOM_ATTENTION_LIBRARY tokenloom_attention512
#else
#define TOKENLOOM_ATTENTION_LIBRARY tokenloom_attention
#endif

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

// x[i] = exp(x[i] - m) in place over n scores, m = max(max(x), sink); returns their sum plus
// exp(sink - m) (sink -INFINITY: none, and the sum is the scores' alone).
float softmax_numerator(float* x, int64_t n, float sink = -INFINITY) {
  float top = sink;
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < n; ++i) top = std::max(top, x[i]);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (i < n) {                                     // the tail, padded with -inf (exp -> 0)
    alignas(32) float tail[8];
    for (int64_t j = 0; j < 8; ++j) tail[j] = i + j < n ? x[i + j] : -INFINITY;
    const __m256 e = Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_load_ps(tail), shift));
    _mm256_store_ps(tail, e);
    for (int64_t j = 0; i + j < n; ++j) x[i + j] = tail[j];
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float total = 0.f;
  for (float lane : lanes) total += lane;
  return sink == -INFINITY ? total : total + std::exp(sink - top);
}

struct Shapes {
  int64_t H, KVH, G, D, BS, W;
  float softcap;  // > 0: scores soft-capped (soft_cap); 0: not
  const float* sinks = nullptr;  // (H,) each head's sink logit; nullptr: none
  float sink(int64_t h) const { return sinks ? sinks[h] : -INFINITY; }
};

// x[i] = tanh(x[i] / cap) * cap over n scores, 8 lanes at a time (transformers' eager order).
void soft_cap(float* x, int64_t n, float cap) {
  const __m256 c = _mm256_set1_ps(cap);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, _mm256_mul_ps(Sleef_tanhf8_u10avx2(_mm256_div_ps(_mm256_loadu_ps(x + i), c)), c));
  if (i < n) {
    alignas(32) float tail[8] = {};
    std::copy(x + i, x + n, tail);
    _mm256_store_ps(tail, _mm256_mul_ps(Sleef_tanhf8_u10avx2(_mm256_div_ps(_mm256_load_ps(tail), c)), c));
    std::copy(tail, tail + (n - i), x + i);
  }
}

// Soft-caps the score rows (stride n) of heads [h0, h1) when the model asks for it.
inline void cap_heads(float* scores, int64_t n, int64_t h0, int64_t h1, const Shapes& s) {
  if (s.softcap > 0.f)
    for (int64_t h = h0; h < h1; ++h) soft_cap(scores + h * n, n, s.softcap);
}

// Ask for slot rows [t0, t1) of `rows` (bytes [first, first + bytes) of each) ahead of use: the
// slots are scattered in 16-position blocks, where the hardware prefetcher loses the stream,
// and without this the kernel waits on DRAM latency, reading at a fraction of the machine's
// bandwidth (docs/BENCHMARKS.md, 'Measurements behind design choices').
template <int Locality = 3>
inline void prefetch_rows(const std::vector<const float*>& rows, int64_t t0, int64_t t1, int64_t bytes,
                          int64_t first = 0) {
  for (int64_t t = t0; t < std::min<int64_t>(t1, rows.size()); ++t)
    for (int64_t b = first; b < first + bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows[t]) + b, 0, Locality);
}

// Cache lines of rows [t, t_end) (bytes [first, first + bytes) of each) to fetch a few at a
// time between pieces of work, instead of in one burst: each waiting fetch holds one of the
// core's few fill buffers, and a tile's ~380 fetches at once stalled the kernel on them.
template <int Locality>
struct RowFetch {
  const std::vector<const float*>* rows = nullptr;
  int64_t t = 0, t_end = 0, first = 0, bytes = 0, off = 0;
  void start(const std::vector<const float*>& r, int64_t t0, int64_t t1, int64_t b, int64_t f) {
    rows = &r; t = t0; t_end = std::min<int64_t>(t1, r.size()); bytes = b; first = f; off = 0;
  }
  int64_t lines() const { return t < t_end ? (t_end - t) * ((bytes + 63) / 64) : 0; }
  inline void next(int64_t count) {
    for (; count > 0 && t < t_end; --count) {
      __builtin_prefetch(reinterpret_cast<const char*>((*rows)[t]) + first + off, 0, Locality);
      off += 64;
      if (off >= bytes) off = 0, ++t;
    }
  }
};

// Sum of each of 8 vectors' lanes -> one vector of 8 sums (lane i = sum of v[i]).
inline __m256 reduce8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Eight dot products of length D (D % 8 == 0) side by side, scaled, into out[dst[i]] for i < m.
inline void dots8(const float* const* qs, const float* const* ks, const int64_t* dst, int m, int64_t D, float scale,
                  float* out) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8)
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[i] + d), _mm256_loadu_ps(ks[i] + d), acc[i]);
  alignas(32) float sums[8];
  _mm256_store_ps(sums, _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale)));
  for (int i = 0; i < m; ++i) out[dst[i]] = sums[i];
}

// scores (H, n), rows [h0, h1): q_h . k_t * scale (head h reads kv head h / G), position by
// position. Eight (position, head) dot products run side by side (independent FMA chains),
// which keeps a 64-wide dot from waiting on its own additions; a lane's arithmetic does not
// depend on its neighbours, so a head's scores are the same bits whatever range it is
// computed in. Needs D % 8 == 0.
void scores_simd(const float* q, const Rows& rows, int64_t n, int64_t h0, int64_t h1, const Shapes& s, float scale,
                 float* scores) {
  const float* qs[8];
  const float* ks[8];
  int64_t dst[8];
  int m = 0;
  const int64_t bytes = s.KVH * s.D * sizeof(float);
  prefetch_rows(rows.k, 0, 16, bytes);
  for (int64_t t = 0; t < n; ++t) {
    prefetch_rows(rows.k, t + 16, t + 17, bytes);
    prefetch_rows<2>(rows.v, t + 8, t + 9, bytes);       // values: into L2 now, read after the softmax
    for (int64_t h = h0, g = h0 / s.G, j = h0 % s.G; h < h1; ++h) {
      qs[m] = q + h * s.D;
      ks[m] = rows.k[t] + g * s.D;
      dst[m] = h * n + t;
      if (++m == 8) dots8(qs, ks, dst, 8, s.D, scale, scores), m = 0;
      if (++j == s.G) j = 0, ++g;
    }
  }
  if (m > 0) {
    for (int i = m; i < 8; ++i) qs[i] = qs[0], ks[i] = ks[0];   // idle lanes, not stored
    dots8(qs, ks, dst, m, s.D, scale, scores);
  }
}

// out (GC, D) += sum_{t0 <= t < t1} w[j][t] * v_t for GC query heads (rows of w, stride n)
// of kv head g, 32 columns at a time held in registers across the positions. Needs D % 8 == 0.
template <int GC>
void values_simd(const float* w, const Rows& rows, int64_t n, int64_t t0, int64_t t1, int64_t g, const Shapes& s,
                 float* out) {
  const int64_t D = s.D;
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    const int nv = static_cast<int>(std::min<int64_t>(4, (D - d0) / 8));
    __m256 acc[GC][4];
    for (int j = 0; j < GC; ++j)
      for (int c = 0; c < 4; ++c) acc[j][c] = c < nv ? _mm256_loadu_ps(out + j * D + d0 + 8 * c) : _mm256_setzero_ps();
    for (int64_t t = t0; t < t1; ++t) {
      const float* v = rows.v[t] + g * D + d0;
      __m256 x[4];
      for (int c = 0; c < 4; ++c) x[c] = c < nv ? _mm256_loadu_ps(v + 8 * c) : _mm256_setzero_ps();
      for (int j = 0; j < GC; ++j) {
        const __m256 wj = _mm256_set1_ps(w[j * n + t]);
        for (int c = 0; c < 4; ++c) acc[j][c] = _mm256_fmadd_ps(wj, x[c], acc[j][c]);
      }
    }
    for (int j = 0; j < GC; ++j)
      for (int c = 0; c < nv; ++c) _mm256_storeu_ps(out + j * D + d0 + 8 * c, acc[j][c]);
  }
}

// out rows of kv heads [g0, g1) (G query heads each) = sum_t w[h][t] * v_t. Positions go
// in runs of 32 (their slots stay in L1 while every head and column reads them), so the
// sequence's values stream from memory once; each output element still sums over t in order.
void values_into(const float* w, const Rows& rows, int64_t n, int64_t g0, int64_t g1, const Shapes& s, float* out) {
  const int64_t G = s.G, D = s.D;
  std::fill(out + g0 * G * D, out + g1 * G * D, 0.f);
  if (D % 8 != 0) {                                   // plain loops for odd head sizes
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = g0 * G; h < g1 * G; ++h) axpy(w[h * n + t], rows.v[t] + (h / G) * D, out + h * D, D);
    return;
  }
  const int64_t bytes = s.KVH * D * sizeof(float);
  prefetch_rows(rows.v, 0, 32, bytes);
  for (int64_t t0 = 0; t0 < n; t0 += 32) {
    const int64_t t1 = std::min<int64_t>(n, t0 + 32);
    prefetch_rows(rows.v, t1, t1 + 32, bytes);
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t j0 = 0; j0 < G; j0 += 3) {         // three heads x 32 columns = 12 accumulators
        const int64_t h = g * G + j0, left = G - j0;
        if (left >= 3) values_simd<3>(w + h * n, rows, n, t0, t1, g, s, out + h * D);
        else if (left == 2) values_simd<2>(w + h * n, rows, n, t0, t1, g, s, out + h * D);
        else values_simd<1>(w + h * n, rows, n, t0, t1, g, s, out + h * D);
      }
  }
}


// A sequence shared by a team of threads (attend_team) from this many attended positions; a
// shorter one is split by kv head. Around this length the two cost the same; below it
// splitting is slightly faster, above it sharing wins by more as the context grows (SmolLM2-135M,
// 2 threads; docs/BENCHMARKS.md, 'Measurements behind design choices').
constexpr int64_t TEAM_MIN_POSITIONS = 64;

// scores[h * n + t] = q_h . k_t * scale for heads [h0, h1) and the 8 positions from t0 (clipped
// to n): each head's 8 dot products side by side, reduced together; dots8's arithmetic, so the
// same bits as scores_simd.
template <int C>  // head_dim = 8 * C
void scores_tile256(const float* q, const Rows& rows, int64_t n, int64_t t0, int64_t h0, int64_t h1, const Shapes& s,
                    float scale, float* scores, RowFetch<3>& fk, RowFetch<2>& fv) {
  const int64_t per_head_k = (fk.lines() + (h1 - h0) - 1) / (h1 - h0), per_head_v = (fv.lines() + (h1 - h0) - 1) / (h1 - h0);
  const int m = static_cast<int>(std::min<int64_t>(8, n - t0));
  const float* kp[8];
  for (int i = 0; i < 8; ++i) kp[i] = rows.k[t0 + std::min(i, m - 1)];   // idle lanes repeat the last
  for (int64_t h = h0; h < h1; ++h) {
    fk.next(per_head_k);
    fv.next(per_head_v);
    const int64_t off = (h / s.G) * s.D;
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int c = 0; c < C; ++c) {
      const __m256 qc = _mm256_loadu_ps(q + h * s.D + 8 * c);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kp[i] + off + 8 * c), acc[i]);
    }
    alignas(32) float sums[8];
    _mm256_store_ps(sums, _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale)));
    std::copy(sums, sums + m, scores + h * n + t0);
  }
}

// out columns [8 c0, 8 (c0 + NC)) of query heads [h, h + count) (kv head at offset off of each
// value row) = inv[j] * sum_t w[j * n + t] * v_t: values_simd's sum, in order from zero, then
// attend's scaling by 1 / the softmax total: the same bits.
template <int NC>
void values_cols256(const float* w, const Rows& rows, int64_t n, int64_t off, int64_t h, int64_t count, int64_t D,
                    int64_t c0, const float* inv, float* out) {
  constexpr int HG = 8 / NC;                         // heads whose accumulators fit beside the loads
  for (; count > 0; count -= HG, h += HG) {
    const int m = static_cast<int>(std::min<int64_t>(HG, count));
    __m256 acc[HG][NC];
    for (int j = 0; j < HG; ++j)
      for (int c = 0; c < NC; ++c) acc[j][c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      if (t + 16 < n) __builtin_prefetch(reinterpret_cast<const char*>(rows.v[t + 16] + off + 8 * c0), 0, 3);
      __m256 x[NC];
      for (int c = 0; c < NC; ++c) x[c] = _mm256_loadu_ps(rows.v[t] + off + 8 * (c0 + c));
      for (int j = 0; j < m; ++j) {
        const __m256 wj = _mm256_set1_ps(w[(h + j) * n + t]);
        for (int c = 0; c < NC; ++c) acc[j][c] = _mm256_fmadd_ps(wj, x[c], acc[j][c]);
      }
    }
    for (int j = 0; j < m; ++j)
      for (int c = 0; c < NC; ++c)
        _mm256_storeu_ps(out + (h + j) * D + 8 * (c0 + c), _mm256_mul_ps(acc[j][c], _mm256_set1_ps(inv[h + j])));
  }
}

// The i-th of a team's nt threads: scores for its run of TILE-position tiles of the n positions,
// tile(t0, fk, fv) computing one tile while fk brings the key rows two tiles on from memory and
// fv this tile's value rows into L2 (read again after the softmax).
template <int TILE, typename Tile>
void team_score_tiles(const Rows& rows, int64_t n, const Shapes& s, int i, int nt, Tile&& tile) {
  const int64_t tiles = (n + TILE - 1) / TILE;
  const int64_t ta = tiles * i / nt * TILE, tb = std::min<int64_t>(n, tiles * (i + 1) / nt * TILE);
  const int64_t bytes = s.KVH * s.D * sizeof(float);
  prefetch_rows(rows.k, ta, std::min<int64_t>(tb, ta + 32), bytes);
  RowFetch<3> fk;
  RowFetch<2> fv;
  for (int64_t t0 = ta; t0 < tb; t0 += TILE) {
    fk.start(rows.k, t0 + 32, std::min<int64_t>(tb, t0 + 32 + TILE), bytes, 0);
    fv.start(rows.v, t0, t0 + TILE, bytes, 0);
    tile(t0, fk, fv);
  }
}

// attend() for one sequence shared by the i-th of the nt threads of an OpenMP team (head_dim =
// 8 * C, the AVX2 build): the scores of this thread's run of 8-position tiles for every head,
// then, after a barrier, the softmax numerators of its share of the heads, then, after a
// barrier, its share of the (kv head, 16-column) pieces of the values. attend's arithmetic
// throughout, so the bits do not depend on the split; each thread reads whole rows of
// contiguous positions, where the split by kv head gave one thread two of three kv heads.
template <int C>
void attend256_team(const float* q, const Rows& rows, int64_t n, const Shapes& s, float scale, float* out,
                    float* scores, float* inv, int i, int nt) {
  const int64_t G = s.G, D = s.D, H = s.H;
  team_score_tiles<8>(rows, n, s, i, nt, [&](int64_t t0, RowFetch<3>& fk, RowFetch<2>& fv) {
    scores_tile256<C>(q, rows, n, t0, 0, H, s, scale, scores, fk, fv);
  });
#pragma omp barrier
  const int64_t h0 = H * i / nt, h1 = H * (i + 1) / nt;
  cap_heads(scores, n, h0, h1, s);
  for (int64_t h = h0; h < h1; ++h) inv[h] = 1.f / softmax_numerator(scores + h * n, n, s.sink(h));
#pragma omp barrier
  constexpr int64_t PAIRS = (C + 1) / 2;
  const int64_t units = s.KVH * PAIRS, u0 = units * i / nt, u1 = units * (i + 1) / nt;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t g = u / PAIRS, c0 = 2 * (u % PAIRS);
    if (c0 + 1 < C) values_cols256<2>(scores, rows, n, g * D, g * G, G, D, c0, inv, out);
    else values_cols256<1>(scores, rows, n, g * D, g * G, G, D, c0, inv, out);
  }
}

#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10avx512f(__m512);  // in libtorch_cpu (1-ulp exp, 16 lanes)

// r[i] = the sum of v[i]'s 16 lanes (i < 16), added in one fixed order.
inline __m512 reduce16(const __m512* v) {
  __m512 s[8], t[4], p[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per lane: [a, b, c, d] (that lane's part of each sum)
    const __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
    t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)    // lanes 0+1 and 2+3 of t[2i], then of t[2i+1]
    p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(p[0], p[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(p[0], p[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// scores[h * n + t] = q_h . k_t * scale for heads [h0, h1) and the 16 positions from t0
// (clipped to n): each head's 16 dot products side by side, reduced together.
template <int C>  // head_dim = 16 * C
void scores_tile512(const float* q, const Rows& rows, int64_t n, int64_t t0, int64_t h0, int64_t h1, const Shapes& s,
                    float scale, float* scores, RowFetch<3>& fk, RowFetch<2>& fv) {
  // a ceiling share per head: the tile's heads issue every fetch it was given
  const int64_t per_head_k = (fk.lines() + (h1 - h0) - 1) / (h1 - h0), per_head_v = (fv.lines() + (h1 - h0) - 1) / (h1 - h0);
  const int m = static_cast<int>(std::min<int64_t>(16, n - t0));
  const float* kp[16];
  for (int i = 0; i < 16; ++i) kp[i] = rows.k[t0 + std::min(i, m - 1)];  // idle lanes repeat the last
  const __mmask16 mask = m == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << m) - 1);
  for (int64_t h = h0; h < h1; ++h) {
    fk.next(per_head_k);
    fv.next(per_head_v);
    const int64_t off = (h / s.G) * s.D;
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) {
      const __m512 qc = _mm512_loadu_ps(q + h * s.D + 16 * c);
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kp[i] + off + 16 * c), acc[i]);
    }
    _mm512_mask_storeu_ps(scores + h * n + t0, mask, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
  }
}

// softmax_numerator's contract, 16 lanes at a time.
float softmax_numerator512(float* x, int64_t n, float sink = -INFINITY) {
  __m512 top = _mm512_set1_ps(sink);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mask, x + i));
  }
  const float m = _mm512_reduce_max_ps(top);
  const __m512 shift = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    const __m512 e = Sleef_expf16_u10avx512f(_mm512_sub_ps(_mm512_mask_loadu_ps(shift, mask, x + i), shift));
    _mm512_mask_storeu_ps(x + i, mask, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(mask, e));
  }
  const float total = _mm512_reduce_add_ps(acc);
  return sink == -INFINITY ? total : total + std::exp(sink - m);
}

// out rows [h, h + count) (D = 16 * C floats each) = sum_t w[j * n + t] * v_t (kv head g
// at offset off), HC heads x C columns of 16 held in registers, positions in order.
template <int C, int HC>
void values_heads512(const float* w, const Rows& rows, int64_t n, int64_t off, int64_t h, int64_t count, float* out) {
  constexpr int64_t D = 16 * C;
  for (; count >= HC; count -= HC, h += HC) {
    __m512 acc[HC][C];
    for (int j = 0; j < HC; ++j)
      for (int c = 0; c < C; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const float* v = rows.v[t] + off;
      __m512 x[C];
      for (int c = 0; c < C; ++c) x[c] = _mm512_loadu_ps(v + 16 * c);
      for (int j = 0; j < HC; ++j) {
        const __m512 wj = _mm512_set1_ps(w[(h + j) * n + t]);
        for (int c = 0; c < C; ++c) acc[j][c] = _mm512_fmadd_ps(wj, x[c], acc[j][c]);
      }
    }
    for (int j = 0; j < HC; ++j)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (h + j) * D + 16 * c, acc[j][c]);
  }
  if constexpr (HC > 1) {
    if (count > 0) values_heads512<C, HC - 1>(w, rows, n, off, h, count, out);
  }
}

// attend() for head_dim = 16 * C: scores 16 positions at a time with the rows two tiles
// ahead on their way from memory (the values' rows into L2 for the second pass).
template <int C>
void attend512(const float* q, const Rows& rows, int64_t n, int64_t g0, int64_t g1, const Shapes& s, float scale,
               float* out, std::vector<float>& scores) {
  constexpr int HC = 16 / C > 1 ? 16 / C : 1;  // heads whose C accumulators fit in 16 registers
  const int64_t G = s.G, D = s.D;
  scores.resize(static_cast<size_t>(n * s.H));
  const int64_t first = g0 * D * sizeof(float), bytes = (g1 - g0) * D * sizeof(float);   // this task's kv heads
  prefetch_rows(rows.k, 0, 32, bytes, first);
  RowFetch<3> fk;
  RowFetch<2> fv;
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    fk.start(rows.k, t0 + 32, t0 + 48, bytes, first);
    fv.start(rows.v, t0, t0 + 16, bytes, first);
    scores_tile512<C>(q, rows, n, t0, g0 * G, g1 * G, s, scale, scores.data(), fk, fv);
  }
  cap_heads(scores.data(), n, g0 * G, g1 * G, s);
  for (int64_t h = g0 * G; h < g1 * G; ++h) {
    const float inv = 1.f / softmax_numerator512(scores.data() + h * n, n, s.sink(h));
    for (int64_t t = 0; t < n; ++t) scores[h * n + t] *= inv;
  }
  for (int64_t g = g0; g < g1; ++g) values_heads512<C, HC>(scores.data(), rows, n, g * D, g * G, G, out);
}

// out columns [16 c, 16 c + 16) of query heads [h, h + count) (kv head at offset off of each
// value row) = sum_t w[j * n + t] * v_t: values_heads512's arithmetic for one column chunk.
inline void values_chunk512(const float* w, const Rows& rows, int64_t n, int64_t off, int64_t h, int64_t count,
                            int64_t D, int64_t c, float* out) {
  for (; count > 0; count -= 16, h += 16) {
    const int64_t m = std::min<int64_t>(16, count);
    __m512 acc[16];
    for (int j = 0; j < m; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      if (t + 16 < n) __builtin_prefetch(reinterpret_cast<const char*>(rows.v[t + 16] + off + 16 * c), 0, 3);
      const __m512 x = _mm512_loadu_ps(rows.v[t] + off + 16 * c);
      for (int j = 0; j < m; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(w[(h + j) * n + t]), x, acc[j]);
    }
    for (int j = 0; j < m; ++j) _mm512_storeu_ps(out + (h + j) * D + 16 * c, acc[j]);
  }
}

// attend512 for one sequence shared by the i-th of the nt threads of an OpenMP team: the scores
// of this thread's run of 16-position tiles for every head (its value rows on their way into
// its L2 meanwhile), then, after a barrier, the softmax of its share of the heads, then, after a
// barrier, its share of the (kv head, 16-column chunk) pieces of the values. Every score,
// softmax and output element has attend512's arithmetic, so the bits do not depend on the
// split; each thread reads whole rows of contiguous positions, where the split by kv head read
// a third of each row and left one thread a third of the work.
template <int C>
void attend512_team(const float* q, const Rows& rows, int64_t n, const Shapes& s, float scale, float* out,
                    float* scores, int i, int nt) {
  const int64_t G = s.G, D = s.D, H = s.H;
  team_score_tiles<16>(rows, n, s, i, nt, [&](int64_t t0, RowFetch<3>& fk, RowFetch<2>& fv) {
    scores_tile512<C>(q, rows, n, t0, 0, H, s, scale, scores, fk, fv);
  });
#pragma omp barrier
  const int64_t h0 = H * i / nt, h1 = H * (i + 1) / nt;
  cap_heads(scores, n, h0, h1, s);
  for (int64_t h = h0; h < h1; ++h) {
    const float inv = 1.f / softmax_numerator512(scores + h * n, n, s.sink(h));
    for (int64_t t = 0; t < n; ++t) scores[h * n + t] *= inv;
  }
#pragma omp barrier
  const int64_t units = s.KVH * C, u0 = units * i / nt, u1 = units * (i + 1) / nt;
  for (int64_t u = u0; u < u1; ++u) values_chunk512(scores, rows, n, (u / C) * D, (u / C) * G, G, D, u % C, out);
}

#endif

// Head sizes at which a team of threads shares a sequence (attend_team), in either build.
inline bool team_head_size(int64_t D) { return D == 32 || D == 64 || D == 128 || D == 256; }

// attend512_team (AVX-512) or attend256_team (AVX2) over the threads of a new OpenMP team.
void attend_team(const float* q, const Rows& rows, int64_t n, const Shapes& s, float scale, float* out,
                 std::vector<float>& scores) {
  scores.resize(static_cast<size_t>(n * s.H + s.H));
  float* sp = scores.data();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int i = omp_get_thread_num(), nt = omp_get_num_threads();
#if defined(__AVX512F__)
    if (s.D == 64) attend512_team<4>(q, rows, n, s, scale, out, sp, i, nt);
    else if (s.D == 128) attend512_team<8>(q, rows, n, s, scale, out, sp, i, nt);
    else if (s.D == 32) attend512_team<2>(q, rows, n, s, scale, out, sp, i, nt);
    else attend512_team<16>(q, rows, n, s, scale, out, sp, i, nt);
#else
    float* inv = sp + n * s.H;
    if (s.D == 64) attend256_team<8>(q, rows, n, s, scale, out, sp, inv, i, nt);
    else if (s.D == 128) attend256_team<16>(q, rows, n, s, scale, out, sp, inv, i, nt);
    else if (s.D == 32) attend256_team<4>(q, rows, n, s, scale, out, sp, inv, i, nt);
    else attend256_team<32>(q, rows, n, s, scale, out, sp, inv, i, nt);
#endif
  }
}

// One sequence's query heads [g0 * G, g1 * G) (those of kv heads g0..g1-1): q (H, D) of the
// sequence against the n positions in `rows` -> out (H, D), the same rows. `scores` is
// scratch. Every head's arithmetic is the same whichever range it is computed in.
void attend(const float* q, const Rows& rows, int64_t n, int64_t g0, int64_t g1, const Shapes& s, float scale,
            float* out, std::vector<float>& scores) {
  const int64_t G = s.G, D = s.D;
#if defined(__AVX512F__)
  if (D == 64) return attend512<4>(q, rows, n, g0, g1, s, scale, out, scores);
  if (D == 128) return attend512<8>(q, rows, n, g0, g1, s, scale, out, scores);
  if (D == 32) return attend512<2>(q, rows, n, g0, g1, s, scale, out, scores);
  if (D == 256) return attend512<16>(q, rows, n, g0, g1, s, scale, out, scores);
#endif
  scores.resize(static_cast<size_t>(n * s.H));
  if (D % 8 == 0) {
    scores_simd(q, rows, n, g0 * G, g1 * G, s, scale, scores.data());
  } else {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = g0 * G; h < g1 * G; ++h) scores[h * n + t] = dot(q + h * D, rows.k[t] + (h / G) * D, D) * scale;
  }
  cap_heads(scores.data(), n, g0 * G, g1 * G, s);
  std::vector<float> total(s.H);
  for (int64_t h = g0 * G; h < g1 * G; ++h) total[h] = softmax_numerator(scores.data() + h * n, n, s.sink(h));
  values_into(scores.data(), rows, n, g0, g1, s, out);
  for (int64_t h = g0 * G; h < g1 * G; ++h) {
    const float inv = 1.f / total[h];
    for (int64_t d = 0; d < D; ++d) out[h * D + d] *= inv;
  }
}

// Block tables (B, W) int64 and context lengths (B,) int64, each context within its table.
void check_tables(const at::Tensor& tables, const at::Tensor& ctx_lens, int64_t B, int64_t block_size) {
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.size(0) == B,
              "tables must be (B, W) int64");
  TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.scalar_type() == at::kLong && ctx_lens.size(0) == B,
              "ctx_lens must be (B,) int64");
  const int64_t* lens = ctx_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= tables.size(1) * block_size, "a context length exceeds its block table");
}

void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                  const at::Tensor& ctx_lens, int64_t B) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "caches must be contiguous (blocks, block_size, kv_heads, head_dim) float32");
  check_tables(tables, ctx_lens, B, k_cache.size(1));
}

// The sink logits' data (H,) float32, or nullptr where none are given.
const float* sink_data(const c10::optional<at::Tensor>& sinks, int64_t H) {
  if (!sinks.has_value() || !sinks->defined()) return nullptr;
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == H && sinks->scalar_type() == at::kFloat && sinks->is_contiguous(),
              "sinks must be contiguous (heads,) float32");
  return sinks->data_ptr<float>();
}

// out (B, H, D) = attention of q (B, H, D) over each sequence's cached positions.
void decode_all(const float* qp, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                const at::Tensor& ctx_lens, const Shapes& s, float scale, int64_t window, float* op) {
  const int64_t B = tables.size(0), H = s.H, D = s.D, KVH = s.KVH;
  const float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int64_t *tp = tables.data_ptr<int64_t>(), *lens = ctx_lens.data_ptr<int64_t>();
  const auto first = [&](int64_t b) { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; };
  // Fewer sequences than threads, each of TEAM_MIN_POSITIONS or more: every thread shares each one.
  bool team = B < at::get_num_threads() && team_head_size(D);
  for (int64_t b = 0; b < B && team; ++b) team = lens[b] - first(b) >= TEAM_MIN_POSITIONS;
  if (team) {
    // kept from call to call (this runs 30 times a decode step): no allocation, no zero fill
    thread_local std::vector<float> scores;
    thread_local Rows rows;
    for (int64_t b = 0; b < B; ++b) {
      rows.fill(kc, vc, tp + b * s.W, first(b), lens[b], s.BS, s.KVH * s.D);
      attend_team(qp + b * H * D, rows, lens[b] - first(b), s, scale, op + b * H * D, scores);
    }
    return;
  }
  // Fewer sequences than threads (and short): split each sequence by kv head so both cores work.
  const int64_t parts = B >= at::get_num_threads() ? 1 : KVH;
  at::parallel_for(0, B * parts, 1, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> scores;
    thread_local Rows rows;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / parts, g0 = parts == 1 ? 0 : i % parts, g1 = parts == 1 ? KVH : g0 + 1;
      rows.fill(kc, vc, tp + b * s.W, first(b), lens[b], s.BS, s.KVH * s.D);
      attend(qp + b * H * D, rows, lens[b] - first(b), g0, g1, s, scale, op + b * H * D, scores);
    }
  });
}

// ---- quantized caches -------------------------------------------------------------------------
// paged_decode_int8 and paged_decode_int4: paged_decode's attention over a quantized cache
// (kv_cache/quantized.py), its codes and scales read where they lie. A few positions at a time
// are converted to float into a small tile that stays in L1 (never the sequence's whole
// context) and read there by every query head of the kv head. One task per (sequence, kv head),
// each with attend()'s passes: every position's score, a softmax, then the weighted sum of
// values. A head's arithmetic is the same whatever task it is computed in, so a sequence's
// result is the same bits alone or batched.
//
// int8 (Int8Cache): codes (num_blocks + 1, block_size, KVH, D) int8 and scales (num_blocks + 1,
// block_size, KVH) float32, one per (slot, kv head); an element reads as code * scale. The tile
// holds the codes unscaled, and each scale is applied once per (position, kv head): a key's
// multiplies its dot products' sums, q . (c s) = (q . c) s; a value's multiplies the softmax
// weights that read it, w (c s) = (w s) c.
//
// int4 (Int4Cache, llama.cpp's q4_0): codes (num_blocks + 1, block_size, KVH, D / 2) uint8, two a
// byte (element 2i in the low nibble, 2i + 1 in the high one), and scales (num_blocks + 1,
// block_size, KVH, D / 32) float16, one per group of 32 elements; an element reads as
// (code - 8) * d. The tile holds the elements dequantized, rounded as Int4Cache's reads round
// them (float(code - 8) * d), each group unpacked with SIMD.

// A vector of N float lanes and the few operations the quantized kernels' loops use: Lanes8
// (AVX2) and Lanes16 (AVX-512) for the head sizes they divide, Lanes1 (scalar) for any other
// (int8 only: an int4 head size is a multiple of 32).
// HEADS: how many query heads a values pass accumulates at once, 4 vectors of columns each, in
// registers beside the 4 vectors of values they share and the broadcast weight (AVX2: 2 x 4 + 4
// + 1 of 16 registers; a third head spills an accumulator, and its loop waits on the reload).
// q4_group(p, d, dst, stride): the 32 elements of the q4_0 group at p (16 bytes), scale d, as
// floats (code - 8) * d, in 32 / N vectors at dst + j * stride.
struct Lanes1 {
  using V = float;
  static constexpr int N = 1, HEADS = 2;
  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V x) { *p = x; }
  static V codes(const int8_t* p) { return static_cast<float>(*p); }
  static V f16(const uint16_t* p) { return _cvtsh_ss(*p); }
  static V bf16(const uint16_t* p) {
    const uint32_t bits = static_cast<uint32_t>(*p) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
  }
  static V fmadd(V a, V b, V c) { return a * b + c; }
  static V mul(V a, V b) { return a * b; }
  static V sums(const V* acc) { return acc[0]; }  // lane i = the sum of acc[i]'s lanes
};

struct Lanes8 {
  using V = __m256;
  static constexpr int N = 8, HEADS = 2;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V codes(const int8_t* p) { return widen8_codes(p); }  // stored_lanes.h
  static V f16(const uint16_t* p) { return widen8_f16(p); }
  static V bf16(const uint16_t* p) { return widen8_bf16(p); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V sums(const V* acc) { return reduce8(acc); }
  static void q4_group(const uint8_t* p, float d, float* dst, int64_t stride) { q4_group8(p, d, dst, stride); }
};

#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static constexpr int N = 16, HEADS = 6;  // 6 x 4 + 4 + 1 of the 32 registers
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V codes(const int8_t* p) {  // 16 int8 -> 16 floats
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V bf16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V sums(const V* acc) { return reduce16(acc); }
  static void q4_group(const uint8_t* p, float d, float* dst, int64_t stride) {
    __m128i lo, hi;
    q4_codes(p, lo, hi);
    const V scale = set1(d);
    store(dst, mul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), scale));
    store(dst + stride, mul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), scale));
  }
};
#endif

// For functions that only prefetch: GCC finds such a function free of side effects (pure) and
// drops every call to it that it does not inline (the int4 kernel then ran ~1.5x slower over
// scattered blocks, waiting on each one's first lines).
#define PREFETCH_INLINE __attribute__((always_inline)) inline

// Ask for every cache line of bytes [p, p + bytes) ahead of use (prefetch_rows' reason).
template <int Locality>
PREFETCH_INLINE void prefetch_bytes(const void* p, int64_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(p), end = start + bytes;
  for (uintptr_t line = start & ~uintptr_t(63); line < end; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, Locality);
}

// An int8 cache's arrays: codes at (slot * KVH + g) * D, scales at slot * KVH + g.
struct Int8KV {
  const int8_t *k, *v;
  const float *k_scales, *v_scales;
  int64_t BS, KVH, D;
};

// Kv head g's n positions of a sequence in an int8 cache: each one's key and value codes
// (pointers to its D int8 in the cache) and their scales. Plain pointers: the loops read these,
// not the thread_local vectors behind them (GCC would look each access to a thread_local up
// again, a call per iteration). What attend_codes asks of a span:
//   key<L>(t, dst, stride), value<L>(t, dst, stride): position t's D elements as D / L::N
//     vectors of floats at dst + c * stride (here its codes, unscaled);
//   key_scale(t): the factor of position t's dot products (here its key's scale);
//   weigh(w): weights w (n,) times what their values still need (here the values' scales);
//   prefetch_keys<Locality>(t0, t1), prefetch_values<Locality>(t0, t1): positions [t0, t1)
//     (clipped to n) asked for ahead of use.
struct Int8Span {
  const int8_t *const *k, *const *v;
  const float *k_scale, *v_scale;
  int64_t n, D;
  template <class L>
  void key(int64_t t, float* dst, int64_t stride) const { convert<L>(k[t], dst, stride); }
  template <class L>
  void value(int64_t t, float* dst, int64_t stride) const { convert<L>(v[t], dst, stride); }
  float key_scale(int64_t t) const { return k_scale[t]; }
  void weigh(float* w) const {
    for (int64_t t = 0; t < n; ++t) w[t] *= v_scale[t];
  }
  template <int Locality>
  PREFETCH_INLINE void prefetch_keys(int64_t t0, int64_t t1) const { prefetch<Locality>(k, t0, t1); }
  template <int Locality>
  PREFETCH_INLINE void prefetch_values(int64_t t0, int64_t t1) const { prefetch<Locality>(v, t0, t1); }

 private:
  template <class L>
  void convert(const int8_t* codes, float* dst, int64_t stride) const {
    for (int64_t c = 0; c < D / L::N; ++c) L::store(dst + c * stride, L::codes(codes + c * L::N));
  }
  template <int Locality>
  PREFETCH_INLINE void prefetch(const int8_t* const* codes, int64_t t0, int64_t t1) const {
    for (int64_t t = t0; t < std::min(t1, n); ++t)
      for (int64_t b = 0; b < D; b += 64) __builtin_prefetch(codes[t] + b, 0, Locality);
  }
};

// Int8Span's storage, filled from positions [start, end) of a sequence walked through its block table.
struct Int8Rows {
  using Span = Int8Span;
  std::vector<const int8_t*> k, v;
  std::vector<float> k_scale, v_scale;
  Int8Span fill(const Int8KV& c, const int64_t* table, int64_t start, int64_t end, int64_t g) {
    const int64_t n = end - start;
    k.resize(n), v.resize(n), k_scale.resize(n), v_scale.resize(n);
    int64_t block = start / c.BS, offset = start % c.BS;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t at = (table[block] * c.BS + offset) * c.KVH + g;  // (slot, kv head)
      k[t] = c.k + at * c.D, v[t] = c.v + at * c.D;
      k_scale[t] = c.k_scales[at], v_scale[t] = c.v_scales[at];
      if (++offset == c.BS) offset = 0, ++block;
    }
    return {k.data(), v.data(), k_scale.data(), v_scale.data(), n, c.D};
  }
};

// An int4 cache's arrays: the codes of (slot, kv head) r at r * D / 2 (bytes), its group scales
// at r * D / 32 (float16 bits).
struct Int4KV {
  const uint8_t *k, *v;
  const uint16_t *k_scales, *v_scales;
  int64_t BS, KVH, D;
};

// Kv head g's n positions of a sequence in an int4 cache: each one's (slot, kv head) index into
// the arrays (Int4KV's), which its key's and value's codes and scales share. Int8Span's
// interface: key/value write the elements dequantized, so nothing is left to scale.
struct Int4Span {
  const int64_t* at;  // (n,)
  const uint8_t *k, *v;
  const uint16_t *k_scales, *v_scales;
  int64_t n, D;
  template <class L>
  void key(int64_t t, float* dst, int64_t stride) const { convert<L>(k, k_scales, at[t], dst, stride); }
  template <class L>
  void value(int64_t t, float* dst, int64_t stride) const { convert<L>(v, v_scales, at[t], dst, stride); }
  float key_scale(int64_t) const { return 1.f; }
  void weigh(float*) const {}
  template <int Locality>
  PREFETCH_INLINE void prefetch_keys(int64_t t0, int64_t t1) const { prefetch<Locality>(k, k_scales, t0, t1); }
  template <int Locality>
  PREFETCH_INLINE void prefetch_values(int64_t t0, int64_t t1) const { prefetch<Locality>(v, v_scales, t0, t1); }

 private:
  // Row r's D elements: group j's 32 / N vectors at dst + (j * 32 / N + i) * stride.
  template <class L>
  void convert(const uint8_t* codes, const uint16_t* scales, int64_t r, float* dst, int64_t stride) const {
    const int64_t groups = D / 32;
    const uint8_t* c = codes + r * (D / 2);
    const uint16_t* d = scales + r * groups;
    for (int64_t j = 0; j < groups; ++j)
      L::q4_group(c + 16 * j, _cvtsh_ss(d[j]), dst + j * (32 / L::N) * stride, stride);
  }
  template <int Locality>
  PREFETCH_INLINE void prefetch(const uint8_t* codes, const uint16_t* scales, int64_t t0, int64_t t1) const {
    for (int64_t t = t0; t < std::min(t1, n); ++t) {
      prefetch_bytes<Locality>(codes + at[t] * (D / 2), D / 2);
      prefetch_bytes<Locality>(scales + at[t] * (D / 32), D / 16);
    }
  }
};

// at = the (slot, kv head g) index of each of positions [start, end) of a sequence walked
// through its block table (blocks of BS slots, KVH kv heads a slot).
inline void slot_heads(const int64_t* table, int64_t BS, int64_t KVH, int64_t start, int64_t end, int64_t g,
                       std::vector<int64_t>& at) {
  at.resize(end - start);
  int64_t block = start / BS, offset = start % BS;
  for (int64_t t = 0; t < end - start; ++t) {
    at[t] = (table[block] * BS + offset) * KVH + g;
    if (++offset == BS) offset = 0, ++block;
  }
}

// Int4Span's storage, filled from positions [start, end) of a sequence walked through its block table.
struct Int4Rows {
  using Span = Int4Span;
  std::vector<int64_t> at;
  Int4Span fill(const Int4KV& c, const int64_t* table, int64_t start, int64_t end, int64_t g) {
    slot_heads(table, c.BS, c.KVH, start, end, g, at);
    return {at.data(), c.k, c.v, c.k_scales, c.v_scales, end - start, c.D};
  }
};

// A 16-bit cache's arrays: (slot, kv head) r's D elements at r * D, float16 or bfloat16 bits.
struct HalfKV {
  const uint16_t *k, *v;
  int64_t BS, KVH, D;
};

// Kv head g's n positions of a sequence in a 16-bit cache (BF16: bfloat16, else float16): each
// one's (slot, kv head) index into HalfKV's arrays. Int8Span's interface: key/value write the
// elements as floats, exactly (every float16 and bfloat16 is a float32), nothing left to scale.
template <bool BF16>
struct HalfSpan {
  const int64_t* at;  // (n,)
  const uint16_t *k, *v;
  int64_t n, D;
  template <class L>
  void key(int64_t t, float* dst, int64_t stride) const { convert<L>(k + at[t] * D, dst, stride); }
  template <class L>
  void value(int64_t t, float* dst, int64_t stride) const { convert<L>(v + at[t] * D, dst, stride); }
  float key_scale(int64_t) const { return 1.f; }
  void weigh(float*) const {}
  template <int Locality>
  PREFETCH_INLINE void prefetch_keys(int64_t t0, int64_t t1) const { prefetch<Locality>(k, t0, t1); }
  template <int Locality>
  PREFETCH_INLINE void prefetch_values(int64_t t0, int64_t t1) const { prefetch<Locality>(v, t0, t1); }

 private:
  template <class L>
  void convert(const uint16_t* p, float* dst, int64_t stride) const {
    for (int64_t c = 0; c < D / L::N; ++c) L::store(dst + c * stride, BF16 ? L::bf16(p + c * L::N) : L::f16(p + c * L::N));
  }
  template <int Locality>
  PREFETCH_INLINE void prefetch(const uint16_t* base, int64_t t0, int64_t t1) const {
    for (int64_t t = t0; t < std::min(t1, n); ++t) prefetch_bytes<Locality>(base + at[t] * D, 2 * D);
  }
};

// HalfSpan's storage, filled from positions [start, end) of a sequence walked through its block table.
template <bool BF16>
struct HalfRows {
  using Span = HalfSpan<BF16>;
  std::vector<int64_t> at;
  Span fill(const HalfKV& c, const int64_t* table, int64_t start, int64_t end, int64_t g) {
    slot_heads(table, c.BS, c.KVH, start, end, g, at);
    return {at.data(), c.k, c.v, end - start, c.D};
  }
};

// scores[j * n + t] = (q_j . k_t) * f_t * scale for `heads` query heads q_j (rows of q, D each)
// and the L::N positions from t0 (clipped to n) of one kv head, k_t position t's key as the span
// converts it and f_t its key_scale: the positions' keys converted once into `tile`, then each
// head's N dot products side by side (independent FMA chains), reduced together and multiplied
// by f_t * scale. The tile holds the positions' c-th vectors side by side, (D / N, N positions,
// N lanes), so one pointer with constant offsets reaches all N of them. Needs D % L::N == 0.
template <class L, class Span>
void scores_tile_codes(const float* q, int64_t heads, const Span& rows, int64_t t0, float scale, float* scores,
                       float* tile) {
  using V = typename L::V;
  constexpr int N = L::N;
  const int64_t n = rows.n, D = rows.D, chunks = D / N;
  const int m = static_cast<int>(std::min<int64_t>(N, n - t0));
  alignas(64) float key_scale[N];
  for (int i = 0; i < N; ++i) {  // idle lanes repeat the last position, not stored
    rows.template key<L>(t0 + std::min(i, m - 1), tile + i * N, N * N);
    key_scale[i] = i < m ? rows.key_scale(t0 + i) * scale : 0.f;
  }
  const V s = L::load(key_scale);
  for (int64_t j = 0; j < heads; ++j) {
    V acc[N];
    for (int i = 0; i < N; ++i) acc[i] = L::zero();
    for (int64_t c = 0; c < chunks; ++c) {
      const V qc = L::load(q + j * D + c * N);
      const float* k = tile + c * N * N;
      for (int i = 0; i < N; ++i) acc[i] = L::fmadd(qc, L::load(k + i * N), acc[i]);
    }
    const V out = L::mul(L::sums(acc), s);
    if (m == N) {
      L::store(scores + j * n + t0, out);
    } else {
      alignas(64) float sums[N];
      L::store(sums, out);
      for (int i = 0; i < m; ++i) scores[j * n + t0 + i] = sums[i];
    }
  }
}

// tile (m, D) = the values of positions [t0, t0 + m) as the span converts them. Needs D % L::N == 0.
template <class L, class Span>
inline void values_to_tile(const Span& rows, int64_t t0, int64_t m, float* tile) {
  for (int64_t i = 0; i < m; ++i) rows.template value<L>(t0 + i, tile + i * rows.D, L::N);
}

// out (HG heads, D) columns [d0, d0 + NC * N) += sum_i w[j * n + t0 + i] * tile row i over the
// tile's `count` positions, for HG query heads (rows of w, stride n; out rows of D): HG x NC
// accumulators in registers across the positions, each element summed over them in order.
template <class L, int HG, int NC>
void values_cols_tile(const float* w, int64_t n, int64_t t0, int64_t count, const float* tile, int64_t D, int64_t d0,
                      float* out) {
  using V = typename L::V;
  constexpr int N = L::N;
  V acc[HG][NC];
  for (int j = 0; j < HG; ++j)
    for (int c = 0; c < NC; ++c) acc[j][c] = L::load(out + j * D + d0 + c * N);
  for (int64_t i = 0; i < count; ++i) {
    V x[NC];
    for (int c = 0; c < NC; ++c) x[c] = L::load(tile + i * D + d0 + c * N);
    for (int j = 0; j < HG; ++j) {
      const V wj = L::set1(w[j * n + t0 + i]);
      for (int c = 0; c < NC; ++c) acc[j][c] = L::fmadd(wj, x[c], acc[j][c]);
    }
  }
  for (int j = 0; j < HG; ++j)
    for (int c = 0; c < NC; ++c) L::store(out + j * D + d0 + c * N, acc[j][c]);
}

// values_cols_tile over every column of HG heads: 4 vectors at a time, then the 1-3 left.
template <class L, int HG>
void values_heads_tile(const float* w, int64_t n, int64_t t0, int64_t count, const float* tile, int64_t D,
                       float* out) {
  constexpr int N = L::N;
  int64_t d0 = 0;
  for (; d0 + 4 * N <= D; d0 += 4 * N) values_cols_tile<L, HG, 4>(w, n, t0, count, tile, D, d0, out);
  const int64_t left = (D - d0) / N;
  if (left == 3) values_cols_tile<L, HG, 3>(w, n, t0, count, tile, D, d0, out);
  else if (left == 2) values_cols_tile<L, HG, 2>(w, n, t0, count, tile, D, d0, out);
  else if (left == 1) values_cols_tile<L, HG, 1>(w, n, t0, count, tile, D, d0, out);
}

// out (heads, D) += sum_i w[j * n + t0 + i] * tile row i for `heads` query heads: HG at a time,
// then the heads left over (fewer than HG) likewise.
template <class L, int HG>
void values_tile(const float* w, int64_t n, int64_t t0, int64_t count, const float* tile, int64_t D, int64_t heads,
                 float* out) {
  for (; heads >= HG; heads -= HG, w += HG * n, out += HG * D) values_heads_tile<L, HG>(w, n, t0, count, tile, D, out);
  if constexpr (HG > 1) {
    if (heads > 0) values_tile<L, HG - 1>(w, n, t0, count, tile, D, heads, out);
  }
}

// Positions a values tile converts at a time: 8 KB to 16 KB of floats, in L1 while every head reads them.
inline int64_t value_run(int64_t D) { return std::clamp<int64_t>(4096 / D, 8, 32); }

// A task's scratch: scores (heads, n), a tile of converted positions (rows, D) and the heads'
// softmax totals, each 64-byte aligned (a tile's vectors never straddle two cache lines).
struct CodeWork {
  float *scores, *tile, *total;
};

// CodeWork's storage, one per thread, kept from call to call (no allocation once grown).
struct CodeScratch {
  std::vector<float> buffer;
  CodeWork get(int64_t heads, int64_t n, int64_t rows, int64_t D) {
    const auto lines = [](int64_t floats) { return (floats + 15) / 16 * 16; };
    const int64_t scores = lines(heads * n), tile = lines(rows * D);
    buffer.resize(static_cast<size_t>(scores + tile + lines(heads) + 16));
    float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
    return {base, base + scores, base + scores + tile};
  }
};

// Query heads [h0, h1) of one sequence, all reading the kv head whose positions `rows` holds
// (Int8Span or Int4Span): q (H, D) of the sequence -> out (H, D), the same rows. attend()'s
// passes: the scores of every position (soft-capped where asked), the softmax numerators (each
// head's sink counted), the weights weighed by the span, their sum over the converted values,
// divided by the totals. `work` is scratch (CodeScratch).
template <class L, class Span>
void attend_codes(const float* q, const Span& rows, int64_t h0, int64_t h1, const Shapes& s, float scale, float* out,
                  const CodeWork& work) {
  float *scores = work.scores, *tile = work.tile, *total = work.total;
  constexpr int N = L::N;
  const int64_t heads = h1 - h0, D = s.D, n = rows.n, run = value_run(D);
  rows.template prefetch_keys<3>(0, 2 * N);
  for (int64_t t0 = 0; t0 < n; t0 += N) {
    rows.template prefetch_keys<3>(t0 + 2 * N, t0 + 3 * N);
    rows.template prefetch_values<2>(t0, t0 + N);  // values: into L2 now, read after the softmax
    scores_tile_codes<L>(q + h0 * D, heads, rows, t0, scale, scores, tile);
  }
  for (int64_t j = 0; j < heads; ++j) {
    float* w = scores + j * n;
    if (s.softcap > 0.f) soft_cap(w, n, s.softcap);
    total[j] = softmax_numerator(w, n, s.sink(h0 + j));
    rows.weigh(w);
  }
  float* o = out + h0 * D;
  std::fill(o, o + heads * D, 0.f);
  for (int64_t t0 = 0; t0 < n; t0 += run) {
    const int64_t count = std::min<int64_t>(run, n - t0);
    rows.template prefetch_values<3>(t0 + run, t0 + 2 * run);
    values_to_tile<L>(rows, t0, count, tile);
    values_tile<L, L::HEADS>(scores, n, t0, count, tile, D, heads, o);
  }
  for (int64_t j = 0; j < heads; ++j) {
    const float inv = 1.f / total[j];
    for (int64_t d = 0; d < D; ++d) o[j * D + d] *= inv;
  }
}

// out (B, H, D) = attention of q (B, H, D) over each sequence's positions in a quantized cache
// (its last `window` where window > 0), c its arrays (Int8KV for Int8Rows, Int4KV for Int4Rows).
// One task per (sequence, kv head); where there are fewer of those than threads (one sequence of
// a model with one kv head, say), per (sequence, kv head, share of its G query heads), each share
// reading the kv head's positions itself.
template <class L, class Rows, class KV>
void decode_codes_all(const float* qp, const KV& c, const at::Tensor& tables, const at::Tensor& ctx_lens,
                      const Shapes& s, float scale, int64_t window, float* op) {
  const int64_t B = tables.size(0), H = s.H, D = s.D, KVH = s.KVH, G = s.G;
  const int64_t *tp = tables.data_ptr<int64_t>(), *lens = ctx_lens.data_ptr<int64_t>();
  const int64_t pairs = B * KVH, threads = at::get_num_threads();
  const int64_t parts = pairs >= threads ? 1 : std::min<int64_t>(G, (threads + pairs - 1) / pairs);
  at::parallel_for(0, pairs * parts, 1, [&](int64_t i0, int64_t i1) {
    thread_local Rows rows;
    thread_local CodeScratch scratch;
    typename Rows::Span span{};
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (KVH * parts), g = i / parts % KVH, p = i % parts;
      const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
      if (i == i0 || p == 0) span = rows.fill(c, tp + b * s.W, first, lens[b], g);  // a new (sequence, kv head)
      const int64_t h0 = g * G + G * p / parts, h1 = g * G + G * (p + 1) / parts;
      const CodeWork work = scratch.get(h1 - h0, span.n, std::max<int64_t>(L::N, value_run(D)), D);
      attend_codes<L>(qp + b * H * D, span, h0, h1, s, scale, op + b * H * D, work);
    }
  });
}

// decode_codes_all on the widest lanes head_dim D fills: 16 (AVX-512 build, D % 16 == 0), else 8
// (D % 8 == 0), else scalar (int8 and 16-bit rows; int4's groups of 32 always fill 16 or 8, and
// Lanes1 has no q4_group).
template <class Rows, class KV>
void decode_codes_lanes(const float* qp, const KV& c, const at::Tensor& tables, const at::Tensor& ctx_lens,
                        const Shapes& s, float scale, int64_t window, float* op) {
#if defined(__AVX512F__)
  if (s.D % 16 == 0) return decode_codes_all<Lanes16, Rows>(qp, c, tables, ctx_lens, s, scale, window, op);
#endif
  if (s.D % 8 == 0) decode_codes_all<Lanes8, Rows>(qp, c, tables, ctx_lens, s, scale, window, op);
  else decode_codes_all<Lanes1, Rows>(qp, c, tables, ctx_lens, s, scale, window, op);
}

// The shapes rope_write's arguments give: rows B, heads H, kv heads KVH, head_dim D, rotary dims R.
struct RopeShape {
  int64_t B, H, KVH, D, R;
};

// Rows [b0, b1) of qkv (rows of (H + 2 KVH) D = [q | k | v]): q and k rotated (rope_row, the
// fused rope's arithmetic; the first R dims) with cos/sin rows b, q into qp (rows of H D), k and
// v written to cache slot slots[b] (slots checked by the caller).
void rope_write_rows(const float* x, const float* cp, const float* sp, const int64_t* slot, int64_t b0, int64_t b1,
                     const RopeShape& r, float* kc, float* vc, float* qp) {
  const int64_t H = r.H, KVH = r.KVH, D = r.D, R = r.R;
  for (int64_t b = b0; b < b1; ++b) {
    const float *row = x + b * (H + 2 * KVH) * D, *c = cp + b * R, *sn = sp + b * R;
    for (int64_t h = 0; h < H; ++h) rope_row(row + h * D, c, sn, qp + (b * H + h) * D, D, R);
    for (int64_t g = 0; g < KVH; ++g) rope_row(row + (H + g) * D, c, sn, kc + (slot[b] * KVH + g) * D, D, R);
    std::copy(row + (H + KVH) * D, row + (H + 2 * KVH) * D, vc + slot[b] * KVH * D);
  }
}

// Checks rope_write's arguments; returns their shapes. head_dim: where the cache's last size is not
// it (an int4 cache's, two codes a byte).
RopeShape check_rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& k_cache, const at::Tensor& slots, int64_t num_heads, int64_t head_dim = -1) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(), "qkv must be contiguous (B, C) float32");
  const int64_t B = qkv.size(0), H = num_heads, KVH = k_cache.size(2), D = head_dim < 0 ? k_cache.size(3) : head_dim;
  const int64_t slot_count = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && qkv.size(1) == (H + 2 * KVH) * D, "qkv must hold (heads + 2 kv_heads) x head_dim columns");
  const int64_t R = B > 0 ? cos.numel() / B : D;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * R && sin.numel() == B * R && R <= D &&
              R % 2 == 0 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos/sin must be contiguous (B, 1, R) float32, R even and at most head_dim");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be (B,) int64");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(slot[b] >= 0 && slot[b] < slot_count, "a cache slot is out of range");
  return {B, H, KVH, D, R};
}

// qkv (T, (H + 2 KVH) D) = [q | k | v] rows of a step's tokens, cos/sin (T, 1, R): q and k
// rotated (their first R dims), k and v written to cache slots `slots` (T,). Returns the rotated q (T, H, D). A
// prompt step's rope, cache write and query copy in one pass (rows split over the threads).
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& slots, int64_t num_heads) {
  const RopeShape r = check_rope_write(qkv, cos, sin, k_cache, slots, num_heads);
  const int64_t T = r.B, H = r.H, D = r.D;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
              k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "caches must be contiguous (blocks, block_size, kv_heads, head_dim) float32");
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  const float *x = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>(), *qp = q.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t b0, int64_t b1) {
    rope_write_rows(x, cp, sp, slots.data_ptr<int64_t>(), b0, b1, r, kc, vc, qp);
  });
  return q;
}

// paged_decode into out (B, H, D) contiguous, e.g. the first rows of a mixed step's output.
void paged_decode_out(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& tables, const at::Tensor& ctx_lens, double scale, int64_t window, double softcap,
                      const c10::optional<at::Tensor>& sinks, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous (B, H, D) float32");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out must be contiguous float32 shaped like q");
  check_caches(k_cache, v_cache, tables, ctx_lens, q.size(0));
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head_dim or head counts disagree");
  decode_all(q.data_ptr<float>(), k_cache, v_cache, tables, ctx_lens,
             Shapes{H, KVH, H / KVH, D, k_cache.size(1), tables.size(1), static_cast<float>(softcap),
                    sink_data(sinks, H)},
             static_cast<float>(scale), window, out.data_ptr<float>());
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& ctx_lens, double scale, int64_t window,
                        double softcap, const c10::optional<at::Tensor>& sinks) {
  at::Tensor out = at::empty_like(q);
  paged_decode_out(q, k_cache, v_cache, tables, ctx_lens, scale, window, softcap, sinks, out);
  return out;
}

// paged_decode over an int8 cache (the quantized section above): q (B, H, D) float32; k_data, v_data
// (blocks, block_size, KVH, D) int8 codes; k_scales, v_scales (blocks, block_size, KVH) float32;
// tables, ctx_lens, scale, window, softcap and sinks as paged_decode's. Returns (B, H, D).
at::Tensor paged_decode_int8(const at::Tensor& q, const at::Tensor& k_data, const at::Tensor& k_scales,
                             const at::Tensor& v_data, const at::Tensor& v_scales, const at::Tensor& tables,
                             const at::Tensor& ctx_lens, double scale, int64_t window, double softcap,
                             const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous (B, H, D) float32");
  check_int8_cache(k_data, k_scales, v_data, v_scales);
  const int64_t H = q.size(1), D = q.size(2), KVH = k_data.size(2), BS = k_data.size(1);
  TORCH_CHECK(k_data.size(3) == D && H % KVH == 0, "head_dim or head counts disagree");
  check_tables(tables, ctx_lens, q.size(0), BS);
  at::Tensor out = at::empty_like(q);
  const Int8KV c{k_data.data_ptr<int8_t>(), v_data.data_ptr<int8_t>(), k_scales.data_ptr<float>(),
                 v_scales.data_ptr<float>(), BS, KVH, D};
  const Shapes s{H, KVH, H / KVH, D, BS, tables.size(1), static_cast<float>(softcap), sink_data(sinks, H)};
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  decode_codes_lanes<Int8Rows>(qp, c, tables, ctx_lens, s, scale, window, op);
  return out;
}

// paged_decode over an int4 cache (the quantized section above): q (B, H, D) float32, D a multiple
// of 32; k_data, v_data (blocks, block_size, KVH, D / 2) uint8 codes, two a byte; k_scales,
// v_scales (blocks, block_size, KVH, D / 32) float16 group scales; tables, ctx_lens, scale,
// window, softcap and sinks as paged_decode's. Returns (B, H, D).
at::Tensor paged_decode_int4(const at::Tensor& q, const at::Tensor& k_data, const at::Tensor& k_scales,
                             const at::Tensor& v_data, const at::Tensor& v_scales, const at::Tensor& tables,
                             const at::Tensor& ctx_lens, double scale, int64_t window, double softcap,
                             const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous (B, H, D) float32");
  check_int4_cache(k_data, k_scales, v_data, v_scales, q.size(2));
  const int64_t H = q.size(1), D = q.size(2), KVH = k_data.size(2), BS = k_data.size(1);
  TORCH_CHECK(H % KVH == 0, "heads must be a multiple of kv heads");
  check_tables(tables, ctx_lens, q.size(0), BS);
  at::Tensor out = at::empty_like(q);
  const auto half_bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); };
  const Int4KV c{k_data.data_ptr<uint8_t>(), v_data.data_ptr<uint8_t>(), half_bits(k_scales), half_bits(v_scales),
                 BS, KVH, D};
  const Shapes s{H, KVH, H / KVH, D, BS, tables.size(1), static_cast<float>(softcap), sink_data(sinks, H)};
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
#if defined(__AVX512F__)
  decode_codes_all<Lanes16, Int4Rows>(qp, c, tables, ctx_lens, s, scale, window, op);
#else
  decode_codes_all<Lanes8, Int4Rows>(qp, c, tables, ctx_lens, s, scale, window, op);
#endif
  return out;
}

// paged_decode over a 16-bit cache: q (B, H, D) float32; k_data, v_data (blocks, block_size, KVH, D)
// float16 or bfloat16 (both the same); tables, ctx_lens, scale, window, softcap and sinks as
// paged_decode's. Returns (B, H, D).
at::Tensor paged_decode_half(const at::Tensor& q, const at::Tensor& k_data, const at::Tensor& v_data,
                             const at::Tensor& tables, const at::Tensor& ctx_lens, double scale, int64_t window,
                             double softcap, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous (B, H, D) float32");
  check_half_cache(k_data, v_data);
  const auto kind = k_data.scalar_type();
  const int64_t H = q.size(1), D = q.size(2), KVH = k_data.size(2), BS = k_data.size(1);
  TORCH_CHECK(k_data.size(3) == D && H % KVH == 0, "head_dim or head counts disagree");
  check_tables(tables, ctx_lens, q.size(0), BS);
  at::Tensor out = at::empty_like(q);
  const HalfKV c{reinterpret_cast<const uint16_t*>(k_data.data_ptr()), reinterpret_cast<const uint16_t*>(v_data.data_ptr()),
                 BS, KVH, D};
  const Shapes s{H, KVH, H / KVH, D, BS, tables.size(1), static_cast<float>(softcap), sink_data(sinks, H)};
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (kind == at::kBFloat16) decode_codes_lanes<HalfRows<true>>(qp, c, tables, ctx_lens, s, scale, window, op);
  else decode_codes_lanes<HalfRows<false>>(qp, c, tables, ctx_lens, s, scale, window, op);
  return out;
}

// x rounded to float16 / bfloat16 bits to nearest, ties to even, as torch's conversions round
// (a NaN stays a NaN).
inline uint16_t to_f16(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Where rope_write_rows_stored puts a step's keys and values in a stored-format cache:
// put(x, r, value) stores D float32 elements x as (slot, kv head) r of the keys (value false) or
// the values, exactly as the cache layer's ``store`` (kv_cache/quantized.py) computes them.

// A 16-bit cache (BF16: bfloat16, else float16): each element rounded (HalfCache.store).
template <bool BF16>
struct HalfWriter {
  uint16_t *k, *v;
  int64_t D;
  void put(const float* x, int64_t r, bool value) const {
    uint16_t* dst = (value ? v : k) + r * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = BF16 ? to_bf16(x[d]) : to_f16(x[d]);
  }
};

// An int8 cache (Int8Cache.store): s = max|x| / 127, codes round(x / s) (ties to even; x / 1 where
// s is 0) clamped to +-127.
struct Int8Writer {
  int8_t *k, *v;
  float *k_scales, *v_scales;
  int64_t D;
  void put(const float* x, int64_t r, bool value) const {
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float s = amax / 127.f, divisor = s > 0.f ? s : 1.f;
    int8_t* dst = (value ? v : k) + r * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<int8_t>(std::clamp(std::nearbyint(x[d] / divisor), -127.f, 127.f));
    (value ? v_scales : k_scales)[r] = s;
  }
};

// An int4 cache (Int4Cache.store, llama.cpp's q4_0) per group of 32: m the first element of
// largest magnitude, d = m / -8 rounded to float16, codes trunc(x * (1 / d) + 8.5) (the product
// rounded before the sum, as torch computes it; 0 where d is 0) clamped to 0..15, two a byte.
struct Int4Writer {
  uint8_t *k, *v;
  uint16_t *k_scales, *v_scales;
  int64_t D;
  void put(const float* x, int64_t r, bool value) const {
    uint8_t* dst = (value ? v : k) + r * (D / 2);
    uint16_t* scales = (value ? v_scales : k_scales) + r * (D / 32);
    for (int64_t j = 0; j < D / 32; ++j) {
      const float* g = x + 32 * j;
      int at = 0;
      for (int i = 1; i < 32; ++i)
        if (std::fabs(g[i]) > std::fabs(g[at])) at = i;
      scales[j] = to_f16(g[at] / -8.f);
      const float d = _cvtsh_ss(scales[j]), inverse = d != 0.f ? 1.f / d : 0.f;
      uint8_t codes[32];
      for (int i = 0; i < 32; ++i) {
        float product = g[i] * inverse;
        asm volatile("" : "+x"(product));  // no fused multiply-add: torch rounds the product first
        codes[i] = static_cast<uint8_t>(std::clamp(std::trunc(product + 8.5f), 0.f, 15.f));
      }
      for (int i = 0; i < 16; ++i) dst[16 * j + i] = codes[2 * i] | (codes[2 * i + 1] << 4);
    }
  }
};

// rope_write_rows for a stored-format cache, rows [b0, b1) (b1 < 0: all): each key rotated
// (rope_row) into float32, then it and each value put in their slot by `w`.
template <class Writer>
void rope_write_rows_stored(const float* x, const float* cp, const float* sp, const int64_t* slot, const RopeShape& r,
                            const Writer& w, float* qp, int64_t b0 = 0, int64_t b1 = -1) {
  const int64_t H = r.H, KVH = r.KVH, D = r.D, R = r.R;
  std::vector<float> key(D);
  for (int64_t b = b0; b < (b1 < 0 ? r.B : b1); ++b) {
    const float *row = x + b * (H + 2 * KVH) * D, *c = cp + b * R, *sn = sp + b * R;
    for (int64_t h = 0; h < H; ++h) rope_row(row + h * D, c, sn, qp + (b * H + h) * D, D, R);
    for (int64_t g = 0; g < KVH; ++g) {
      rope_row(row + (H + g) * D, c, sn, key.data(), D, R);
      w.put(key.data(), slot[b] * KVH + g, false);
      w.put(row + (H + KVH + g) * D, slot[b] * KVH + g, true);
    }
  }
}

// rope_write over a stored-format cache (a prompt chunk's rows, split over the threads, or a
// decode step's): k_data, v_data float16 or bfloat16 (no scales), int8 with float32 scales, or
// uint8 int4 codes with float16 group scales, as paged_decode_half/_int8/_int4 take them; each key
// and value stored as the cache layer's ``store`` computes it. Returns the rotated q (T, H, D).
at::Tensor rope_write_stored(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_data,
                             const at::Tensor& v_data, const at::Tensor& slots, int64_t num_heads,
                             const c10::optional<at::Tensor>& k_scales, const c10::optional<at::Tensor>& v_scales) {
  const auto kind = k_data.scalar_type();
  const bool coded = kind == at::kChar || kind == at::kByte;
  TORCH_CHECK(k_data.dim() == 4 && coded == (k_scales.has_value() && v_scales.has_value()),
              "int8 and int4 caches need their scales, 16-bit ones none");
  const int64_t D = kind == at::kByte ? 2 * k_data.size(3) : k_data.size(3);
  if (kind == at::kChar) check_int8_cache(k_data, *k_scales, v_data, *v_scales);
  else if (kind == at::kByte) check_int4_cache(k_data, *k_scales, v_data, *v_scales, D);
  else check_half_cache(k_data, v_data);
  const RopeShape r = check_rope_write(qkv, cos, sin, k_data, slots, num_heads, D);
  at::Tensor q = at::empty({r.B, r.H, r.D}, qkv.options());
  const float *x = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  const auto rows = [&](const auto& w) {
    at::parallel_for(0, r.B, 64, [&](int64_t b0, int64_t b1) { rope_write_rows_stored(x, cp, sp, slot, r, w, qp, b0, b1); });
  };
  const auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
  if (kind == at::kChar)
    rows(Int8Writer{k_data.data_ptr<int8_t>(), v_data.data_ptr<int8_t>(), k_scales->data_ptr<float>(),
                    v_scales->data_ptr<float>(), D});
  else if (kind == at::kByte)
    rows(Int4Writer{k_data.data_ptr<uint8_t>(), v_data.data_ptr<uint8_t>(), bits(*k_scales), bits(*v_scales), D});
  else if (kind == at::kBFloat16) rows(HalfWriter<true>{bits(k_data), bits(v_data), D});
  else rows(HalfWriter<false>{bits(k_data), bits(v_data), D});
  return q;
}

// rope_write_decode over a 16-bit, int8 or int4 cache (paged_decode_half's, _int8's or _int4's
// arrays): the step's keys and values stored into it as rope_write_stored stores them, then the
// attention read from it. Each returns (B, H * D). The format is checked before anything is written.
at::Tensor rope_write_decode_half(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                  const at::Tensor& k_data, const at::Tensor& v_data, const at::Tensor& slots,
                                  const at::Tensor& tables, const at::Tensor& ctx_lens, int64_t num_heads, double scale,
                                  int64_t window, double softcap, const c10::optional<at::Tensor>& sinks) {
  check_half_cache(k_data, v_data);
  const at::Tensor q = rope_write_stored(qkv, cos, sin, k_data, v_data, slots, num_heads, c10::nullopt, c10::nullopt);
  return paged_decode_half(q, k_data, v_data, tables, ctx_lens, scale, window, softcap, sinks).view({q.size(0), q.size(1) * q.size(2)});
}

at::Tensor rope_write_decode_int8(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                  const at::Tensor& k_data, const at::Tensor& k_scales, const at::Tensor& v_data,
                                  const at::Tensor& v_scales, const at::Tensor& slots, const at::Tensor& tables,
                                  const at::Tensor& ctx_lens, int64_t num_heads, double scale, int64_t window,
                                  double softcap, const c10::optional<at::Tensor>& sinks) {
  check_int8_cache(k_data, k_scales, v_data, v_scales);
  const at::Tensor q = rope_write_stored(qkv, cos, sin, k_data, v_data, slots, num_heads, k_scales, v_scales);
  return paged_decode_int8(q, k_data, k_scales, v_data, v_scales, tables, ctx_lens, scale, window, softcap, sinks)
      .view({q.size(0), q.size(1) * q.size(2)});
}

at::Tensor rope_write_decode_int4(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                  const at::Tensor& k_data, const at::Tensor& k_scales, const at::Tensor& v_data,
                                  const at::Tensor& v_scales, const at::Tensor& slots, const at::Tensor& tables,
                                  const at::Tensor& ctx_lens, int64_t num_heads, double scale, int64_t window,
                                  double softcap, const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(k_data.dim() == 4, "codes must be (blocks, block_size, kv_heads, head_dim / 2) uint8");
  check_int4_cache(k_data, k_scales, v_data, v_scales, 2 * k_data.size(3));
  const at::Tensor q = rope_write_stored(qkv, cos, sin, k_data, v_data, slots, num_heads, k_scales, v_scales);
  return paged_decode_int4(q, k_data, k_scales, v_data, v_scales, tables, ctx_lens, scale, window, softcap, sinks)
      .view({q.size(0), q.size(1) * q.size(2)});
}

// One call for a decode step's attention block: rope_write of the step's one token per
// sequence, then paged_decode's attention. Returns (B, H * D). Replaces a dozen small ops
// per layer.
at::Tensor rope_write_decode(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                             const at::Tensor& tables, const at::Tensor& ctx_lens, int64_t num_heads, double scale,
                             int64_t window, double softcap, const c10::optional<at::Tensor>& sinks) {
  const RopeShape r = check_rope_write(qkv, cos, sin, k_cache, slots, num_heads);
  const int64_t B = r.B, H = r.H, KVH = r.KVH, D = r.D;
  check_caches(k_cache, v_cache, tables, ctx_lens, B);
  at::Tensor q = at::empty({B, H, D}, qkv.options());
  float* qp = q.data_ptr<float>();
  rope_write_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), slots.data_ptr<int64_t>(), 0, B,
                  r, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), qp);
  at::Tensor out = at::empty({B, H * D}, qkv.options());
  decode_all(qp, k_cache, v_cache, tables, ctx_lens,
             Shapes{H, KVH, H / KVH, D, k_cache.size(1), tables.size(1), static_cast<float>(softcap),
                    sink_data(sinks, H)},
             static_cast<float>(scale), window, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY(TOKENLOOM_ATTENTION_LIBRARY, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor ctx_lens, float scale, "
        "int window, float softcap, Tensor? sinks=None) -> Tensor");
  m.def("rope_write_decode(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "Tensor tables, Tensor ctx_lens, int num_heads, float scale, int window, float softcap, Tensor? sinks=None) -> Tensor");
  m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "int num_heads) -> Tensor");
  m.def("paged_decode_int8(Tensor q, Tensor k_data, Tensor k_scales, Tensor v_data, Tensor v_scales, Tensor tables, "
        "Tensor ctx_lens, float scale, int window, float softcap, Tensor? sinks=None) -> Tensor");
  m.def("paged_decode_int4(Tensor q, Tensor k_data, Tensor k_scales, Tensor v_data, Tensor v_scales, Tensor tables, "
        "Tensor ctx_lens, float scale, int window, float softcap, Tensor? sinks=None) -> Tensor");
  m.def("rope_write_decode_half(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_data, Tensor(b!) v_data, "
        "Tensor slots, Tensor tables, Tensor ctx_lens, int num_heads, float scale, int window, float softcap, "
        "Tensor? sinks=None) -> Tensor");
  m.def("rope_write_decode_int8(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_data, Tensor(b!) k_scales, "
        "Tensor(c!) v_data, Tensor(d!) v_scales, Tensor slots, Tensor tables, Tensor ctx_lens, int num_heads, "
        "float scale, int window, float softcap, Tensor? sinks=None) -> Tensor");
  m.def("rope_write_decode_int4(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_data, Tensor(b!) k_scales, "
        "Tensor(c!) v_data, Tensor(d!) v_scales, Tensor slots, Tensor tables, Tensor ctx_lens, int num_heads, "
        "float scale, int window, float softcap, Tensor? sinks=None) -> Tensor");
  m.def("rope_write_stored(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_data, Tensor(b!) v_data, Tensor slots, "
        "int num_heads, Tensor(c!)? k_scales=None, Tensor(d!)? v_scales=None) -> Tensor");
  m.def("paged_decode_half(Tensor q, Tensor k_data, Tensor v_data, Tensor tables, Tensor ctx_lens, float scale, "
        "int window, float softcap, Tensor? sinks=None) -> Tensor");
  m.def("paged_decode_out(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor ctx_lens, float scale, "
        "int window, float softcap, Tensor? sinks, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(TOKENLOOM_ATTENTION_LIBRARY, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("rope_write_decode", &rope_write_decode);
  m.impl("rope_write", &rope_write);
  m.impl("paged_decode_out", &paged_decode_out);
  m.impl("paged_decode_int8", &paged_decode_int8);
  m.impl("paged_decode_int4", &paged_decode_int4);
  m.impl("paged_decode_half", &paged_decode_half);
  m.impl("rope_write_decode_half", &rope_write_decode_half);
  m.impl("rope_write_decode_int8", &rope_write_decode_int8);
  m.impl("rope_write_stored", &rope_write_stored);
  m.impl("rope_write_decode_int4", &rope_write_decode_int4);
}
