// Matrix products with GGUF weight blocks exactly as the file stores them (x86, AVX2 + FMA;
// the AVX-512 VNNI build replaces the integer dot product with dpbusd).
//
// A weight is (N, row_bytes) uint8: each output row is K / block_values blocks of the GGUF
// type, bytes as in the file (see ggml-common.h). Every block type is read as sub-blocks of
// 32 values: 32 integer codes (signed, or unsigned with an offset), a scale per 16 values
// and an offset per 16 values, so that
//     w[k] = scale[k / 16] * code[k] + offset[k / 16]     (within one 32-value sub-block).
// Activations are quantized per 32 values to int8 with one float scale (as for the int8/int4
// kernels, quant_cpu.cpp), keeping the float sum of each 16 values for the offsets; each
// sub-block's dot product is exact in int32 and scaled once in float.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <vector>

#include "../../../kernels/include/int8_dot.h"
#include "../../../kernels/include/silu_mul_row.h"
#include "exact_relay.h"
#include "panel_relay.h"

namespace {

using tokenloom_int8::QK;
using tokenloom_int8::dot_signed;
using tokenloom_int8::dot_unsigned;
using tokenloom_int8::hsum;
using tokenloom_int8::nibbles_lo_hi;

enum GGMLType : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23, MXFP4 = 39,
};

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

const int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4's e2m1 values doubled (0, 0.5, 1, 1.5, 2, 3, 4, 6 -> integers), sign in the top bit
const int8_t kMXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// An e8m0 scale byte as the scale of the doubled values: 2^(e - 128) (ggml's E8M0_TO_FP32_HALF;
// e 0 and 1 give subnormals).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One 32-value sub-block, decoded: codes, the scale of each int32 lane of a dot product
// (lanes 0-3 hold values 0-15, lanes 4-7 values 16-31) and the offsets of the two halves.
struct Sub {
  __m256i codes;
  __m256 scale;
  float off0, off1;
};

inline __m256 halves(float a, float b) { return _mm256_setr_ps(a, a, a, a, b, b, b, b); }

inline __m256i low_nibbles(const uint8_t* q) {     // 32 bytes -> their low nibbles
  return _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), _mm256_set1_epi8(0x0F));
}

inline __m256i high_nibbles(const uint8_t* q) {    // 32 bytes -> their high nibbles
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}

// 32 bits (bit j for value j) -> bytes of 0x10 where the bit is set.
inline __m256i bits_to_16(uint32_t bits) {
  const __m256i shuffle = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                                              0x0303030303030303);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask), _mm256_set1_epi8(0x10));
}

inline __m256i lookup(const int8_t* table, __m256i idx) {  // 16-entry table, per byte
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table));
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), idx);
}

inline __m256i lookup_iq4nl(__m256i idx) { return lookup(kIQ4NL, idx); }

using tokenloom_relay::scale_min_k4;  // Q4_K / Q5_K sub-block scales and mins (panel_relay.h)

// The 16 signed 6-bit scales of a Q3_K block (ggml's kmask unpacking), minus 32.
inline int q3k_scale(const uint8_t* s, int i) {
  const int low = i < 8 ? s[i] & 0xF : s[i - 8] >> 4;
  const int high = (s[8 + (i % 4)] >> (2 * (i / 4))) & 3;
  return (low | (high << 4)) - 32;
}

// Per type: bytes per block, values per block, whether codes are signed, and the decoder of
// sub-block s (0 .. values/32 - 1) of block b.
template <int T> struct Block;

template <> struct Block<Q8_0> {
  static constexpr int64_t BYTES = 34, VALUES = 32;
  static constexpr bool SIGNED = true;
  static Sub sub(const uint8_t* b, int) {
    const float d = fp16(b);
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), _mm256_set1_ps(d), 0.f, 0.f};
  }
};

template <> struct Block<Q4_0> {
  static constexpr int64_t BYTES = 18, VALUES = 32;
  static constexpr bool SIGNED = false;
  static Sub sub(const uint8_t* b, int) {
    const float d = fp16(b);
    return {nibbles_lo_hi(b + 2), _mm256_set1_ps(d), -8.f * d, -8.f * d};
  }
};

template <> struct Block<Q4_1> {
  static constexpr int64_t BYTES = 20, VALUES = 32;
  static constexpr bool SIGNED = false;
  static Sub sub(const uint8_t* b, int) {
    const float m = fp16(b + 2);
    return {nibbles_lo_hi(b + 4), _mm256_set1_ps(fp16(b)), m, m};
  }
};

template <> struct Block<Q5_0> {
  static constexpr int64_t BYTES = 22, VALUES = 32;
  static constexpr bool SIGNED = false;
  static Sub sub(const uint8_t* b, int) {
    const float d = fp16(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    return {_mm256_or_si256(nibbles_lo_hi(b + 6), bits_to_16(qh)), _mm256_set1_ps(d), -16.f * d, -16.f * d};
  }
};

template <> struct Block<Q5_1> {
  static constexpr int64_t BYTES = 24, VALUES = 32;
  static constexpr bool SIGNED = false;
  static Sub sub(const uint8_t* b, int) {
    const float m = fp16(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    return {_mm256_or_si256(nibbles_lo_hi(b + 8), bits_to_16(qh)), _mm256_set1_ps(fp16(b)), m, m};
  }
};

template <> struct Block<IQ4_NL> {
  static constexpr int64_t BYTES = 18, VALUES = 32;
  static constexpr bool SIGNED = true;
  static Sub sub(const uint8_t* b, int) { return {lookup_iq4nl(nibbles_lo_hi(b + 2)), _mm256_set1_ps(fp16(b)), 0.f, 0.f}; }
};

// MXFP4 (17 B): e8m0 scale byte, then IQ4_NL's nibble layout indexing kMXFP4.
template <> struct Block<MXFP4> {
  static constexpr int64_t BYTES = 17, VALUES = 32;
  static constexpr bool SIGNED = true;
  static Sub sub(const uint8_t* b, int) {
    return {lookup(kMXFP4, nibbles_lo_hi(b + 1)), _mm256_set1_ps(e8m0_half(b[0])), 0.f, 0.f};
  }
};

// Q2_K (84 B): scales[16] (low nibble scale, high nibble min, per 16 values), qs[64], d, dmin.
// Value 128n + 32j + l is (qs[32n + l] >> 2j) & 3.
template <> struct Block<Q2_K> {
  static constexpr int64_t BYTES = 84, VALUES = 256;
  static constexpr bool SIGNED = false;
  static Sub sub(const uint8_t* b, int s) {
    const int n = s / 4, j = s % 4;
    const float d = fp16(b + 80), dmin = fp16(b + 82);
    const uint8_t s0 = b[2 * s], s1 = b[2 * s + 1];
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * n));
    const __m256i codes = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * j)), _mm256_set1_epi8(3));
    return {codes, halves(d * (s0 & 0xF), d * (s1 & 0xF)), -dmin * (s0 >> 4), -dmin * (s1 >> 4)};
  }
};

// Q3_K (110 B): hmask[32], qs[64], scales[12], d. Value 128n + 32j + l is
// ((qs[32n + l] >> 2j) & 3) - (hmask[l] bit 4n+j ? 0 : 4), scaled per 16 values.
template <> struct Block<Q3_K> {
  static constexpr int64_t BYTES = 110, VALUES = 256;
  static constexpr bool SIGNED = true;
  static Sub sub(const uint8_t* b, int s) {
    const int n = s / 4, j = s % 4;
    const float d = fp16(b + 108);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * n));
    const __m256i low = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * j)), _mm256_set1_epi8(3));
    const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << s));
    const __m256i missing = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), _mm256_setzero_si256());   // 0xFF: minus 4
    const __m256i codes = _mm256_sub_epi8(low, _mm256_and_si256(missing, _mm256_set1_epi8(4)));
    const uint8_t* sc = b + 96;
    return {codes, halves(d * q3k_scale(sc, 2 * s), d * q3k_scale(sc, 2 * s + 1)), 0.f, 0.f};
  }
};

// Sub-block s of a Q4_K / Q5_K block (d, dmin, scales[12] with a 6-bit scale and min per 32
// values, ...): the nibbles of qs[32 (s/2) ..] (low for even s, high for odd) OR-ed with
// `high`, scale d * sc, offset -dmin * m.
inline Sub k4_sub(const uint8_t* b, int s, const uint8_t* qs, __m256i high) {
  int sc, m;
  scale_min_k4(s, b + 4, sc, m);
  const uint8_t* q = qs + 32 * (s / 2);
  const float off = -fp16(b + 2) * m;
  return {_mm256_or_si256(s % 2 ? high_nibbles(q) : low_nibbles(q), high), _mm256_set1_ps(fp16(b) * sc), off, off};
}

// Q4_K (144 B): d, dmin, scales[12], qs[128].
template <> struct Block<Q4_K> {
  static constexpr int64_t BYTES = 144, VALUES = 256;
  static constexpr bool SIGNED = false;
  static Sub sub(const uint8_t* b, int s) { return k4_sub(b, s, b + 16, _mm256_setzero_si256()); }
};

// Q5_K (176 B): d, dmin, scales[12], qh[32], qs[128]: Q4_K plus a fifth bit, bit s of qh[l].
template <> struct Block<Q5_K> {
  static constexpr int64_t BYTES = 176, VALUES = 256;
  static constexpr bool SIGNED = false;
  static Sub sub(const uint8_t* b, int s) {
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << s));
    const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), _mm256_set1_epi8(0x10));
    return k4_sub(b, s, b + 48, high);
  }
};

// Q6_K (210 B): ql[128], qh[64], scales[16] int8 (per 16 values), d. Value 128n + 32j + l is
// (4 bits of ql[64n + l + 32 (j&1)], low for j < 2, high otherwise) | ((qh[32n + l] >> 2j) & 3) << 4, minus 32.
template <> struct Block<Q6_K> {
  static constexpr int64_t BYTES = 210, VALUES = 256;
  static constexpr bool SIGNED = true;
  static Sub sub(const uint8_t* b, int s) {
    const int n = s / 4, j = s % 4;
    const uint8_t* ql = b + 64 * n + 32 * (j & 1);
    const __m256i low = j < 2 ? low_nibbles(ql) : high_nibbles(ql);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * j)), _mm256_set1_epi8(3));
    const __m256i codes = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = fp16(b + 208);
    return {codes, halves(d * sc[2 * s], d * sc[2 * s + 1]), 0.f, 0.f};
  }
};

// IQ4_XS (136 B): d, scales_h (uint16), scales_l[4], qs[128]; sub-block s: 16 bytes of nibbles
// (low: values 0-15, high: 16-31) indexing the IQ4_NL table, scale d * (6-bit ls - 32).
template <> struct Block<IQ4_XS> {
  static constexpr int64_t BYTES = 136, VALUES = 256;
  static constexpr bool SIGNED = true;
  static Sub sub(const uint8_t* b, int s) {
    uint16_t sh;
    std::memcpy(&sh, b + 2, 2);
    const int ls = ((b[4 + s / 2] >> (4 * (s % 2))) & 0xF) | (((sh >> (2 * s)) & 3) << 4);
    return {lookup_iq4nl(nibbles_lo_hi(b + 8 + 16 * s)), _mm256_set1_ps(fp16(b) * (ls - 32)), 0.f, 0.f};
  }
};

// ---- activations ---------------------------------------------------------------------------

// x (M, K) float32 -> int8 codes per 32 values (scale max|x|/127), the sum of every 16
// quantized values (scale x code sum) and the integer sum of every 16 codes; one byte tensor holds q (M*K), scale
// (M*K/32 floats), sum16 (M*K/16 floats), isum16 (M*K/16 int32).
at::Tensor quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU matrix");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  TORCH_CHECK(K % QK == 0, "in_features must be a multiple of 32, got ", K);
  at::Tensor storage = at::empty({M * K + M * nb * 4 * 5}, x.options().dtype(at::kByte));
  uint8_t* base = storage.data_ptr<uint8_t>();
  int8_t* q = reinterpret_cast<int8_t*>(base);
  float* scale = reinterpret_cast<float*>(base + M * K);
  float* sum16 = scale + M * nb;
  int32_t* isum16 = reinterpret_cast<int32_t*>(sum16 + 2 * M * nb);
  const float* src = x.data_ptr<float>();
  at::parallel_for(0, M * nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int32_t codes[2];
      const float d = tokenloom_int8::quantize_block(src + b * QK, q + b * QK, codes);
      scale[b] = d;
      // offsets multiply the quantized values' sums (OFFSET_SUMS in quant_cpu.cpp says why)
      for (int h = 0; h < 2; ++h) { sum16[2 * b + h] = d * codes[h]; isum16[2 * b + h] = codes[h]; }
    }
  });
  return storage;
}

struct Acts {
  const int8_t* q;
  const float* scale;
  const float* sum16;
  const int32_t* isum16;
  int64_t K, nb;
};

Acts view_acts(const at::Tensor& storage, int64_t M, int64_t K) {
  TORCH_CHECK(storage.scalar_type() == at::kByte && storage.numel() == M * K + M * (K / QK) * 20,
              "activations must come from quantize_activations for (M, K)");
  const uint8_t* base = storage.data_ptr<uint8_t>();
  const float* scale = reinterpret_cast<const float*>(base + M * K);
  const float* sum16 = scale + M * (K / QK);
  return {reinterpret_cast<const int8_t*>(base), scale, sum16,
          reinterpret_cast<const int32_t*>(sum16 + 2 * M * (K / QK)), K, K / QK};
}

// ---- products ------------------------------------------------------------------------------

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TOKENLOOM_GGML_LIBRARY tokenloom_ggml_vnni
#else
#define TOKENLOOM_GGML_LIBRARY tokenloom_ggml
#endif

struct Weight {
  const uint8_t* q;
  int64_t row_bytes;
};

constexpr int64_t PREFETCH_BYTES = 1024;

// out[m][col0 + n] for an MT x NT tile (activation rows m0.., weight rows n0..), one pass over K.
template <int T, int MT, int NT>
void tile(const Weight& w, const Acts& a, int64_t m0, int64_t n0, float* out, int64_t ldo) {
  using B = Block<T>;
  constexpr int SUBS = B::VALUES / QK;
  __m256 acc[MT][NT];
  float off[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) { acc[m][j] = _mm256_setzero_ps(); off[m][j] = 0.f; }
  const int64_t blocks = a.K / B::VALUES;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    for (int j = 0; j < NT; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(w.q + (n0 + j) * w.row_bytes + blk * B::BYTES + PREFETCH_BYTES),
                   _MM_HINT_T0);
    for (int s = 0; s < SUBS; ++s) {
      const int64_t xb = blk * SUBS + s;    // activation block index within a row
      Sub sub[NT];
      for (int j = 0; j < NT; ++j) sub[j] = B::sub(w.q + (n0 + j) * w.row_bytes + blk * B::BYTES, s);
      for (int m = 0; m < MT; ++m) {
        const int64_t xi = (m0 + m) * a.nb + xb;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (m0 + m) * a.K + xb * QK));
        const __m256 xs = _mm256_set1_ps(a.scale[xi]);
        const float x0 = a.sum16[2 * xi], x1 = a.sum16[2 * xi + 1];   // offsets use the float sums
        for (int j = 0; j < NT; ++j) {
          const __m256i d = B::SIGNED ? dot_signed(sub[j].codes, xv) : dot_unsigned(sub[j].codes, xv);
          acc[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sub[j].scale, xs), acc[m][j]);
          if constexpr (!B::SIGNED) off[m][j] += sub[j].off0 * x0 + sub[j].off1 * x1;
        }
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) out[(m0 + m) * ldo + n0 + j] = hsum(acc[m][j]) + off[m][j];
}

template <int T>
void matmul_type(const Weight& w, const Acts& a, int64_t M, int64_t N, float* out, int64_t ldo) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    tokenloom_int8::tile_rows(M, n0, n1, [&](auto mt, auto nt, int64_t m, int64_t n) {
      tile<T, decltype(mt)::value, decltype(nt)::value>(w, a, m, n, out, ldo);
    });
  });
}

template <int T>
void dequantize_type(const uint8_t* q, int64_t R, int64_t row_bytes, int64_t K, float* out) {
  using B = Block<T>;
  constexpr int SUBS = B::VALUES / QK;
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t blk = 0; blk < K / B::VALUES; ++blk)
        for (int s = 0; s < SUBS; ++s) {
          const Sub sub = B::sub(q + r * row_bytes + blk * B::BYTES, s);
          alignas(32) int8_t codes[32];
          alignas(32) float scale[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(codes), sub.codes);
          _mm256_store_ps(scale, sub.scale);
          float* y = out + r * K + (blk * SUBS + s) * QK;
          for (int i = 0; i < QK; ++i) {
            const int code = B::SIGNED ? codes[i] : static_cast<uint8_t>(codes[i]);
            y[i] = scale[(i / 16) * 4] * code + (i < 16 ? sub.off0 : sub.off1);
          }
        }
  });
}

#define TOKENLOOM_GGML_TYPES(X) X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q8_0) X(Q2_K) X(Q3_K) X(Q4_K) X(Q5_K) X(Q6_K) \
  X(IQ4_NL) X(IQ4_XS) X(MXFP4)

int64_t block_bytes(int64_t type, int64_t& values) {
  switch (type) {
#define CASE(T) case T: values = Block<T>::VALUES; return Block<T>::BYTES;
    TOKENLOOM_GGML_TYPES(CASE)
#undef CASE
    default: TORCH_CHECK(false, "GGML type ", type, " has no CPU kernel");
  }
}

void check_weight(const at::Tensor& w, int64_t type, int64_t K) {
  int64_t values = 0;
  const int64_t bytes = block_bytes(type, values);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.stride(1) == 1, "weight must be (N, row_bytes) uint8");
  TORCH_CHECK(K % values == 0 && w.size(1) == K / values * bytes, "weight rows of ", w.size(1), " bytes do not hold ",
              K, " values of GGML type ", type);
}

// out[:, col0 : col0 + N] = x @ w.T for the activations of ggml_quantize_activations(x).
void matmul_into(at::Tensor out, int64_t col0, const at::Tensor& xq, int64_t K, const at::Tensor& w, int64_t type) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1, "out must be (M, *) float32");
  check_weight(w, type, K);
  const int64_t M = out.size(0), N = w.size(0);
  TORCH_CHECK(col0 >= 0 && col0 + N <= out.size(1), "columns ", col0, "+", N, " exceed out");
  const Acts a = view_acts(xq, M, K);
  const Weight wt{w.data_ptr<uint8_t>(), w.stride(0)};
  float* y = out.data_ptr<float>() + col0;
  switch (type) {
#define CASE(T) case T: matmul_type<T>(wt, a, M, N, y, out.stride(0)); break;
    TOKENLOOM_GGML_TYPES(CASE)
#undef CASE
  }
}

at::Tensor dequantize(const at::Tensor& w, int64_t type, int64_t K) {
  check_weight(w, type, K);
  at::Tensor out = at::empty({w.size(0), K}, w.options().dtype(at::kFloat));
  const uint8_t* q = w.data_ptr<uint8_t>();
  switch (type) {
#define CASE(T) case T: dequantize_type<T>(q, w.size(0), w.stride(0), K, out.data_ptr<float>()); break;
    TOKENLOOM_GGML_TYPES(CASE)
#undef CASE
  }
  return out;
}

// ---- 16-row panels of 4/5/6-bit codes -------------------------------------------------------
// GGUF blocks re-laid at load (quant/gguf/panels.py), the same values, so that one 512-bit
// dpbusd multiplies 16 output rows by 4 activations (the AVX2 build: two halves of 8 rows, with
// maddubs + madd). Per panel p (rows 16p..16p+15) and block
// b (values 32b..32b+31), the unsigned code of row n, value 32b + 8c + 4h + i is
//   lo (P, nb, 4, 64): byte 64c + 4n + i, nibble h (low: h = 0)       -> code bits 0-3
//   hi (P, nb, HB, 64): plane j, byte 4n + i, bit 2c + h             -> code bit 4 + j
// and the weight is  scale * (code - Z) [+ offset], with
//   per-32 scales: scale, offset (P, nb, 16) of S (float16), one per row and block;
//   K-quants keep the file's two levels: sub-scales (and sub-mins) per block, integers as
//   stored, times per-row super-block factors dsup, msup (P, nb/8, 16) float32 (d and -dmin):
//   Q4_K/Q5_K scale, offset (P, nb, 16) uint8 (6-bit); Q6_K scale (P, nb, 2, 16) int8, per 16
//   values (0-15, 16-31), no offset. Their products d * sc are exact in float32 (at most 19
//   significant bits), so the weights are those of the file, as with scales stored multiplied.
// Q5_0: HB 1, Z 16; Q5_1: HB 1, offsets; Q4_K: HB 0, offsets; Q5_K: HB 1, offsets;
// Q6_K: HB 2, Z 32, per-16. MXFP4: HB LUT4 (the 4-bit codes index kMXFP4U, its doubled values
// plus 12, no planes), Z 12, scale the block's e8m0 byte (E8M0: 2^(e - 128) in the kernel), 17
// bytes per 32 weights as in the file. Dot products are exact in int32.
constexpr int LUT4 = -1;
// kMXFP4 + 12: unsigned codes 0..24, so the unsigned-by-signed products of both builds take them
const int8_t kMXFP4U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
struct E8M0 {
  uint8_t e;
};
struct GPanel {
  const uint8_t* lo;
  const uint8_t* hi;
  const void* scale;
  const void* offset;
  const float* dsup;     // K-quants: per super-block (8 blocks) and row, else null
  const float* msup;
  int64_t nb;
};

#if defined(__AVX512VNNI__)
inline __m512 u8_to_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 i8_to_ps(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <typename S> inline __m512 load16(const S* p);
template <> inline __m512 load16<uint16_t>(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 e8m0 bytes -> 2^(e - 128) each (e8m0_half's bits: (e - 1) << 23, subnormals 0x00200000 << e below 2)
template <> inline __m512 load16<E8M0>(const E8M0* p) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
  const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
  const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, tiny));
}

// 4-bit codes (one per byte) -> their kMXFP4U values where HB is LUT4; other codes as they are.
template <int HB>
inline __m512i table_codes(__m512i codes) {
  if constexpr (HB != LUT4) return codes;
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMXFP4U));
  return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(t), codes);
}

// Bit (2c + h) of each byte of `plane`, moved to bit `to`, OR-ed into `codes`.
template <int FROM, int TO>
inline __m512i add_bit(__m512i codes, __m512i plane) {
  const __m512i moved = FROM > TO ? _mm512_srli_epi16(plane, FROM - TO) : _mm512_slli_epi16(plane, TO - FROM);
  return _mm512_ternarylogic_epi32(codes, moved, _mm512_set1_epi8(static_cast<char>(1 << TO)), 0xF8);  // a | (b & c)
}

template <int HB, int C, int H>
inline __m512i with_high_bits(__m512i codes, const __m512i* planes) {
  if constexpr (HB >= 1) codes = add_bit<2 * C + H, 4>(codes, planes[0]);
  if constexpr (HB >= 2) codes = add_bit<2 * C + H, 5>(codes, planes[1]);
  return codes;
}

// The 8 code vectors of panel block pb (chunk C, half H at 2C + H), bit planes included.
template <int HB>
inline void block_codes(const GPanel& w, int64_t pb, __m512i* codes) {
  const uint8_t* lo = w.lo + pb * 256;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i planes[2];
  for (int h = 0; h < HB; ++h) planes[h] = _mm512_loadu_si512(w.hi + pb * 64 * HB + 64 * h);
#define TOKENLOOM_CHUNK(C)                                                                               \
  {                                                                                                      \
    const __m512i v = _mm512_loadu_si512(lo + C * 64);                                                   \
    codes[2 * C] = table_codes<HB>(with_high_bits<HB, C, 0>(_mm512_and_si512(v, low), planes));          \
    codes[2 * C + 1] =                                                                                   \
        table_codes<HB>(with_high_bits<HB, C, 1>(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), planes)); \
  }
  TOKENLOOM_CHUNK(0) TOKENLOOM_CHUNK(1) TOKENLOOM_CHUNK(2) TOKENLOOM_CHUNK(3)
#undef TOKENLOOM_CHUNK
}

// One activation row's block (32 int8 codes at xb) against a panel block's codes: the exact
// int32 dot products of values 0-15 (d[0] + d[1]) and 16-31 (d[2] + d[3]) for the 16 rows.
inline void block_dots(const __m512i* codes, const int32_t* xb, __m512i* d) {
  for (int i = 0; i < 4; ++i) {
    const int c = i + (i & 2);                       // chunks 0-1 -> d[0], d[1]; chunks 2-3 -> d[2], d[3]
    d[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[c], _mm512_set1_epi32(xb[c]));
    d[i] = _mm512_dpbusd_epi32(d[i], codes[c + 2], _mm512_set1_epi32(xb[c + 2]));
  }
}

// Panel block pb's weight scales for its 16 rows (s[0]; per-16: s[0] values 0-15, s[1] 16-31)
// and offsets (o), as float: stored (S), or a K-quant's sub-scales times its super-block factor.
template <bool PER16, bool OFFS, bool KS, typename S>
inline void block_scales(const GPanel& w, int64_t pb, __m512* s, __m512& o) {
  if constexpr (KS) {
    const int64_t sb = (pb >> 3) * 16;                 // nb % 8 == 0: (p, b / 8) of (P, nb / 8)
    const __m512 dsup = _mm512_loadu_ps(w.dsup + sb);
    if constexpr (PER16) {
      const int8_t* sc = static_cast<const int8_t*>(w.scale) + pb * 32;
      s[0] = _mm512_mul_ps(dsup, i8_to_ps(sc));
      s[1] = _mm512_mul_ps(dsup, i8_to_ps(sc + 16));
    } else {
      s[0] = _mm512_mul_ps(dsup, u8_to_ps(static_cast<const uint8_t*>(w.scale) + pb * 16));
    }
    if constexpr (OFFS)
      o = _mm512_mul_ps(_mm512_loadu_ps(w.msup + sb), u8_to_ps(static_cast<const uint8_t*>(w.offset) + pb * 16));
  } else {
    s[0] = load16(static_cast<const S*>(w.scale) + pb * 16);
    if constexpr (OFFS) o = load16(static_cast<const S*>(w.offset) + pb * 16);
  }
}

// acc (+ off) += panel block pb's dot products d (block_dots) in float: minus Z x the codes'
// sums, times weight scale x activation scale (per 16 or per 32 values), offsets times the
// activation sums. The one place this arithmetic is written: every path gives the same bits.
template <int Z, bool PER16, bool OFFS>
inline void add_block(const __m512* s, __m512 o, const Acts& a, int64_t xi, const __m512i* d, __m512& acc,
                      __m512& off) {
  const __m512 xs = _mm512_set1_ps(a.scale[xi]);
  const int32_t* is = a.isum16 + 2 * xi;
  if constexpr (PER16) {
    const __m512i da = _mm512_sub_epi32(_mm512_add_epi32(d[0], d[1]), _mm512_set1_epi32(Z * is[0]));
    const __m512i db = _mm512_sub_epi32(_mm512_add_epi32(d[2], d[3]), _mm512_set1_epi32(Z * is[1]));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(da), _mm512_mul_ps(xs, s[0]), acc);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(db), _mm512_mul_ps(xs, s[1]), acc);
  } else {
    const __m512i dd = _mm512_sub_epi32(_mm512_add_epi32(_mm512_add_epi32(d[0], d[1]), _mm512_add_epi32(d[2], d[3])),
                                        _mm512_set1_epi32(Z * (is[0] + is[1])));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dd), _mm512_mul_ps(xs, s[0]), acc);
    if constexpr (OFFS) {
      const __m512 xsum = _mm512_set1_ps(a.sum16[2 * xi] + a.sum16[2 * xi + 1]);
      off = _mm512_fmadd_ps(o, xsum, off);
    }
  }
}

// y[16 j dist + n] for NZ panels first, first + dist, ... and activation row m (decode): the
// panels' weight streams side by side, fetched ahead in software where PF (decode_walk()).
template <int NZ, int HB, int Z, bool PER16, bool OFFS, bool KS, typename S, bool PF>
void gpanel_row(const GPanel& w, int64_t first, int64_t dist, const Acts& a, int64_t m, float* y) {
  const int64_t nb = w.nb;
  __m512 acc[NZ], off[NZ];
  for (int j = 0; j < NZ; ++j) acc[j] = off[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t xi = m * nb + b;
    const int32_t* xb = reinterpret_cast<const int32_t*>(a.q + m * a.K + b * QK);
    for (int j = 0; j < NZ; ++j) {
      const int64_t pb = (first + j * dist) * nb + b;   // this panel's block index
      const char* ahead = reinterpret_cast<const char*>(w.lo + pb * 256 + 1024);      // 4 blocks on
      if constexpr (PF) for (int c = 0; c < 4; ++c) _mm_prefetch(ahead + 64 * c, _MM_HINT_T0);
      if constexpr (PF && HB > 0) _mm_prefetch(reinterpret_cast<const char*>(w.hi + pb * 64 * HB + 1024), _MM_HINT_T0);
      __m512i codes[8], d[4];
      __m512 s[2], o;
      block_codes<HB>(w, pb, codes);
      block_dots(codes, xb, d);
      block_scales<PER16, OFFS, KS, S>(w, pb, s, o);
      add_block<Z, PER16, OFFS>(s, o, a, xi, d, acc[j], off[j]);
    }
  }
  for (int j = 0; j < NZ; ++j) _mm512_storeu_ps(y + 16 * j * dist, OFFS ? _mm512_add_ps(acc[j], off[j]) : acc[j]);
}

// MR activation rows from m0 against one panel p, each block's codes decoded once for all MR
// rows (prefill and batched decode). The same block_dots and add_block as gpanel_row: a row's
// result does not depend on M (tested).
template <int MR, int HB, int Z, bool PER16, bool OFFS, bool KS, typename S>
void gpanel_rows(const GPanel& w, int64_t p, const Acts& a, int64_t m0, float* out, int64_t ldo) {
  const int64_t nb = w.nb;
  __m512 acc[MR], off[MR];
  for (int r = 0; r < MR; ++r) acc[r] = off[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t pb = p * nb + b;
    __m512i codes[8];
    __m512 s[2], o;
    block_codes<HB>(w, pb, codes);
    block_scales<PER16, OFFS, KS, S>(w, pb, s, o);
    for (int r = 0; r < MR; ++r) {
      __m512i d[4];
      block_dots(codes, reinterpret_cast<const int32_t*>(a.q + (m0 + r) * a.K + b * QK), d);
      add_block<Z, PER16, OFFS>(s, o, a, (m0 + r) * nb + b, d, acc[r], off[r]);
    }
  }
  for (int r = 0; r < MR; ++r)
    _mm512_storeu_ps(out + (m0 + r) * ldo + p * 16, OFFS ? _mm512_add_ps(acc[r], off[r]) : acc[r]);
}

#else
// The AVX2 build: the same arithmetic on each panel's two halves of 8 rows (bytes 0-31 and
// 32-63 of every 64-byte chunk and plane), 8 lanes at a time. maddubs multiplies the unsigned
// codes by the activations into int16 pairs of at most 2 x (2^(4 + HB) - 1) x 127: four code
// vectors' pairs add up in int16 without saturating (two for Q6_K's 6-bit codes) before madd
// widens them, so each half's dot products are the exact int32 values dpbusd gives.
inline __m256 u8_to_ps8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 i8_to_ps8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 half_to_ps8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 8 per-32 scales: float16 bits, or e8m0 bytes as 2^(e - 128) (load16<E8M0>'s arithmetic).
template <typename S> inline __m256 load8(const S* p);
template <> inline __m256 load8<uint16_t>(const uint16_t* p) { return half_to_ps8(p); }
template <> inline __m256 load8<E8M0>(const E8M0* p) {
  const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
  const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, small));
}

// Bit FROM of each byte of `plane`, moved to bit TO and OR-ed into `codes` (FROM, TO < 8, so
// the 16-bit shift never carries a bit across bytes into the one kept).
template <int FROM, int TO>
inline __m256i add_bit8(__m256i codes, __m256i plane) {
  const __m256i moved = FROM > TO ? _mm256_srli_epi16(plane, FROM - TO) : _mm256_slli_epi16(plane, TO - FROM);
  return _mm256_or_si256(codes, _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(1 << TO))));
}

// Half hf of panel block pb: code vector 2C + H (values 8C + 4H .. + 3 of each of 8 rows), bit
// planes included.
template <int HB>
struct HalfCodes {
  const uint8_t* lo;
  __m256i planes[2];
  HalfCodes(const GPanel& w, int64_t pb, int hf) : lo(w.lo + pb * 256 + hf * 32) {
    for (int j = 0; j < HB; ++j) planes[j] = load32(w.hi + (pb * HB + j) * 64 + hf * 32);
  }
  template <int C, int H>
  inline __m256i get() const {
    const __m256i v = load32(lo + C * 64);
    __m256i codes = _mm256_and_si256(H ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    if constexpr (HB == LUT4) codes = lookup(kMXFP4U, codes);
    if constexpr (HB >= 1) codes = add_bit8<2 * C + H, 4>(codes, planes[0]);
    if constexpr (HB >= 2) codes = add_bit8<2 * C + H, 5>(codes, planes[1]);
    return codes;
  }
};

// The exact int32 dot products of one activation block (xb) with 8 rows' codes (code<C, H>()):
// values 0-15 into lo16, 16-31 into hi16 (code vectors 0-3 and 4-7).
template <int HB, typename Codes>
inline void half_dots(const Codes& code, const int32_t* xb, __m256i& lo16, __m256i& hi16) {
  constexpr int RUN = HB == 2 ? 2 : 4;   // code vectors whose maddubs pairs add up in int16
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i d[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, run = _mm256_setzero_si256();
  auto take = [&](int v, __m256i codes) {           // v: code vector 2C + H, in order 0..7
    const __m256i p = _mm256_maddubs_epi16(codes, _mm256_set1_epi32(xb[v]));
    run = v % RUN ? _mm256_add_epi16(run, p) : p;
    if (v % RUN == RUN - 1) d[v / 4] = _mm256_add_epi32(d[v / 4], _mm256_madd_epi16(run, ones));
  };
  take(0, code.template get<0, 0>()); take(1, code.template get<0, 1>());
  take(2, code.template get<1, 0>()); take(3, code.template get<1, 1>());
  take(4, code.template get<2, 0>()); take(5, code.template get<2, 1>());
  take(6, code.template get<3, 0>()); take(7, code.template get<3, 1>());
  lo16 = d[0];
  hi16 = d[1];
}

// Half hf of panel block pb's weight scales (s[0]; per-16: s[1] for values 16-31) and offsets.
template <bool PER16, bool OFFS, bool KS, typename S>
inline void half_scales(const GPanel& w, int64_t pb, int hf, __m256* s, __m256& o) {
  if constexpr (KS) {
    const int64_t sb = (pb >> 3) * 16 + hf * 8;
    const __m256 dsup = _mm256_loadu_ps(w.dsup + sb);
    if constexpr (PER16) {
      const int8_t* sc = static_cast<const int8_t*>(w.scale) + pb * 32 + hf * 8;
      s[0] = _mm256_mul_ps(dsup, i8_to_ps8(sc));
      s[1] = _mm256_mul_ps(dsup, i8_to_ps8(sc + 16));
    } else {
      s[0] = _mm256_mul_ps(dsup, u8_to_ps8(static_cast<const uint8_t*>(w.scale) + pb * 16 + hf * 8));
    }
    if constexpr (OFFS)
      o = _mm256_mul_ps(_mm256_loadu_ps(w.msup + sb), u8_to_ps8(static_cast<const uint8_t*>(w.offset) + pb * 16 + hf * 8));
  } else {
    s[0] = load8(static_cast<const S*>(w.scale) + pb * 16 + hf * 8);
    if constexpr (OFFS) o = load8(static_cast<const S*>(w.offset) + pb * 16 + hf * 8);
  }
}

// add_block's arithmetic for 8 rows: the same float operations, lane for lane.
template <int Z, bool PER16, bool OFFS>
inline void add_half(const __m256* s, __m256 o, const Acts& a, int64_t xi, __m256i lo16, __m256i hi16, __m256& acc,
                     __m256& off) {
  const __m256 xs = _mm256_set1_ps(a.scale[xi]);
  const int32_t* is = a.isum16 + 2 * xi;
  if constexpr (PER16) {
    const __m256i da = _mm256_sub_epi32(lo16, _mm256_set1_epi32(Z * is[0]));
    const __m256i db = _mm256_sub_epi32(hi16, _mm256_set1_epi32(Z * is[1]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(da), _mm256_mul_ps(xs, s[0]), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(db), _mm256_mul_ps(xs, s[1]), acc);
  } else {
    const __m256i dd = _mm256_sub_epi32(_mm256_add_epi32(lo16, hi16), _mm256_set1_epi32(Z * (is[0] + is[1])));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dd), _mm256_mul_ps(xs, s[0]), acc);
    if constexpr (OFFS) off = _mm256_fmadd_ps(o, _mm256_set1_ps(a.sum16[2 * xi] + a.sum16[2 * xi + 1]), off);
  }
}

// gpanel_row for AVX2: NZ panels first, first + dist, ... against activation row m, a half at a time.
template <int NZ, int HB, int Z, bool PER16, bool OFFS, bool KS, typename S, bool PF>
void gpanel_row(const GPanel& w, int64_t first, int64_t dist, const Acts& a, int64_t m, float* y) {
  const int64_t nb = w.nb;
  __m256 acc[2 * NZ], off[2 * NZ];
  for (int h = 0; h < 2 * NZ; ++h) acc[h] = off[h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t xi = m * nb + b;
    const int32_t* xb = reinterpret_cast<const int32_t*>(a.q + m * a.K + b * QK);
    for (int j = 0; j < NZ; ++j) {
      const int64_t pb = (first + j * dist) * nb + b;
      const char* ahead = reinterpret_cast<const char*>(w.lo + pb * 256 + 1024);      // 4 blocks on
      if constexpr (PF) for (int c = 0; c < 4; ++c) _mm_prefetch(ahead + 64 * c, _MM_HINT_T0);
      if constexpr (PF && HB > 0) _mm_prefetch(reinterpret_cast<const char*>(w.hi + pb * 64 * HB + 1024), _MM_HINT_T0);
      for (int hf = 0; hf < 2; ++hf) {
        __m256i lo16, hi16;
        __m256 s[2], o;
        half_dots<HB>(HalfCodes<HB>(w, pb, hf), xb, lo16, hi16);
        half_scales<PER16, OFFS, KS, S>(w, pb, hf, s, o);
        add_half<Z, PER16, OFFS>(s, o, a, xi, lo16, hi16, acc[2 * j + hf], off[2 * j + hf]);
      }
    }
  }
  for (int h = 0; h < 2 * NZ; ++h)
    _mm256_storeu_ps(y + 16 * (h / 2) * dist + 8 * (h % 2), OFFS ? _mm256_add_ps(acc[h], off[h]) : acc[h]);
}

// Codes decoded once into registers (or L1) for several activation rows.
struct StoredCodes {
  __m256i v[8];
  template <int C, int H>
  inline __m256i get() const { return v[2 * C + H]; }
};

// gpanel_rows for AVX2: MR activation rows from m0 against panel p, each half's codes decoded
// once for the MR rows; the same half_dots and add_half as gpanel_row.
template <int MR, int HB, int Z, bool PER16, bool OFFS, bool KS, typename S>
void gpanel_rows(const GPanel& w, int64_t p, const Acts& a, int64_t m0, float* out, int64_t ldo) {
  const int64_t nb = w.nb;
  for (int hf = 0; hf < 2; ++hf) {
    __m256 acc[MR], off[MR];
    for (int r = 0; r < MR; ++r) acc[r] = off[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t pb = p * nb + b;
      const HalfCodes<HB> half(w, pb, hf);
      const StoredCodes codes{{half.template get<0, 0>(), half.template get<0, 1>(), half.template get<1, 0>(),
                               half.template get<1, 1>(), half.template get<2, 0>(), half.template get<2, 1>(),
                               half.template get<3, 0>(), half.template get<3, 1>()}};
      __m256 s[2], o;
      half_scales<PER16, OFFS, KS, S>(w, pb, hf, s, o);
      for (int r = 0; r < MR; ++r) {
        __m256i lo16, hi16;
        half_dots<HB>(codes, reinterpret_cast<const int32_t*>(a.q + (m0 + r) * a.K + b * QK), lo16, hi16);
        add_half<Z, PER16, OFFS>(s, o, a, (m0 + r) * nb + b, lo16, hi16, acc[r], off[r]);
      }
    }
    for (int r = 0; r < MR; ++r)
      _mm256_storeu_ps(out + (m0 + r) * ldo + p * 16 + hf * 8, OFFS ? _mm256_add_ps(acc[r], off[r]) : acc[r]);
  }
}
#endif

// Activation rows per gpanel_rows pass: each panel block's codes are decoded once per pass.
// AVX2 (codes decoded per half, 8 registers; accumulators in L1): 8 rows, decoding is a quarter
// of a 4-row pass's work there. AVX-512: 4.
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kRowsPerPass = 4;
#else
constexpr int kRowsPerPass = 8;
#endif

// Panels [p0, p1) of one weight against activation row m (decode): two panels' weight streams
// side by side, fetched ahead in software where the walk is ADJACENT (decode_walk()).
using DecodeRange = void (*)(const GPanel&, const Acts&, int64_t, int64_t, int64_t, float*);

template <int HB, int Z, bool PER16, bool OFFS, bool KS, typename S>
void gpanel_decode_range(const GPanel& w, const Acts& a, int64_t m, int64_t p0, int64_t p1, float* out) {
  using Row = void (*)(const GPanel&, int64_t, int64_t, const Acts&, int64_t, float*);
  constexpr Row rows[2][3] = {{nullptr, gpanel_row<1, HB, Z, PER16, OFFS, KS, S, false>,
                               gpanel_row<2, HB, Z, PER16, OFFS, KS, S, false>},
                              {nullptr, gpanel_row<1, HB, Z, PER16, OFFS, KS, S, true>,
                               gpanel_row<2, HB, Z, PER16, OFFS, KS, S, true>}};
  const tokenloom_int8::DecodeWalk walk = tokenloom_int8::decode_walk();
  const bool prefetch = walk == tokenloom_int8::DecodeWalk::ADJACENT;
  tokenloom_int8::walk_panels(walk, p0, p1, [&](int64_t p, int64_t dist, int count) {
    rows[prefetch][count](w, p, dist, a, m, out + p * 16);
  });
}

template <int HB, int Z, bool PER16, bool OFFS, bool KS, typename S>
void gpanel_matmul(const GPanel& w, const Acts& a, int64_t M, int64_t P, float* out, int64_t ldo) {
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(1, (P + threads - 1) / threads);
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    if (M == 1) {                                   // decode
      gpanel_decode_range<HB, Z, PER16, OFFS, KS, S>(w, a, 0, p0, p1, out);
      return;
    }
    for (int64_t p = p0; p < p1; ++p) {             // each block decoded once per pass of rows
      int64_t m = 0;
      for (; m + kRowsPerPass <= M; m += kRowsPerPass)
        gpanel_rows<kRowsPerPass, HB, Z, PER16, OFFS, KS, S>(w, p, a, m, out, ldo);
      if (kRowsPerPass > 4 && m + 4 <= M) {
        gpanel_rows<4, HB, Z, PER16, OFFS, KS, S>(w, p, a, m, out, ldo);
        m += 4;
      }
      switch (M - m) {
        case 3: gpanel_rows<3, HB, Z, PER16, OFFS, KS, S>(w, p, a, m, out, ldo); break;
        case 2: gpanel_rows<2, HB, Z, PER16, OFFS, KS, S>(w, p, a, m, out, ldo); break;
        case 1: gpanel_rows<1, HB, Z, PER16, OFFS, KS, S>(w, p, a, m, out, ldo); break;
        default: break;
      }
    }
  });
}

// The panel tensors of one weight of GGUF type `type` and width K, checked, as a GPanel.
GPanel checked_panel(int64_t K, int64_t type, const at::Tensor& lo, const c10::optional<at::Tensor>& hi,
                     const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
                     const c10::optional<at::Tensor>& dsup, const c10::optional<at::Tensor>& msup) {
  TORCH_CHECK(lo.scalar_type() == at::kByte && lo.is_contiguous() && lo.dim() == 4 && lo.size(1) == K / QK &&
              lo.size(2) == 4 && lo.size(3) == 64, "lo must be (N/16, K/32, 4, 64) uint8");
  const int64_t P = lo.size(0), nb = K / QK;
  const int hb = type == Q6_K ? 2 : (type == Q5_0 || type == Q5_1 || type == Q5_K) ? 1 : 0;
  TORCH_CHECK(hb == 0 || (hi && hi->is_contiguous() && hi->numel() == P * nb * hb * 64), "high-bit planes missing");
  const bool kq = type == Q4_K || type == Q5_K || type == Q6_K, per16 = type == Q6_K;
  const at::ScalarType stype = type == MXFP4 ? at::kByte : !kq ? at::kHalf : per16 ? at::kChar : at::kByte;
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == P * nb * 16 * (per16 ? 2 : 1) && scale.scalar_type() == stype,
              "panel scales have the wrong shape or dtype");
  const bool offs = type == Q5_1 || type == Q4_K || type == Q5_K;
  TORCH_CHECK(!offs || (offset && offset->is_contiguous() && offset->sizes() == scale.sizes() &&
                        offset->scalar_type() == scale.scalar_type()), "panel offsets must be shaped like the scales");
  auto super_ok = [&](const c10::optional<at::Tensor>& t) {
    return t && t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == P * (nb / 8) * 16;
  };
  TORCH_CHECK(!kq || (nb % 8 == 0 && super_ok(dsup) && (!offs || super_ok(msup))),
              "K-quant panels need super-block factors (P, K/256, 16) float32");
  return GPanel{lo.data_ptr<uint8_t>(), hb ? hi->data_ptr<uint8_t>() : nullptr, scale.data_ptr(),
                offs ? offset->data_ptr() : nullptr, kq ? dsup->data_ptr<float>() : nullptr,
                kq && offs ? msup->data_ptr<float>() : nullptr, nb};
}

// out[:, col0 : col0 + 16 P] = x @ w.T for GGUF type `type` in the panel layout above.
void panel_matmul_into(at::Tensor out, int64_t col0, const at::Tensor& xq, int64_t K, int64_t type,
                       const at::Tensor& lo, const c10::optional<at::Tensor>& hi, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& offset, const c10::optional<at::Tensor>& dsup,
                       const c10::optional<at::Tensor>& msup) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1, "out must be (M, *) float32");
  const GPanel w = checked_panel(K, type, lo, hi, scale, offset, dsup, msup);
  const int64_t M = out.size(0), P = lo.size(0);
  TORCH_CHECK(col0 >= 0 && col0 + 16 * P <= out.size(1), "columns exceed out");
  const Acts a = view_acts(xq, M, K);
  float* y = out.data_ptr<float>() + col0;
  const int64_t ldo = out.stride(0);
  switch (type) {
    case Q5_0: gpanel_matmul<1, 16, false, false, false, uint16_t>(w, a, M, P, y, ldo); break;
    case Q5_1: gpanel_matmul<1, 0, false, true, false, uint16_t>(w, a, M, P, y, ldo); break;
    case Q4_K: gpanel_matmul<0, 0, false, true, true, uint8_t>(w, a, M, P, y, ldo); break;
    case Q5_K: gpanel_matmul<1, 0, false, true, true, uint8_t>(w, a, M, P, y, ldo); break;
    case Q6_K: gpanel_matmul<2, 32, true, false, true, int8_t>(w, a, M, P, y, ldo); break;
    case MXFP4: gpanel_matmul<LUT4, 12, false, false, false, E8M0>(w, a, M, P, y, ldo); break;
    default: TORCH_CHECK(false, "GGML type ", type, " has no panel kernel");
  }
}

DecodeRange decode_range_for(int64_t type) {
  switch (type) {
    case Q5_0: return gpanel_decode_range<1, 16, false, false, false, uint16_t>;
    case Q5_1: return gpanel_decode_range<1, 0, false, true, false, uint16_t>;
    case Q4_K: return gpanel_decode_range<0, 0, false, true, true, uint8_t>;
    case Q5_K: return gpanel_decode_range<1, 0, false, true, true, uint8_t>;
    case Q6_K: return gpanel_decode_range<2, 32, true, false, true, int8_t>;
    case MXFP4: return gpanel_decode_range<LUT4, 12, false, false, false, E8M0>;
    default: TORCH_CHECK(false, "GGML type ", type, " has no panel kernel");
  }
}

// Several weights' panels against one activation row each (row e of `a` for weight e; `same_row`:
// row 0 for all), in one parallel pass over all their panels: out[e] (16 P_e floats each,
// at out + e * ldo). Each panel's numbers are gpanel_matmul's for M == 1.
void panels_decode(const std::vector<GPanel>& ws, const std::vector<int64_t>& panels, DecodeRange run, const Acts& a,
                   bool same_row, float* out, int64_t ldo) {
  std::vector<int64_t> first(ws.size() + 1, 0);
  for (size_t e = 0; e < ws.size(); ++e) first[e + 1] = first[e] + panels[e];
  const int64_t total = first.back(), threads = at::get_num_threads();
  at::parallel_for(0, total, std::max<int64_t>(1, (total + threads - 1) / threads), [&](int64_t t0, int64_t t1) {
    for (size_t e = 0; e < ws.size(); ++e) {
      const int64_t p0 = std::max(t0, first[e]) - first[e], p1 = std::min(t1, first[e + 1]) - first[e];
      if (p0 < p1) run(ws[e], a, same_row ? 0 : static_cast<int64_t>(e), p0, p1, out + e * ldo);
    }
  });
}

// y (M, N/2) = silu(g) * u for g = y2[:, :N/2], u = y2[:, N/2:]: fused_cpu's silu_mul row by row.
at::Tensor silu_mul_rows(const at::Tensor& y2) {
  const int64_t M = y2.size(0), I = y2.size(1) / 2;
  at::Tensor y = at::empty({M, I}, y2.options());
  tokenloom_silu::silu_mul_rows(y2.data_ptr<float>(), y.data_ptr<float>(), M, I);
  return y;
}

// One call for a layer whose weight is one GGUF panel tensor: x (M, K) float32 -> (M, N) =
// x @ w.T + bias, or with `silu_mul` (a gated MLP's gate_up, N = 2I) -> (M, I) =
// silu(gate) * up. The same bits as quantize_activations, panel_matmul_into, the bias add
// and fused_cpu's silu_mul called one by one; it saves a decode step those Python calls.
at::Tensor panel_linear(const at::Tensor& x, int64_t type, const at::Tensor& lo, const c10::optional<at::Tensor>& hi,
                        const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
                        const c10::optional<at::Tensor>& dsup, const c10::optional<at::Tensor>& msup,
                        const c10::optional<at::Tensor>& bias, bool silu_mul) {
  const at::Tensor xq = quantize_activations(x);
  const int64_t M = x.size(0), N = lo.size(0) * 16;
  at::Tensor y = at::empty({M, N}, x.options());
  panel_matmul_into(y, 0, xq, x.size(1), type, lo, hi, scale, offset, dsup, msup);
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be (N,) float32");
    const float* b = bias->data_ptr<float>();
    float* yp = y.data_ptr<float>();
    for (int64_t r = 0; r < M; ++r)
      for (int64_t n = 0; n < N; ++n) yp[r * N + n] += b[n];
  }
  if (!silu_mul) return y;
  TORCH_CHECK(N % 2 == 0, "silu_mul needs an even number of outputs");
  return silu_mul_rows(y);
}


// One token through k experts of a gated MLP, each expert's gate_up (2I rows: gate, then up) and
// down (H rows of I) GGUF panel tensors, all of one type each: out (1, H) = sum over e, in the
// order given, of weights[e] * down_e(silu(gate_e x) * up_e x). The gate_ups run as one parallel
// pass over all their panels, then the downs as another: two passes instead of 2k kernel calls.
// Each expert's output has the bits panel_linear gives it; `experts`: 6 per expert, as
// panel_linear takes them (lo, hi, scale, offset, dsup, msup), gate_ups then downs.
at::Tensor panel_moe_token(const at::Tensor& x, int64_t type_gate_up, int64_t type_down,
                           const c10::List<c10::optional<at::Tensor>>& experts, const at::Tensor& weights) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "x must be one token (1, K)");
  const int64_t k = weights.numel(), K = x.size(1);
  TORCH_CHECK(k >= 1 && static_cast<int64_t>(experts.size()) == 12 * k, "six panel tensors per weight, two per expert");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous(), "weights must be (k,) float32");
  auto field = [&](int64_t i) -> c10::optional<at::Tensor> { return experts.get(i); };
  auto panel = [&](int64_t base, int64_t width, int64_t type) {
    return checked_panel(width, type, *field(base), field(base + 1), *field(base + 2), field(base + 3),
                         field(base + 4), field(base + 5));
  };
  std::vector<GPanel> gate_up, down;
  std::vector<int64_t> gu_panels, down_panels;
  for (int64_t e = 0; e < k; ++e) {
    gate_up.push_back(panel(6 * e, K, type_gate_up));
    gu_panels.push_back(field(6 * e)->size(0));
  }
  const int64_t rows2 = 16 * gu_panels[0], I = rows2 / 2;
  for (int64_t e = 0; e < k; ++e) {
    TORCH_CHECK(gu_panels[e] * 16 == rows2, "the experts' gate_ups differ in size");
    down.push_back(panel(6 * (k + e), I, type_down));
    down_panels.push_back(field(6 * (k + e))->size(0));
    TORCH_CHECK(down_panels[e] == down_panels[0], "the experts' downs differ in size");
  }
  const int64_t H = 16 * down_panels[0];
  const at::Tensor xq = quantize_activations(x);
  at::Tensor gu = at::empty({k, rows2}, x.options());
  panels_decode(gate_up, gu_panels, decode_range_for(type_gate_up), view_acts(xq, 1, K), true, gu.data_ptr<float>(),
                rows2);
  const at::Tensor act = silu_mul_rows(gu);  // (k, I)
  const at::Tensor aq = quantize_activations(act);
  at::Tensor ys = at::empty({k, H}, x.options());
  panels_decode(down, down_panels, decode_range_for(type_down), view_acts(aq, k, I), false, ys.data_ptr<float>(), H);
  at::Tensor out = at::empty({1, H}, x.options());
  const float *yp = ys.data_ptr<float>(), *wp = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) op[h] = yp[h] * wp[0];
  for (int64_t e = 1; e < k; ++e)
    for (int64_t h = 0; h < H; ++h) op[h] = std::fma(yp[e * H + h], wp[e], op[h]);
  return out;
}

}  // namespace

TORCH_LIBRARY(TOKENLOOM_GGML_LIBRARY, m) {
  m.def("quantize_activations(Tensor x) -> Tensor");
  m.def("matmul_into(Tensor(a!) out, int col0, Tensor xq, int K, Tensor w, int type) -> ()");
  m.def("dequantize(Tensor w, int type, int K) -> Tensor");
  m.def("panel_matmul_into(Tensor(a!) out, int col0, Tensor xq, int K, int type, Tensor lo, Tensor? hi, "
        "Tensor scale, Tensor? offset, Tensor? dsup, Tensor? msup) -> ()");
  m.def("panel_linear(Tensor x, int type, Tensor lo, Tensor? hi, Tensor scale, Tensor? offset, Tensor? dsup, "
        "Tensor? msup, Tensor? bias, bool silu_mul) -> Tensor");
  m.def("panel_moe_token(Tensor x, int type_gate_up, int type_down, Tensor?[] experts, Tensor weights) -> Tensor");
  m.def("relay_panels(Tensor raw, int type, int K, Tensor(a!) lo, Tensor(b!)? hi, Tensor(c!) scale, "
        "Tensor(d!)? offset, Tensor(e!)? dsup, Tensor(f!)? msup) -> ()");
  m.def("relay_exact_panels(Tensor raw, int type, int K, Tensor(a!) data, Tensor(b!) scales, Tensor(c!)? offsets, "
        "int panel_start) -> bool");
}

TORCH_LIBRARY_IMPL(TOKENLOOM_GGML_LIBRARY, CPU, m) {
  m.impl("quantize_activations", &quantize_activations);
  m.impl("matmul_into", &matmul_into);
  m.impl("dequantize", &dequantize);
  m.impl("panel_matmul_into", &panel_matmul_into);
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_moe_token", &panel_moe_token);
  m.impl("relay_panels", &tokenloom_relay::relay_panels);
  m.impl("relay_exact_panels", &tokenloom_exact::relay_exact_panels);
}
