// Stored KV elements widened to float32, 8 lanes (AVX2 + F16C), shared by the decode
// (paged_decode_cpu.cpp, its Lanes8) and prompt (paged_prefill_cpu.cpp, widen_row) attention
// kernels, so both read a 16-bit, int8 or int4 cache as the same floats.
#pragma once
#include <immintrin.h>
#include <cstdint>

// 8 int8 codes at p -> 8 floats (unscaled).
inline __m256 widen8_codes(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 8 float16 at p -> 8 floats (exact).
inline __m256 widen8_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// 8 bfloat16 at p -> 8 floats (exact: a bfloat16 is a float32's high half).
inline __m256 widen8_bf16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// A q4_0 group's 16 bytes at p -> its 32 codes minus 8 as int8, in element order: elements
// 0-15 in lo, 16-31 in hi.
inline void q4_codes(const uint8_t* p, __m128i& lo, __m128i& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i nibble = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  const __m128i even = _mm_and_si128(bytes, nibble), odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
  lo = _mm_sub_epi8(_mm_unpacklo_epi8(even, odd), eight);
  hi = _mm_sub_epi8(_mm_unpackhi_epi8(even, odd), eight);
}

// The 32 elements of the q4_0 group at p (16 bytes), scale d, as floats (code - 8) * d (one
// rounding, as Int4Cache's reads give them), in 4 vectors of 8 at dst + j * stride.
inline void q4_group8(const uint8_t* p, float d, float* dst, int64_t stride) {
  __m128i lo, hi;
  q4_codes(p, lo, hi);
  const __m256 scale = _mm256_set1_ps(d);
  const auto put = [&](int j, __m128i codes) {  // the low 8 of 16 codes -> vector j
    _mm256_storeu_ps(dst + j * stride, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), scale));
  };
  put(0, lo), put(1, _mm_unpackhi_epi64(lo, lo)), put(2, hi), put(3, _mm_unpackhi_epi64(hi, hi));
}
