// Float32 linear layer y = x @ W^T (+ bias) for x86 CPUs, with W prepacked once into panels
// of 16 output columns: wp (P = ceil(N/16), K, 16), zero-padded past N.
//
// Built twice (tokenloom/layers/prepacked.py picks the fastest this CPU runs): for AVX-512,
// where a panel row is one zmm, and for AVX2, where it is two ymm (the `Vec` type below). The
// register blocks differ (32 zmm against 16 ymm), the arithmetic does not.
//
// Each panel row is loaded once per k and multiplied into a block of rows of x (AVX-512: all
// of them up to 14 rows, else 8 at a time against 3 panels; AVX2: up to 6 rows against 1
// panel, 1-2 rows against 2-6), so at decode sizes the weights stream from memory once while
// the FMA units work; while one group of panels is in use, the next group is fetched into L2.
// Every output element is summed over k = 0..K-1 in order by one fused multiply-add chain,
// whatever the number of rows, the blocking or the build: a row's result does not depend on
// which other rows share the call (batch-invariant bit for bit), and both builds give the same
// bits for a dense product.
//
// linear_silu_mul does a gated MLP's gate_up projection and silu(gate) * up in one pass: each
// micro call holds gate panels and the up panels that pair with them, and its epilogue
// writes the activation, so the (T, 2I) product is never stored (same bits as linear then
// fused_cpu's silu_mul of the same build, tested).
//
// Where it stands against oneDNN's prepacked linear and how each piece below was chosen
// (interleaved A/B timings) is recorded in docs/BENCHMARKS.md.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <utility>

#include "../../kernels/include/silu_mul_row.h"

#if defined(__AVX512F__)
#define TOKENLOOM_PANEL_LIBRARY tokenloom_panel_avx512
#else
#define TOKENLOOM_PANEL_LIBRARY tokenloom_panel_avx2
#endif

namespace {

constexpr int64_t NP = 16;     // output columns per panel (one zmm, two ymm)
constexpr int64_t AHEAD = 64;  // k steps between fetching a panel row and loading it (4 KiB)
constexpr int64_t CHUNK = 6;   // panels a row-block sweep covers while they sit in L2
constexpr int64_t ROWS_IN_CACHE = 512;  // rows of x swept per pass over a thread's panels (x stays in L2)

// Sixteen floats: one panel row, one output piece. Only what the kernel needs. silu goes
// through libtorch_cpu's SLEEF exp, the one ATen's silu uses (AVX2: silu_mul_row.h's silu8).
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10avx512f(__m512);
struct Vec {
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec all(float a) { return {_mm512_set1_ps(a)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static __mmask16 mask(int64_t n) { return n >= NP ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
  static Vec load_first(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(mask(n), p)}; }
  void store_first(float* p, int64_t n) const { _mm512_mask_storeu_ps(p, mask(n), v); }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  // silu(g) = g / (1 + exp(-g)), as fused_cpu.cpp's silu_mul
  friend Vec silu(Vec g) {
    const __m512 e = Sleef_expf16_u10avx512f(_mm512_sub_ps(_mm512_setzero_ps(), g.v));
    return {_mm512_div_ps(g.v, _mm512_add_ps(_mm512_set1_ps(1.f), e))};
  }
};
#else
struct Vec {
  __m256 lo, hi;
  static Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec all(float a) { const __m256 b = _mm256_set1_ps(a); return {b, b}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static __m256i mask8(int64_t n) {   // lanes [0, n) of 8
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::clamp<int64_t>(n, 0, 8))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Vec load_first(const float* p, int64_t n) {
    if (n >= NP) return load(p);
    return {_mm256_maskload_ps(p, mask8(n)), _mm256_maskload_ps(p + 8, mask8(n - 8))};
  }
  void store_first(float* p, int64_t n) const {
    if (n >= NP) {
      _mm256_storeu_ps(p, lo);
      _mm256_storeu_ps(p + 8, hi);
      return;
    }
    _mm256_maskstore_ps(p, mask8(n), lo);
    _mm256_maskstore_ps(p + 8, mask8(n - 8), hi);
  }
  friend Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  friend Vec silu(Vec g) { return {tokenloom_silu::silu8(g.lo), tokenloom_silu::silu8(g.hi)}; }
};
#endif

// (N, K) -> (P, K, 16)
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "panel pack: float32 (N, K) weight");
  const int64_t N = w.size(0), K = w.size(1), P = (N + NP - 1) / NP;
  auto panels = at::zeros({P, K, NP}, w.options());  // one copy of the weight, no padded temporary
  const int64_t full = N / NP;
  if (full > 0) panels.narrow(0, 0, full).copy_(w.narrow(0, 0, full * NP).view({full, NP, K}).transpose(1, 2));
  if (N > full * NP) panels.select(0, full).narrow(1, 0, N - full * NP).copy_(w.narrow(0, full * NP, N - full * NP).t());
  return panels;
}

// What a row block fetches into L2 besides its loads. AHEAD_PF (a template flag of the micro
// kernel): its own panels, AHEAD k steps (one 4 KiB page per panel) before it loads them. The
// first row block of a sweep reads its panels from DRAM; the hardware prefetchers keep only a
// few lines of each panel stream in flight, so with 2-3 streams per core a decode-sized call
// waited on DRAM, then did its FMAs; fetching ahead overlaps the two.
// Then (this struct) the cache lines of the next sweep's panels, fetched into L2 while the later
// row blocks compute from the current ones (which the first row block brought in): DRAM and
// FMAs overlap. Up to two ranges (a gated MLP's gate and up panels), issued once per unrolled
// group of k steps, `per16` lines per 16 k steps: as many as spread all lines over the sweep's
// later blocks, at most 4 (one line per 4 k steps; faster rates were slower at 16-48 rows).
// A fixed rate keeps the branch predictable: spreading the lines one by one over all blocks
// (Bresenham-style) mispredicted about once per fetch and slowed every block, which ate the
// gain above 160 rows (docs/BENCHMARKS.md, 'Measurements behind design choices'). The rate is
// computed once per sweep.
struct Prefetch {
  const char* next[2] = {nullptr, nullptr};  // next line to fetch per range
  int64_t left[2] = {0, 0};                  // lines still to fetch per range
  int64_t per16 = 1;                         // lines per 16 k steps (1-4)
  bool active = false;                       // lines are left (tested once per group of k steps)

  // Once per group of G k steps (G = 4 or 16).
  template <int64_t G>
  inline void group() {
    const int64_t lines = G >= 16 ? per16 * (G / 16) : (per16 * G + 15) / 16;
    for (int64_t i = 0; i < lines; ++i) {
      const int r = left[0] > 0 ? 0 : 1;
      if (left[r] <= 0) break;
      _mm_prefetch(next[r], _MM_HINT_T1);
      next[r] += 64;
      --left[r];
    }
    active = left[0] + left[1] > 0;
  }
};

// k steps per unrolled group of the micro kernel: 4 for the block that fetches its own panels
// ahead (a sweep's first block; every decode-sized call is one such block), 16 for the rest.
// A k loop of one step per iteration with the fetch flags tested in it kept ~10 integer and
// flag instructions next to the FMAs and spilled pointers into vector registers (each move
// back took an FMA port); unrolled groups keep the loop to FMAs and loads.
template <bool AHEAD_PF>
constexpr int64_t kGroup = AHEAD_PF ? 4 : 16;

// The two kinds of output. Dense: y = x W^T + b, NZ panels per call. Glu (a gated MLP's
// gate_up weight, gate panels then up panels): y = silu(gate) * up, NZ/2 gate panels and the
// NZ/2 up panels that pair with them, so the (T, 2I) product never reaches memory.
enum class Kind { Dense, Glu };

// y rows [0, MR) x output columns [0, outputs*16) (clipped to ncols) of one row block.
// x: the block's first row (row stride K); wp: its first panel; up: offset of the up panels.
template <int MR, int NZ, Kind KIND, bool AHEAD_PF>
inline void micro(const float* x, const float* wp, int64_t up, int64_t K, float* y, int64_t ldy, int64_t ncols,
                  const float* bias, int64_t bias_up, Prefetch& pf) {
  constexpr int OUT = KIND == Kind::Glu ? NZ / 2 : NZ;   // output panels
  const int64_t pstride = K * NP;
  const float* w0[NZ];
  for (int j = 0; j < NZ; ++j) w0[j] = j < OUT ? wp + j * pstride : wp + up + (j - OUT) * pstride;
  Vec acc[MR][NZ];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NZ; ++j) acc[m][j] = Vec::zero();
  // One k step: NZ panel rows loaded once, each multiplied into MR broadcast x values.
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    Vec w[NZ];
    for (int j = 0; j < NZ; ++j) w[j] = Vec::load(w0[j] + k * NP);
    if constexpr (AHEAD_PF) {
      for (int j = 0; j < NZ; ++j) _mm_prefetch(reinterpret_cast<const char*>(w0[j] + (k + AHEAD) * NP), _MM_HINT_T1);
    }
    for (int m = 0; m < MR; ++m) {
      const Vec xb = Vec::all(x[m * K + k]);
      for (int j = 0; j < NZ; ++j) acc[m][j] = fma(xb, w[j], acc[m][j]);
    }
  };
  constexpr int64_t G = kGroup<AHEAD_PF>;
  int64_t k = 0;
  for (; k + G <= K; k += G) {
    if (pf.active) pf.group<G>();
#pragma GCC unroll 16
    for (int64_t u = 0; u < G; ++u) step(k + u);
  }
  for (; k < K; ++k) step(k);
  for (int j = 0; j < OUT; ++j) {
    const int64_t c = ncols - j * NP;
    if (c <= 0) break;
    const Vec b = bias ? Vec::load_first(bias + j * NP, c) : Vec::zero();
    if constexpr (KIND == Kind::Dense) {
      for (int m = 0; m < MR; ++m) (acc[m][j] + b).store_first(y + m * ldy + j * NP, c);
    } else {
      const Vec bu = bias ? Vec::load_first(bias + bias_up + j * NP, c) : Vec::zero();
      for (int m = 0; m < MR; ++m) (silu(acc[m][j] + b) * (acc[m][OUT + j] + bu)).store_first(y + m * ldy + j * NP, c);
    }
  }
}

#if defined(__AVX512F__)
// Registers: MR x NZ accumulators + NZ weight vectors + 1 broadcast <= 32 zmm (NZ even for Glu).
template <int MR, Kind KIND>
constexpr int panels_per_call() {
  if constexpr (KIND == Kind::Glu) return MR <= 2 ? 6 : MR <= 6 ? 4 : 2;
  return MR <= 2 ? 6 : MR <= 4 ? 5 : MR <= 6 ? 4 : MR <= 8 ? 3 : 2;
}
template <Kind KIND>
constexpr int kMaxRows = 14;                              // rows of x per register block at most (decode-sized calls)
template <Kind KIND>
constexpr int64_t kPrefillRows = KIND == Kind::Glu ? 12 : 8;   // rows per register block, larger calls
#else
// Registers (16 ymm, two per panel row): one row keeps 2 x NZ accumulators and takes its
// weights straight from memory into the FMAs; more rows hold each loaded weight for all of them,
// so 2 x NZ x MR accumulators + 2 x NZ weights + the broadcasts <= 16 (the 6 x 16 block of
// BLIS's Haswell kernel for MR 3-6).
template <int MR, Kind KIND>
constexpr int panels_per_call() {
  if constexpr (KIND == Kind::Glu) return MR == 1 ? 6 : 2;
  return MR == 1 ? 6 : MR == 2 ? 2 : 1;
}
template <Kind KIND>
constexpr int kMaxRows = KIND == Kind::Glu ? 3 : 6;
template <Kind KIND>
constexpr int64_t kPrefillRows = kMaxRows<KIND>;
#endif
template <Kind KIND>
constexpr int panels_per_output() { return KIND == Kind::Glu ? 2 : 1; }

// What one row block needs besides its rows: the weight, the output, the panel range.
struct Block {
  const float* wp;
  int64_t up;        // Glu: offset of the up panels from the gate panels (floats)
  int64_t K;
  float* y;
  int64_t N;         // output columns (also y's row stride)
  const float* bias;
  int64_t bias_up;   // Glu: offset of the up bias
};

// One row block (MR rows) against output panels [p0, p1).
template <int MR, Kind KIND, bool AHEAD_PF, int NZ = panels_per_call<MR, KIND>()>
void row_block(const float* x, const Block& b, int64_t p0, int64_t p1, Prefetch& pf) {
  constexpr int OUT = NZ / panels_per_output<KIND>();
  int64_t p = p0;
  for (; p + OUT <= p1; p += OUT)
    micro<MR, NZ, KIND, AHEAD_PF>(x, b.wp + p * b.K * NP, b.up, b.K, b.y + p * NP, b.N, b.N - p * NP,
                        b.bias ? b.bias + p * NP : nullptr, b.bias_up, pf);
  if constexpr (OUT > 1) {
    if (p < p1) row_block<MR, KIND, AHEAD_PF, NZ - panels_per_output<KIND>()>(x, b, p, p1, pf);
  }
}

using RowBlockFn = void (*)(const float*, const Block&, int64_t, int64_t, Prefetch&);
struct BlockKernel {
  RowBlockFn fn;        // loads its panels as they come
  RowBlockFn fn_ahead;  // fetches them AHEAD k steps ahead (a sweep's first block)
  int outputs;  // output panels per micro call
};
template <Kind KIND, int... MR>
constexpr std::array<BlockKernel, sizeof...(MR) + 1> block_kernels() {
  return {BlockKernel{nullptr, nullptr, 0},
          BlockKernel{row_block<MR, KIND, false>, row_block<MR, KIND, true>, panels_per_call<MR, KIND>() / panels_per_output<KIND>()}...};
}
template <Kind KIND, int... MR>
constexpr auto block_kernels_upto(std::integer_sequence<int, MR...>) {
  return block_kernels<KIND, (MR + 1)...>();
}
template <Kind KIND>
constexpr auto kBlock = block_kernels_upto<KIND>(std::make_integer_sequence<int, kMaxRows<KIND>>{});

// Rows per register block for a call of M rows (AVX-512 figures; AVX2: 6 dense, 3 Glu). Up to
// 14 rows share one pass over the weights (at decode sizes the weights stream from DRAM once
// while all rows' FMAs run); larger calls use 8-row blocks against 3 panels (12 rows against
// 1 gate + 1 up panel for Glu): fewer loads per FMA once the weights sit in cache. (Glu in 6-row blocks against 2 + 2 panels was
// slightly slower with the unrolled k loop; 14-row blocks and 6-, 12- or 14-row dense blocks
// were no better: docs/BENCHMARKS.md, 'Measurements behind design choices'.)
template <Kind KIND>
inline int64_t block_rows(int64_t M) { return M <= kMaxRows<KIND> ? M : kPrefillRows<KIND>; }

// The next sweep's panels are fetched by calls of several row blocks, whatever their size. A
// one-block call fetches its own panels ahead instead (fetching the next sweep's as well made
// 4-14-row calls slower). With a fixed interval, fetching cost time from 512 rows (when x no
// longer leaves L2 room for two sweeps' panels), so it stopped at 256 rows; at the rate spread
// over the sweep (one line per 16 k steps there) it gains a little at large sizes. (A per-k L1
// fetch the micro kernel used to issue cost time at 190+ rows.) Figures: docs/BENCHMARKS.md,
// 'Measurements behind design choices'.

// Row blocks [r0, r1) x output panels [c0, c1). The first block fetches its panels ahead of
// its loads; with several blocks, the blocks also fetch panels [c1, c2) (the next sweep's)
// into L2, spread over the later blocks (Prefetch::per16), so that DRAM streams the next
// panels while the FMAs work on these.
template <Kind KIND>
void sweep(const float* xp, const Block& blk, int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t c2,
           int64_t mb) {
  const int64_t blocks = (r1 - r0 + mb - 1) / mb, K = blk.K;
  const bool fetch = r1 - r0 > mb;
  const int64_t lines = fetch ? (c2 - c1) * K * NP * int64_t(sizeof(float)) / 64 : 0;
  const int ranges = panels_per_output<KIND>();
  Prefetch pf;
  pf.next[0] = reinterpret_cast<const char*>(blk.wp + c1 * K * NP);
  pf.next[1] = reinterpret_cast<const char*>(blk.wp + blk.up + c1 * K * NP);
  for (int r = 0; r < ranges; ++r) pf.left[r] = lines;
  const BlockKernel& full = kBlock<KIND>[std::min(mb, r1 - r0)];
  const int64_t groups = (blocks - 1) * ((c1 - c0 + full.outputs - 1) / full.outputs) * (K / 16);  // blocks 1..
  pf.per16 = std::clamp<int64_t>((ranges * lines + groups - 1) / std::max<int64_t>(1, groups), 1, 4);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t m0 = r0 + b * mb, rows = std::min(mb, r1 - m0);
    const BlockKernel& kernel = kBlock<KIND>[rows];
    pf.active = pf.left[0] + pf.left[1] > 0;
    Block rows_out = blk;
    rows_out.y += m0 * blk.N;
    (b == 0 ? kernel.fn_ahead : kernel.fn)(xp + m0 * K, rows_out, c0, c1, pf);
  }
}

// Threads split the output panels; each sweeps its rows in passes of ROWS_IN_CACHE over
// groups of CHUNK weight panels.
template <Kind KIND>
void run(const float* xp, int64_t M, const Block& blk) {
  const int64_t out_panels = (blk.N + NP - 1) / NP, chunk = CHUNK / panels_per_output<KIND>();
  const int64_t mb = block_rows<KIND>(M);
  const int64_t grain = std::max<int64_t>(1, (out_panels + at::get_num_threads() - 1) / at::get_num_threads());
  at::parallel_for(0, out_panels, grain, [&](int64_t q0, int64_t q1) {
    for (int64_t r0 = 0; r0 < M; r0 += ROWS_IN_CACHE) {
      const int64_t r1 = std::min(M, r0 + ROWS_IN_CACHE);
      for (int64_t c0 = q0; c0 < q1; c0 += chunk) {
        const int64_t c1 = std::min(q1, c0 + chunk);
        sweep<KIND>(xp, blk, r0, r1, c0, c1, std::min(q1, c1 + chunk), mb);
      }
    }
  });
}

// x (..., K) float32, wp from pack, n = N -> (..., N)
at::Tensor linear(const at::Tensor& x, const at::Tensor& wp, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && wp.dim() == 3 && wp.size(2) == NP, "panel linear: float32 input");
  const int64_t K = x.size(-1), P = wp.size(0);
  TORCH_CHECK(wp.size(1) == K && (n + NP - 1) / NP == P, "panel linear: weight (", P, ", ", wp.size(1),
              ", 16) does not fit input features ", K, " and output features ", n);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto y = at::empty({M, n}, x.options());
  if (M > 0)
    run<Kind::Dense>(x2.data_ptr<float>(), M, Block{wp.data_ptr<float>(), 0, K, y.data_ptr<float>(), n,
                                                    bias ? bias->data_ptr<float>() : nullptr, 0});
  auto shape = x.sizes().vec();
  shape.back() = n;
  return y.view(shape);
}

// x (..., K), wp packed from a (2I, K) gate_up weight (gate rows then up rows, I % 16 == 0),
// bias (2I) or none -> silu(x gate^T + b_gate) * (x up^T + b_up), (..., I).
at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& wp, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && wp.dim() == 3 && wp.size(2) == NP && wp.size(0) % 2 == 0,
              "panel linear_silu_mul: float32 input and a gate_up weight of whole panels");
  const int64_t K = x.size(-1), half = wp.size(0) / 2, I = half * NP;
  TORCH_CHECK(wp.size(1) == K, "panel linear_silu_mul: weight in-features ", wp.size(1), " != input ", K);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto y = at::empty({M, I}, x.options());
  if (M > 0)
    run<Kind::Glu>(x2.data_ptr<float>(), M, Block{wp.data_ptr<float>(), half * K * NP, K, y.data_ptr<float>(), I,
                                                  bias ? bias->data_ptr<float>() : nullptr, I});
  auto shape = x.sizes().vec();
  shape.back() = I;
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY(TOKENLOOM_PANEL_LIBRARY, m) {
  m.def("pack(Tensor w) -> Tensor");
  m.def("linear(Tensor x, Tensor wp, int n, Tensor? bias) -> Tensor");
  m.def("linear_silu_mul(Tensor x, Tensor wp, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(TOKENLOOM_PANEL_LIBRARY, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
  m.impl("linear_silu_mul", &linear_silu_mul);
}
