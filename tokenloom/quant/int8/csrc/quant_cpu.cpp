// Weight-only quantized linear layers for x86 CPUs with AVX2 + FMA.
//
// Weights are stored in blocks of 32 along the input dimension K:
//   int8: q int8 (N, K),         w = q * scale[n, k / group]
//   int4: q uint8 (N, K/2),      w = q * scale[n, k / group] + offset[n, k / group], q in 0..15;
//         within each block of 32 values, byte j holds value j (low nibble) and j+16 (high),
//         the layout of GGUF's Q4_0/Q4_1 blocks.
// Activations are quantized on the fly to int8 per block of 32 (one float scale per block,
// like llama.cpp's Q8_0 dot products), so each block's dot product runs on integer
// multiply-adds (maddubs/madd) and is scaled once in float.
// OFFSET_SUMS: an offset (int4's min) multiplies the block's sum of *quantized* activations,
// as llama.cpp's q8_1 does, so the product's error is sum(w * (xq - x)) over the centred
// weights w = scale * q + offset; with the exact float sum it was sum(scale * q * (xq - x))
// over codes 0..15, which are not centred: SmolLM2 Q4_1 against float32, KL divergence 0.044
// with exact sums against llama.cpp's 0.006 (docs/BENCHMARKS.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>

#include "../../../kernels/include/int8_dot.h"
#include "../../../kernels/include/silu_mul_row.h"

namespace {

using tokenloom_int8::QK;
using tokenloom_int8::dot_signed;
using tokenloom_int8::dot_unsigned;
using tokenloom_int8::hsum;
using tokenloom_int8::nibbles_lo_hi;

// One allocation holds all four arrays (a decode step quantizes activations 100+ times).
struct QuantizedActivations {
  at::Tensor storage;
  int8_t* q;         // (M, K)
  float* scale;      // (M, K/32)
  float* sum;        // (M, K/32): sum of each block's quantized values (scale x code sum)
  int32_t* isum;     // (M, K/32): sum of each block's int8 codes
};

// x (M, K) float32 -> int8 per block of 32 with scale max|x|/127.
QuantizedActivations quantize_activations(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;   // K % 32 == 0: the float arrays stay aligned
  at::Tensor storage = at::empty({M * K + 3 * M * nb * 4}, x.options().dtype(at::kByte));
  uint8_t* base = storage.data_ptr<uint8_t>();
  float* scale = reinterpret_cast<float*>(base + M * K);
  QuantizedActivations a{storage, reinterpret_cast<int8_t*>(base), scale, scale + M * nb,
                         reinterpret_cast<int32_t*>(scale + 2 * M * nb)};
  const float* src = x.data_ptr<float>();
  int8_t* q = a.q;
  float* sum = a.sum;
  int32_t* isum = a.isum;
  at::parallel_for(0, M * nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int32_t halves[2];
      const float d = tokenloom_int8::quantize_block(src + b * QK, q + b * QK, halves);
      const int32_t codes = halves[0] + halves[1];
      isum[b] = codes;
      scale[b] = d;
      sum[b] = d * codes;   // the quantized values' sum, not s: see OFFSET_SUMS
    }
  });
  return a;
}

// x (M, K) -> (codes int8 (M, K), scales float32 (M, K/32), code sums int32 (M, K/32)): what the
// kernels multiply, exposed for tests of the quantization against a reference.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % QK == 0,
              "x must be a contiguous float32 (M, K) matrix, K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  const QuantizedActivations a = quantize_activations(x);
  const auto i32 = x.options().dtype(at::kInt);
  at::Tensor codes = at::from_blob(a.q, {M, K}, x.options().dtype(at::kChar)).clone();
  at::Tensor scales = at::from_blob(a.scale, {M, nb}, x.options()).clone();
  at::Tensor sums = at::from_blob(a.isum, {M, nb}, i32).clone();
  return {codes, scales, sums};
}

// Checks a panel-layout weight (quant/int8/panels.py) of `nb` blocks of 32 inputs a row and `chunks`
// 64-byte chunks a block (8: int8, 4: int4): qp (P, nb, chunks, 64) uint8, scale (P, K/group, 16)
// float16 and, for int4, offsets shaped like it. Returns the groups a row has (K/group).
int64_t check_panel_weight(const at::Tensor& qp, const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
                           int64_t group, int64_t nb, int64_t chunks) {
  TORCH_CHECK(qp.scalar_type() == at::kByte && qp.is_contiguous() && qp.dim() == 4 && qp.size(1) == nb &&
              qp.size(2) == chunks && qp.size(3) == 64, "panel weight must be (N/16, K/32, ", chunks, ", 64) uint8");
  const int64_t K = nb * QK;
  TORCH_CHECK(group % QK == 0 && K % group == 0, "group size must be a multiple of 32 dividing K");
  const int64_t P = qp.size(0), groups = K / group;
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.sizes() == at::IntArrayRef({P, groups, 16}),
              "panel scales must be (N/16, K/group, 16) float16");
  TORCH_CHECK(chunks == 8 || (offset && offset->sizes() == scale.sizes() && offset->is_contiguous() &&
                              offset->scalar_type() == at::kHalf), "int4 panel offsets must be shaped like the scales");
  return groups;
}

// Rows `index` (L,) int64 of a panel-layout weight (quant/int8/panels.py: qp (P, K/32, chunks, 64) uint8,
// chunks 8 for int8 (code + 128), 4 for int4 (two codes a byte); scale/offset (P, K/group, 16)
// float16) -> float32 (L, K): an embedding lookup reading only the picked rows' 4 bytes per
// chunk. QuantizedTensor.dequantize's arithmetic: code * scale, then + offset (int4); a code (at
// most 8 bits) times a float16 scale (11) is exact in float32, so a fused multiply-add gives
// the same bits too.
at::Tensor panel_rows(const at::Tensor& qp, const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
                      int64_t group, const at::Tensor& index) {
  TORCH_CHECK(qp.dim() == 4 && (qp.size(2) == 8 || qp.size(2) == 4), "panel weight must be (N/16, K/32, 8 or 4, 64) uint8");
  const int64_t P = qp.size(0), nb = qp.size(1), chunks = qp.size(2), K = nb * QK;
  const bool int4 = chunks == 4;
  const int64_t groups = check_panel_weight(qp, scale, offset, group, nb, chunks);
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, "index must be (L,) int64");
  const at::Tensor idx = index.contiguous();
  const int64_t L = idx.size(0), *rows = idx.data_ptr<int64_t>();
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(rows[l] >= 0 && rows[l] < P * 16, "index ", rows[l], " is out of range for ", P * 16, " rows");
  at::Tensor out = at::empty({L, K}, qp.options().dtype(at::kFloat));
  const uint8_t* q = qp.data_ptr<uint8_t>();
  const at::Half* s = scale.data_ptr<at::Half>();
  const at::Half* o = int4 ? offset->data_ptr<at::Half>() : nullptr;
  float* y = out.data_ptr<float>();
  for (int64_t l = 0; l < L; ++l) {
    const int64_t panel = rows[l] / 16, lane = rows[l] % 16;
    float* row = y + l * K;
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t c = 0; c < chunks; ++c) {
        const uint8_t* bytes = q + ((panel * nb + b) * chunks + c) * 64 + lane * 4;
        for (int64_t i = 0; i < 4; ++i) {
          if (!int4) {
            const int64_t k = QK * b + 4 * c + i;
            row[k] = static_cast<float>(static_cast<int>(bytes[i]) - 128) *
                     static_cast<float>(s[(panel * groups + k / group) * 16 + lane]);
            continue;
          }
          const int64_t k = QK * b + 8 * c + i;   // low nibble; the high one is k + 4
          const int64_t g = (panel * groups + k / group) * 16 + lane;
          const float sc = static_cast<float>(s[g]), off = static_cast<float>(o[g]);
          row[k] = static_cast<float>(bytes[i] & 0x0F) * sc + off;
          row[k + 4] = static_cast<float>(bytes[i] >> 4) * sc + off;
        }
      }
  }
  return out;
}

// The dot products (int8_dot.h) are built twice: for AVX2 (maddubs + madd) and, as library
// tokenloom_quant_vnni, for AVX-512 VNNI (one dpbusd); both give the same bits.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TOKENLOOM_QUANT_LIBRARY tokenloom_quant_vnni
#else
#define TOKENLOOM_QUANT_LIBRARY tokenloom_quant
#endif

struct Weights {
  const uint8_t* q;       // row-major, row_bytes per output row
  const float* scale;     // (N, groups)
  const float* offset;    // (N, groups) or nullptr (int8)
  int64_t row_bytes, groups, blocks_per_group;
};

struct Activations {       // raw views of QuantizedActivations
  const int8_t* q;
  const float* scale;
  const float* sum;
  int64_t K, nb;
};

#ifdef __AVX512VNNI__
constexpr int64_t PREFETCH_BYTES = 4096;  // one page ahead: the distance that measured fastest (docs/BENCHMARKS.md)
#else
constexpr int64_t PREFETCH_BYTES = 384;   // the distance that measured fastest on AVX2 (docs/BENCHMARKS.md)
#endif

template <bool INT4>
inline __m256i load_weight_block(const uint8_t* row, int64_t b) {
  if constexpr (INT4) {
    _mm_prefetch(reinterpret_cast<const char*>(row + b * (QK / 2) + PREFETCH_BYTES), _MM_HINT_T0);
    return nibbles_lo_hi(row + b * (QK / 2));
  } else {
    _mm_prefetch(reinterpret_cast<const char*>(row + b * QK + PREFETCH_BYTES), _MM_HINT_T0);
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * QK));
  }
}

// out[m][n] for an MT x NT tile: activation rows m0.., output rows n0..; one pass over K.
// Each weight block is loaded once for MT rows and each activation block once for NT rows;
// MT * NT independent accumulators keep the FMA pipeline busy. Within a weight group the
// block sums are scaled by the activation scales only; the weight scale (and for int4 the
// offset times the group's activation sum) is applied once per group.
template <int MT, int NT, bool INT4>
void dot_tile(const Weights& w, const Activations& a, int64_t m0, int64_t n0, float* out, int64_t N) {
  const int64_t K = a.K, nb = a.nb, bpg = w.blocks_per_group;
  __m256 acc[MT][NT];
  float acc_offset[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) { acc[m][j] = _mm256_setzero_ps(); acc_offset[m][j] = 0.f; }
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 gacc[MT][NT];
    float xsum[MT];
    for (int m = 0; m < MT; ++m) {
      xsum[m] = 0.f;
      for (int j = 0; j < NT; ++j) gacc[m][j] = _mm256_setzero_ps();
    }
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
      __m256i wv[NT];
      for (int j = 0; j < NT; ++j) wv[j] = load_weight_block<INT4>(w.q + (n0 + j) * w.row_bytes, b);
      for (int m = 0; m < MT; ++m) {
        const int64_t xi = (m0 + m) * nb + b;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (m0 + m) * K + b * QK));
        const __m256 xs = _mm256_set1_ps(a.scale[xi]);
        if constexpr (INT4) xsum[m] += a.sum[xi];
        for (int j = 0; j < NT; ++j) {
          const __m256i d = INT4 ? dot_unsigned(wv[j], xv) : dot_signed(wv[j], xv);
          gacc[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), xs, gacc[m][j]);
        }
      }
    }
    for (int j = 0; j < NT; ++j) {
      const int64_t wi = (n0 + j) * w.groups + g;
      const __m256 ws = _mm256_set1_ps(w.scale[wi]);
      for (int m = 0; m < MT; ++m) {
        acc[m][j] = _mm256_fmadd_ps(gacc[m][j], ws, acc[m][j]);
        if constexpr (INT4) acc_offset[m][j] += w.offset[wi] * xsum[m];
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) out[(m0 + m) * N + n0 + j] = hsum(acc[m][j]) + acc_offset[m][j];
}


void check_weights(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU matrix");
  TORCH_CHECK(x.size(1) % QK == 0, "in_features must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(group % QK == 0 && x.size(1) % group == 0, "group size must be a multiple of 32 dividing K");
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous() && scale.scalar_type() == at::kFloat,
              "quantized weight and scales must be contiguous, scales float32");
  TORCH_CHECK(scale.size(0) == q.size(0) && scale.size(1) == x.size(1) / group, "scales must be (N, K / group)");
}

template <bool INT4>
at::Tensor linear(const at::Tensor& x, const Weights& w, int64_t N, const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  const QuantizedActivations qa = quantize_activations(x);
  const Activations a{qa.q, qa.scale, qa.sum, K, K / QK};
  at::Tensor out = at::empty({M, N}, x.options());
  float* y = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    tokenloom_int8::tile_rows(M, n0, n1, [&](auto mt, auto nt, int64_t m, int64_t n) {
      dot_tile<decltype(mt)::value, decltype(nt)::value, INT4>(w, a, m, n, y, N);
    });
  });
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t group,
                       const c10::optional<at::Tensor>& bias) {
  check_weights(x, q, scale, group);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.size(1) == x.size(1), "int8 weight must be (N, K) int8");
  Weights w{reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()), scale.data_ptr<float>(), nullptr,
            q.size(1), scale.size(1), group / QK};
  return linear<false>(x, w, q.size(0), bias);
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const at::Tensor& offset, int64_t group, const c10::optional<at::Tensor>& bias) {
  check_weights(x, q, scale, group);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.size(1) * 2 == x.size(1), "int4 weight must be (N, K/2) uint8");
  TORCH_CHECK(offset.is_contiguous() && offset.sizes() == scale.sizes() && offset.scalar_type() == at::kFloat,
              "offsets must be float32 like the scales");
  Weights w{q.data_ptr<uint8_t>(), scale.data_ptr<float>(), offset.data_ptr<float>(),
            q.size(1), scale.size(1), group / QK};
  return linear<true>(x, w, q.size(0), bias);
}


// ---- 16-column panels ------------------------------------------------------------------------
// Weights re-laid once at load (quant/int8/panels.py) so that one 512-bit dpbusd multiplies 16
// output columns by 4 activations (the AVX2 build: two 256-bit halves of 8 columns, with
// maddubs + madd): per panel p (columns 16p..16p+15), block b (32 values of k), chunk c, the
// dword of column n holds
//   int4: qp (P, K/32, 4, 64) uint8, byte i = w[32b+8c+i] | w[32b+8c+4+i] << 4 (codes 0..15)
//   int8: qp (P, K/32, 8, 64) uint8, byte i = w[32b+4c+i] + 128 (codes biased to 0..254)
// with scales (and int4 offsets) as (P, groups, 16) float16 (an int4 block of 32 weights
// reads 20 bytes, not 24). Same codes and scale values as the row layout.
// Each column's block dot product is exact in int32, then scaled in float per block and per
// group; a row's result does not depend on the other rows in the call.
// At one row, 2 panels a pass with 1 KB prefetch measured faster than 4 with 4 KB, and both
// faster than the row kernels (docs/BENCHMARKS.md, 'Measurements behind design choices').
constexpr int PANELS = 2;      // panels per pass (their weight streams run side by side: walk_panels)
constexpr int64_t PANEL_PREFETCH_BYTES = 1024;

struct PanelWeights {
  const uint8_t* q;
  const uint16_t* scale;       // float16
  const uint16_t* offset;      // float16, int4 only
  int64_t nb, groups, bpg;     // blocks per row, groups per row, blocks per group
};

#if defined(__AVX512VNNI__)
inline __m512 load_halves(const uint16_t* p) {   // 16 float16 -> 16 float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// y[16 j dist + n] for NZ panels first, first + dist, ... and one activation row (codes xq,
// block scales xs, block sums xsum (float) and isum (codes)).
template <int NZ, bool INT4>
void panel_row(const PanelWeights& w, int64_t first, int64_t dist, const int8_t* xq, const float* xs,
               const float* xsum, const int32_t* isum, float* y, bool prefetch) {
  constexpr int64_t CHUNKS = INT4 ? 4 : 8, BLOCK_BYTES = CHUNKS * 64;
  const uint8_t* q0 = w.q + first * w.nb * BLOCK_BYTES;
  const int64_t pstride = dist * w.nb * BLOCK_BYTES, sstride = w.groups * 16;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[NZ], off[NZ];
  for (int j = 0; j < NZ; ++j) acc[j] = off[j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 gacc[NZ];
    for (int j = 0; j < NZ; ++j) gacc[j] = _mm512_setzero_ps();
    float gsum = 0.f;
    for (int64_t b = g * w.bpg; b < (g + 1) * w.bpg; ++b) {
      __m512i d0[NZ], d1[NZ];
      for (int j = 0; j < NZ; ++j) d0[j] = d1[j] = _mm512_setzero_si512();
      const int32_t* xb = reinterpret_cast<const int32_t*>(xq + b * QK);
      const uint8_t* qb = q0 + b * BLOCK_BYTES;
      if (prefetch)
        for (int j = 0; j < NZ; ++j)
          for (int64_t c = 0; c < CHUNKS; ++c)
            _mm_prefetch(reinterpret_cast<const char*>(qb + j * pstride + c * 64 + PANEL_PREFETCH_BYTES), _MM_HINT_T0);
      if constexpr (INT4) {
        for (int c = 0; c < 4; ++c) {
          const __m512i x0 = _mm512_set1_epi32(xb[2 * c]), x1 = _mm512_set1_epi32(xb[2 * c + 1]);
          for (int j = 0; j < NZ; ++j) {
            const __m512i v = _mm512_loadu_si512(qb + j * pstride + c * 64);
            d0[j] = _mm512_dpbusd_epi32(d0[j], _mm512_and_si512(v, low), x0);
            d1[j] = _mm512_dpbusd_epi32(d1[j], _mm512_and_si512(_mm512_srli_epi16(v, 4), low), x1);
          }
        }
      } else {
        for (int c = 0; c < 8; c += 2) {
          const __m512i x0 = _mm512_set1_epi32(xb[c]), x1 = _mm512_set1_epi32(xb[c + 1]);
          for (int j = 0; j < NZ; ++j) {
            d0[j] = _mm512_dpbusd_epi32(d0[j], _mm512_loadu_si512(qb + j * pstride + c * 64), x0);
            d1[j] = _mm512_dpbusd_epi32(d1[j], _mm512_loadu_si512(qb + j * pstride + (c + 1) * 64), x1);
          }
        }
      }
      const __m512 s = _mm512_set1_ps(xs[b]);
      const __m512i bias = _mm512_set1_epi32(INT4 ? 0 : 128 * isum[b]);   // int8: undo the +128
      for (int j = 0; j < NZ; ++j)
        gacc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(d0[j], d1[j]), bias)), s, gacc[j]);
      gsum += xsum[b];
    }
    const __m512 gs = _mm512_set1_ps(gsum);
    for (int j = 0; j < NZ; ++j) {
      acc[j] = _mm512_fmadd_ps(gacc[j], load_halves(w.scale + (first + j * dist) * sstride + g * 16), acc[j]);
      if constexpr (INT4)
        off[j] = _mm512_fmadd_ps(load_halves(w.offset + (first + j * dist) * sstride + g * 16), gs, off[j]);
    }
  }
  for (int j = 0; j < NZ; ++j) _mm512_storeu_ps(y + 16 * j * dist, INT4 ? _mm512_add_ps(acc[j], off[j]) : acc[j]);
}

#else
// The AVX2 build: panel_row's arithmetic on the two 8-column halves of each panel (bytes 0-31
// and 32-63 of a chunk). maddubs multiplies unsigned by signed bytes into int16 pairs:
//   int4: codes 0..15 are the unsigned side; a pair is at most 2 x 15 x 127, so a block's eight
//         maddubs (its 32 values) add up in int16 without saturating, then one madd to int32;
//   int8: the stored code + 128 cannot be (2 x 255 x 127 saturates), so the signed code (byte
//         ^ 0x80) takes the sign of the activation and |activation| is the unsigned side: exact
//         for codes -127..127 (panels.fits keeps -128 in the row layout).
// Each column's block dot product is the same int32 as dpbusd's (minus the +128 bias), scaled
// in float per block and per group as there: a row's result does not depend on the batch.
inline __m256 load_halves(const uint16_t* p) {   // 8 float16 -> 8 float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// One block's int32 dot products for NZ panels first, first + dist, ... as 2 NZ halves.
template <int NZ, bool INT4>
inline void panel_block_dots(const uint8_t* qb, int64_t pstride, const int32_t* xb, __m256i* d) {
  constexpr int H = 2 * NZ;
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (INT4) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i d16[H];
    for (int h = 0; h < H; ++h) d16[h] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i x0 = _mm256_set1_epi32(xb[2 * c]), x1 = _mm256_set1_epi32(xb[2 * c + 1]);
      for (int h = 0; h < H; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + (h / 2) * pstride + c * 64 + (h % 2) * 32));
        d16[h] = _mm256_add_epi16(d16[h], _mm256_add_epi16(
            _mm256_maddubs_epi16(_mm256_and_si256(v, low), x0),
            _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), x1)));
        asm("" : "+x"(d16[h]));   // a running chain in a register (see the int8 loop below)
      }
    }
    for (int h = 0; h < H; ++h) d[h] = _mm256_madd_epi16(d16[h], ones);
    return;
  }
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int h = 0; h < H; ++h) d[h] = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) {
    const __m256i x = _mm256_set1_epi32(xb[c]), ax = _mm256_sign_epi8(x, x);
    for (int h = 0; h < H; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + (h / 2) * pstride + c * 64 + (h % 2) * 32));
      const __m256i signed_w = _mm256_sign_epi8(_mm256_xor_si256(v, bias), x);
      d[h] = _mm256_add_epi32(d[h], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, signed_w), ones));
      // Without this GCC re-associates the eight chunks' sums into a tree whose partial sums
      // spill to the stack (16 ymm registers); the running chain stays in one register. The
      // int32 sum is exact, so the order does not change the bits. It reads from L2 markedly
      // faster (docs/BENCHMARKS.md, 'Measurements behind design choices').
      asm("" : "+x"(d[h]));
    }
  }
}

template <int NZ, bool INT4>
void panel_row(const PanelWeights& w, int64_t first, int64_t dist, const int8_t* xq, const float* xs,
               const float* xsum, const int32_t*, float* y, bool prefetch) {
  constexpr int64_t CHUNKS = INT4 ? 4 : 8, BLOCK_BYTES = CHUNKS * 64;
  constexpr int H = 2 * NZ;
  const uint8_t* q0 = w.q + first * w.nb * BLOCK_BYTES;
  const int64_t pstride = dist * w.nb * BLOCK_BYTES, sstride = w.groups * 16;
  __m256 acc[H], off[H];
  for (int h = 0; h < H; ++h) acc[h] = off[h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 gacc[H];
    for (int h = 0; h < H; ++h) gacc[h] = _mm256_setzero_ps();
    float gsum = 0.f;
    for (int64_t b = g * w.bpg; b < (g + 1) * w.bpg; ++b) {
      const uint8_t* qb = q0 + b * BLOCK_BYTES;
      if (prefetch)
        for (int j = 0; j < NZ; ++j)
          for (int64_t c = 0; c < CHUNKS; ++c)
            _mm_prefetch(reinterpret_cast<const char*>(qb + j * pstride + c * 64 + PANEL_PREFETCH_BYTES), _MM_HINT_T0);
      __m256i d[H];
      panel_block_dots<NZ, INT4>(qb, pstride, reinterpret_cast<const int32_t*>(xq + b * QK), d);
      const __m256 s = _mm256_set1_ps(xs[b]);
      for (int h = 0; h < H; ++h) gacc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[h]), s, gacc[h]);
      gsum += xsum[b];
    }
    const __m256 gs = _mm256_set1_ps(gsum);
    for (int h = 0; h < H; ++h) {
      const int64_t at = (first + (h / 2) * dist) * sstride + g * 16 + (h % 2) * 8;
      acc[h] = _mm256_fmadd_ps(gacc[h], load_halves(w.scale + at), acc[h]);
      if constexpr (INT4) off[h] = _mm256_fmadd_ps(load_halves(w.offset + at), gs, off[h]);
    }
  }
  for (int h = 0; h < H; ++h)
    _mm256_storeu_ps(y + 16 * (h / 2) * dist + 8 * (h % 2), INT4 ? _mm256_add_ps(acc[h], off[h]) : acc[h]);
}
#endif

template <bool INT4>
using PanelRowFn = void (*)(const PanelWeights&, int64_t, int64_t, const int8_t*, const float*, const float*,
                            const int32_t*, float*, bool);
template <bool INT4>
constexpr PanelRowFn<INT4> kPanelRow[PANELS + 1] = {nullptr, panel_row<1, INT4>, panel_row<2, INT4>};

// x (M, K) -> x @ w.T + bias (M, N), or with `silu_mul` (a gated MLP's gate_up, gate panels
// then up panels) silu(gate) * up (M, N/2): the same bits as fused_cpu's silu_mul after it.
template <bool INT4>
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& offset, int64_t group, const c10::optional<at::Tensor>& bias,
                        bool silu_mul) {
  constexpr int64_t CHUNKS = INT4 ? 4 : 8;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % QK == 0,
              "x must be a contiguous float32 (M, K) matrix, K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  const int64_t groups = check_panel_weight(qp, scale, offset, group, nb, CHUNKS), P = qp.size(0);
  const QuantizedActivations qa = quantize_activations(x);
  const auto halves = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); };
  const PanelWeights w{qp.data_ptr<uint8_t>(), halves(scale), INT4 ? halves(*offset) : nullptr, nb, groups, group / QK};
  const int8_t* xq = qa.q;
  const float *xs = qa.scale, *xsum = qa.sum;
  const int32_t* isum = qa.isum;
  at::Tensor out = at::empty({M, P * 16}, x.options());
  float* y = out.data_ptr<float>();
  const int64_t threads = at::get_num_threads();
  const int64_t grain = std::max<int64_t>(1, (P + threads - 1) / threads);
  const tokenloom_int8::DecodeWalk walk = tokenloom_int8::decode_walk();
  const bool adjacent = walk == tokenloom_int8::DecodeWalk::ADJACENT;   // software prefetch, on the first row
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    // each pair of panels computes every row while its weights stay in cache
    tokenloom_int8::walk_panels(walk, p0, p1, [&](int64_t p, int64_t dist, int count) {
      for (int64_t m = 0; m < M; ++m)
        kPanelRow<INT4>[count](w, p, dist, xq + m * K, xs + m * nb, xsum + m * nb, isum + m * nb,
                               y + m * P * 16 + p * 16, adjacent && m == 0);
    });
  });
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  if (!silu_mul) return out;
  TORCH_CHECK(P % 2 == 0, "silu_mul needs a gate_up weight of as many gate panels as up panels");
  at::Tensor gated = at::empty({M, P * 8}, x.options());
  tokenloom_silu::silu_mul_rows(y, gated.data_ptr<float>(), M, P * 8);
  return gated;
}

at::Tensor panel_linear_int8(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& scale, int64_t group,
                             const c10::optional<at::Tensor>& bias, bool silu_mul) {
  return panel_linear<false>(x, qp, scale, c10::nullopt, group, bias, silu_mul);
}

at::Tensor panel_linear_int4(const at::Tensor& x, const at::Tensor& qp, const at::Tensor& scale,
                             const at::Tensor& offset, int64_t group, const c10::optional<at::Tensor>& bias,
                             bool silu_mul) {
  return panel_linear<true>(x, qp, scale, offset, group, bias, silu_mul);
}

}  // namespace

TORCH_LIBRARY(TOKENLOOM_QUANT_LIBRARY, m) {
  m.def("linear_int8(Tensor x, Tensor q, Tensor scale, int group, Tensor? bias) -> Tensor");
  m.def("linear_int4(Tensor x, Tensor q, Tensor scale, Tensor offset, int group, Tensor? bias) -> Tensor");
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("panel_rows(Tensor qp, Tensor scale, Tensor? offset, int group, Tensor index) -> Tensor");
  m.def("panel_linear_int8(Tensor x, Tensor qp, Tensor scale, int group, Tensor? bias, bool silu_mul=False) -> Tensor");
  m.def("panel_linear_int4(Tensor x, Tensor qp, Tensor scale, Tensor offset, int group, Tensor? bias, "
        "bool silu_mul=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(TOKENLOOM_QUANT_LIBRARY, CPU, m) {
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_int4", &linear_int4);
  m.impl("quantize_rows", &quantize_rows);
  m.impl("panel_rows", &panel_rows);
  m.impl("panel_linear_int8", &panel_linear_int8);
  m.impl("panel_linear_int4", &panel_linear_int4);
}
