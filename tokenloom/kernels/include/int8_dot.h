// Shared by the int8/int4 kernels (quant_cpu.cpp) and the GGUF block kernels (ggml_cpu.cpp):
// activations quantized to int8 per block of 32, 32-lane integer dot products, nibble unpacking.
#pragma once

#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>

namespace tokenloom_int8 {

constexpr int64_t QK = 32;   // values per quantization block

// One block of 32 floats -> int8 codes in q (scale max|x|/127, round to nearest even), the
// integer sum of the codes of each half (values 0-15, 16-31) in halves; returns the scale.
// The reference arithmetic, one value at a time; quantize_block gives the same bits.
inline float quantize_block_scalar(const float* v, int8_t* q, int32_t halves[2]) {
  float amax = 0.f;
  for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  halves[0] = halves[1] = 0;
  for (int i = 0; i < QK; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
    halves[i / 16] += q[i];
  }
  return d;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The code of 16 values: round to nearest even (the default MXCSR mode, as nearbyint), then
// the int's low byte sign-extended (as static_cast<int8_t>, also for the NaN of 0 * inf).
inline __m512i codes16(__m512 v, __m512 inv) {
  return _mm512_srai_epi32(_mm512_slli_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)), 24), 24);
}
#elif defined(__AVX2__)
inline __m256i codes8(__m256 v, __m256 inv) {
  return _mm256_srai_epi32(_mm256_slli_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v, inv)), 24), 24);
}

inline int32_t hsum8(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}
#endif

// quantize_block_scalar, 16 (AVX-512) or 8 (AVX2) values at a time: a decode step quantizes
// ~120 activation rows on its critical path, a visible share of the step one value at a time
// (docs/BENCHMARKS.md, 'Measurements behind design choices'). max(|v|, m)
// keeps m where v is NaN, as std::max(m, |v|) does; the maximum does not depend on order.
inline float quantize_block(const float* v, int8_t* q, int32_t halves[2]) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const __m512 m = _mm512_max_ps(_mm512_and_ps(b, magnitude), _mm512_max_ps(_mm512_and_ps(a, magnitude), _mm512_setzero_ps()));
  const float amax = _mm512_reduce_max_ps(m);
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  const __m512i qa = codes16(a, _mm512_set1_ps(inv)), qb = codes16(b, _mm512_set1_ps(inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  halves[0] = _mm512_reduce_add_epi32(qa);
  halves[1] = _mm512_reduce_add_epi32(qb);
  return d;
#elif defined(__AVX2__)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 x[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    m = _mm256_max_ps(_mm256_and_ps(x[i], magnitude), m);
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
  __m256i c[4];
  for (int i = 0; i < 4; ++i) c[i] = codes8(x[i], _mm256_set1_ps(inv));
  // codes fit in int8, so saturating packs keep them; the packs interleave 128-bit lanes
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  halves[0] = hsum8(_mm256_add_epi32(c[0], c[1]));
  halves[1] = hsum8(_mm256_add_epi32(c[2], c[3]));
  return d;
#else
  return quantize_block_scalar(v, q, halves);
#endif
}

// How a decode call (one activation row) walks the panels of a weight it reads once, each
// thread over its own range of panels:
//   SPLIT: the range cut in two halves walked side by side (panels p and p + half), two
//          sequential streams left to the hardware prefetcher;
//   ADJACENT: two neighbouring panels at a time, with software prefetch 1 KB ahead.
// On an AMD CPU SPLIT measured fastest (one panel at a time next, ADJACENT last); on an Intel
// CPU ADJACENT did (docs/BENCHMARKS.md, 'Measurements behind design choices').
// So: SPLIT on AMD, ADJACENT elsewhere; TOKENLOOM_DECODE_WALK=split or adjacent overrides (to
// measure). The int8/int4 panels' batched calls (a few rows, each panel pair computing every
// row) walk the same way (SPLIT measured faster there too). The same bits either way: each
// panel's arithmetic does not depend on its neighbours.
enum class DecodeWalk { SPLIT, ADJACENT };

inline DecodeWalk decode_walk() {
  static const DecodeWalk walk = [] {
    __builtin_cpu_init();
    const DecodeWalk cpu = __builtin_cpu_is("amd") ? DecodeWalk::SPLIT : DecodeWalk::ADJACENT;
    const char* env = std::getenv("TOKENLOOM_DECODE_WALK");
    if (env == nullptr) return cpu;
    if (std::string(env) == "split") return DecodeWalk::SPLIT;
    if (std::string(env) == "adjacent") return DecodeWalk::ADJACENT;
    std::fprintf(stderr, "tokenloom: TOKENLOOM_DECODE_WALK=%s is neither split nor adjacent; using %s\n", env,
                 cpu == DecodeWalk::SPLIT ? "split" : "adjacent");
    return cpu;
  }();
  return walk;
}

// Panels [p0, p1) walked `walk`'s way: row(first, dist, count) computes `count` (1 or 2) panels
// first, first + dist. SPLIT: the two halves side by side, then an odd range's last panel;
// ADJACENT: neighbours (dist 1), the last alone where the range is odd.
template <typename Row>
inline void walk_panels(DecodeWalk walk, int64_t p0, int64_t p1, Row&& row) {
  if (walk == DecodeWalk::ADJACENT) {
    for (int64_t p = p0; p < p1; p += 2) row(p, 1, p + 2 <= p1 ? 2 : 1);
    return;
  }
  const int64_t half = (p1 - p0) / 2;
  for (int64_t i = 0; i < half; ++i) row(p0 + i, half, 2);
  if ((p1 - p0) % 2) row(p1 - 1, 0, 1);
}

inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// Sum over 32 lanes of w * x, as 8 int32 partial sums (lane j: values 4j..4j+3): signed w in
// -127..127, or unsigned w small enough that maddubs' int16 pairs cannot saturate (< 128).
// The AVX-512 VNNI build uses one dpbusd; both builds give the same bits (exact in int32).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline __m256i dot_signed(__m256i w, __m256i x) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
inline __m256i dot_unsigned(__m256i w, __m256i x) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x); }
#else
inline __m256i dot_signed(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)),
                           _mm256_set1_epi16(1));
}
inline __m256i dot_unsigned(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
#endif

// 16 bytes -> 32 values 0..15: the low nibbles (values 0-15), then the high ones (16-31).
inline __m256i nibbles_lo_hi(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

// Output rows [n0, n1) for activation rows [0, M) in register tiles: 2x2 (1x4 for a lone
// row), then the leftovers. tile(MT, NT, m, n) computes an MT x NT tile at (m, n); MT and NT
// come as std::integral_constant so the caller can pass them on as template arguments.
template <typename Tile>
inline void tile_rows(int64_t M, int64_t n0, int64_t n1, Tile&& tile) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) {
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) tile(Two{}, Two{}, m, n);
    for (; n < n1; ++n) tile(Two{}, One{}, m, n);
  }
  for (; m < M; ++m) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) tile(One{}, Four{}, m, n);
    for (; n < n1; ++n) tile(One{}, One{}, m, n);
  }
}

}  // namespace tokenloom_int8
