// Batched LoRA: every row of a step adds the low-rank product of its own adapter (punica's BGMV,
// one call for a batch that mixes adapters and rows without one).
//
//   out[t, n] = y[t, n] + sum_j B[s, j, n] * (A[s, g*R + j, :] . x[t, :])    j < ranks[s, g]
//
// with s = rows[t] (the row's adapter slot; -1: the row has none and out[t] = y[t]; rows may be
// longer than T: the step's buffer, of which the first T entries are read) and g the
// output group of column n: bounds[g] <= n < bounds[g + 1] (a fused projection's q/k/v or
// gate/up shards, each with its own A and B; one group for a plain projection). A is
// (S, G*R, K) and B (S, R, N) (B^T: a rank's outputs side by side), float32, bfloat16 or float16, with the
// adapter's scaling folded into B; rows past a group's rank are never read. The product x A^T
// for all of a row's groups comes first (phase 1: a dot product per rank), then each group's
// outputs add r scaled rows of B (phase 2: axpys along the outputs, no horizontal sums).
// A row's delta has the same bits whichever rows share its step: its products are summed in one
// order whether it runs alone, in a run of its adapter's rows, or on the task lists.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 values of an adapter's storage type as floats: float32, bfloat16 (the high half of a float32)
// or float16 (F16C)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Up to kRowsPerRun rows of one adapter at a time: each A or B vector loaded (and widened) once
// for all of them.
constexpr int kRowsPerRun = 4;

// Phase 1 for N rows against one rank row a (K values): out[q] = a . xs[q]. Each row's products
// are summed in the same order whatever N is (four 8-lane accumulators over 32-value steps, one
// over the 8-value steps left, their sum, then the scalar tail in fused multiply-adds), so a
// row's result has the same bits alone or in a run of its adapter's rows.
template <int N, typename W>
inline void dot_rows(const W* a, const float* const* xs, int64_t K, float* out) {
  __m256 acc[N][4];
  for (int q = 0; q < N; ++q)
    for (int c = 0; c < 4; ++c) acc[q][c] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= K; i += 32)
    for (int c = 0; c < 4; ++c) {
      const __m256 av = load8(a + i + 8 * c);
      for (int q = 0; q < N; ++q) acc[q][c] = _mm256_fmadd_ps(av, _mm256_loadu_ps(xs[q] + i + 8 * c), acc[q][c]);
    }
  for (; i + 8 <= K; i += 8) {
    const __m256 av = load8(a + i);
    for (int q = 0; q < N; ++q) acc[q][0] = _mm256_fmadd_ps(av, _mm256_loadu_ps(xs[q] + i), acc[q][0]);
  }
  for (int q = 0; q < N; ++q) {
    float total = hsum(_mm256_add_ps(_mm256_add_ps(acc[q][0], acc[q][1]), _mm256_add_ps(acc[q][2], acc[q][3])));
    for (int64_t k = i; k < K; ++k) total = std::fma(static_cast<float>(a[k]), xs[q][k], total);
    out[q] = total;
  }
}

// Phase 2 for N rows over `cols` columns: outs[q][0:cols] += sum_j ws[q][j] * rows[j * stride + 0:cols],
// j < r. Every column, in the vector loops or the scalar tail, is the same chain of fused
// multiply-adds onto its output in rank order, so its bits do not depend on N or on where the
// column falls. The first loop keeps C x N chains in flight (a chain waits on its last
// multiply-add), C stretches of 8 columns a row.
template <int N, typename W>
inline void add_rows(float* const* outs, const W* rows, int64_t stride, const float* const* ws, int64_t r,
                     int64_t cols) {
  constexpr int C = N >= 4 ? 1 : 4 / N;
  int64_t i = 0;
  for (; i + 8 * C <= cols; i += 8 * C) {
    __m256 o[N][C];
    for (int q = 0; q < N; ++q)
      for (int c = 0; c < C; ++c) o[q][c] = _mm256_loadu_ps(outs[q] + i + 8 * c);
    for (int64_t j = 0; j < r; ++j)
      for (int c = 0; c < C; ++c) {
        const __m256 b = load8(rows + j * stride + i + 8 * c);
        for (int q = 0; q < N; ++q) o[q][c] = _mm256_fmadd_ps(_mm256_set1_ps(ws[q][j]), b, o[q][c]);
      }
    for (int q = 0; q < N; ++q)
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(outs[q] + i + 8 * c, o[q][c]);
  }
  for (; i + 8 <= cols; i += 8) {
    __m256 o[N];
    for (int q = 0; q < N; ++q) o[q] = _mm256_loadu_ps(outs[q] + i);
    for (int64_t j = 0; j < r; ++j) {
      const __m256 b = load8(rows + j * stride + i);
      for (int q = 0; q < N; ++q) o[q] = _mm256_fmadd_ps(_mm256_set1_ps(ws[q][j]), b, o[q]);
    }
    for (int q = 0; q < N; ++q) _mm256_storeu_ps(outs[q] + i, o[q]);
  }
  for (; i < cols; ++i)
    for (int q = 0; q < N; ++q) {
      float o = outs[q][i];
      for (int64_t j = 0; j < r; ++j) o = std::fma(ws[q][j], static_cast<float>(rows[j * stride + i]), o);
      outs[q][i] = o;
    }
}

// Rows of the step grouped by adapter slot, kRowsPerRun at most a run.
struct Run {
  int64_t slot;
  int n;
  int64_t rows[kRowsPerRun];
};

inline std::vector<Run> runs_of(const int32_t* rw, int64_t T, int64_t S) {
  std::vector<Run> runs;
  for (int64_t s = 0; s < S; ++s) {
    Run run{s, 0, {}};
    for (int64_t t = 0; t < T; ++t) {
      if (rw[t] != s) continue;
      run.rows[run.n++] = t;
      if (run.n == kRowsPerRun) {
        runs.push_back(run);
        run.n = 0;
      }
    }
    if (run.n > 0) runs.push_back(run);
  }
  return runs;
}

constexpr int64_t kColumnsPerTask = 256;
constexpr int64_t kSerialBelow = 1 << 16;  // multiply-adds: below this one thread is faster than a fork

// f<N>(args...) for a run of n rows, 1 <= n <= kRowsPerRun: the templates' row counts fixed at
// compile time, so their accumulators live in registers.
template <template <int> class F, typename... Args>
inline void for_run_size(int n, Args&&... args) {
  switch (n) {
    case 1: F<1>::call(args...); break;
    case 2: F<2>::call(args...); break;
    case 3: F<3>::call(args...); break;
    default: F<4>::call(args...); break;
  }
}

template <int N>
struct DotRows {
  template <typename W>
  static void call(const W* a, const float* const* xs, int64_t K, float* out) { dot_rows<N>(a, xs, K, out); }
};

template <int N>
struct AddRows {
  template <typename W>
  static void call(float* const* outs, const W* rows, int64_t stride, const float* const* ws, int64_t r, int64_t cols) {
    add_rows<N>(outs, rows, stride, ws, r, cols);
  }
};

// Phase 1 for one run at rank column c (group c / R, rank c % R): x A^T of each of its rows into
// xa (T, G*R), each A value loaded once for the run's rows.
template <typename W>
inline void rank_products(const float* xp, const W* ap, const Run& u, int64_t c, int64_t K, int64_t GR, float* xa) {
  const float* xs[kRowsPerRun];
  float got[kRowsPerRun];
  for (int q = 0; q < u.n; ++q) xs[q] = xp + u.rows[q] * K;
  for_run_size<DotRows>(u.n, ap + (u.slot * GR + c) * K, xs, K, got);
  for (int q = 0; q < u.n; ++q) xa[u.rows[q] * GR + c] = got[q];
}

// Phase 2 for one run over columns [c0, c1) of group g (rank r): each row's outputs add r rows of
// B weighted by its xa.
template <typename W>
inline void add_run(const W* bp, const Run& u, int64_t g, int64_t c0, int64_t c1, int64_t r, int64_t N, int64_t GR,
                    int64_t R, const float* xa, float* op) {
  float* outs[kRowsPerRun];
  const float* ws[kRowsPerRun];
  for (int q = 0; q < u.n; ++q) {
    outs[q] = op + u.rows[q] * N + c0;
    ws[q] = xa + u.rows[q] * GR + g * R;
  }
  for_run_size<AddRows>(u.n, outs, bp + u.slot * R * N + c0, N, ws, r, c1 - c0);
}

// One run of one adapter (a decode row, or up to kRowsPerRun rows of one adapter) on this thread,
// with no task lists, heap buffers or parallel region: at a decode row's size their set-up costs
// as much as the arithmetic. `xa` holds T * G * R floats.
template <typename W>
void run_one(const float* xp, const W* ap, const W* bp, const int32_t* rk, at::IntArrayRef bounds, float* op,
             const Run& u, int64_t K, int64_t N, int64_t G, int64_t R, float* xa) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t r = rk[u.slot * G + g];
    if (r == 0) continue;
    for (int64_t j = 0; j < r; ++j) rank_products(xp, ap, u, g * R + j, K, G * R, xa);
    add_run(bp, u, g, bounds[g], bounds[g + 1], r, N, G * R, R, xa, op);
  }
}

constexpr int64_t kStackRanks = 1024;  // T * G * R floats (T <= kRowsPerRun) that run() keeps on the stack

template <typename W>
void run(const float* xp, const W* ap, const W* bp, const int32_t* rk, const int32_t* rw, at::IntArrayRef bounds,
         float* op, int64_t T, int64_t K, int64_t N, int64_t G, int64_t R, int64_t S, int64_t work) {
  if (work < kSerialBelow && T <= kRowsPerRun && G * R * kRowsPerRun <= kStackRanks) {
    Run u{-1, 0, {}};
    for (int64_t t = 0; t < T; ++t) {
      if (rw[t] < 0) continue;
      if (u.n > 0 && rw[t] != u.slot) {  // a second adapter: the general path below
        u.n = -1;
        break;
      }
      u.slot = rw[t];
      u.rows[u.n++] = t;
    }
    if (u.n > 0) {
      float xa[kStackRanks];
      run_one(xp, ap, bp, rk, bounds, op, u, K, N, G, R, xa);
      return;
    }
  }
  std::vector<float> xa(T * G * R, 0.f);  // (T, G*R): x A^T per row, zeros past each group's rank
  const std::vector<Run> runs = runs_of(rw, T, S);
  const int64_t U = static_cast<int64_t>(runs.size());
  // phase 2's tasks: (run, group, a stretch of up to kColumnsPerTask of the group's columns)
  std::vector<int64_t> task_group, task_start;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = bounds[g]; c < bounds[g + 1]; c += kColumnsPerTask) {
      task_group.push_back(g);
      task_start.push_back(c);
    }
  const int64_t per_run = static_cast<int64_t>(task_group.size());
#pragma omp parallel if (work >= kSerialBelow)
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < U * G * R; ++task) {
      const Run& u = runs[task / (G * R)];
      const int64_t c = task % (G * R);
      if (c % R < rk[u.slot * G + c / R]) rank_products(xp, ap, u, c, K, G * R, xa.data());
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < U * per_run; ++task) {
      const Run& u = runs[task / per_run];
      const int64_t g = task_group[task % per_run], c0 = task_start[task % per_run];
      const int64_t r = rk[u.slot * G + g], c1 = std::min<int64_t>(bounds[g + 1], c0 + kColumnsPerTask);
      if (r > 0) add_run(bp, u, g, c0, c1, r, N, G * R, R, xa.data(), op);
    }
  }
}

at::Tensor lora_add(const at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                    const at::Tensor& ranks, const at::Tensor& rows, at::IntArrayRef bounds) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (T, K) float32");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.size(0) == x.size(0), "y must be (T, N) float32");
  const auto kind = A.scalar_type();
  TORCH_CHECK(kind == at::kFloat || kind == at::kBFloat16 || kind == at::kHalf, "A must be float32, bfloat16 or float16");
  TORCH_CHECK(A.dim() == 3 && A.is_contiguous(), "A must be contiguous (S, G*R, K)");
  TORCH_CHECK(B.dim() == 3 && B.is_contiguous() && B.scalar_type() == kind, "B must be contiguous (S, R, N), A's dtype");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), S = A.size(0), R = B.size(1);
  const int64_t G = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(G >= 1 && bounds[0] == 0 && bounds[G] == N, "bounds must run from 0 to N");
  TORCH_CHECK(A.size(2) == K && A.size(1) == G * R && B.size(0) == S && B.size(2) == N, "A, B and x do not agree");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous() && ranks.numel() == S * G, "ranks must be (S, G) int32");
  TORCH_CHECK(rows.scalar_type() == at::kInt && rows.is_contiguous() && rows.numel() >= T,
              "rows must be int32 with at least T entries (the first T are read)");
  // y's values copied here rather than by clone(): at a decode row's size the aten copy's
  // dispatch costs more than the copy
  const at::Tensor yc = y.contiguous();
  at::Tensor out = at::empty({T, N}, yc.options());
  std::memcpy(out.data_ptr<float>(), yc.data_ptr<float>(), sizeof(float) * T * N);
  const int32_t *rk = ranks.data_ptr<int32_t>(), *rw = rows.data_ptr<int32_t>();
  int64_t work = 0;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(rw[t] >= -1 && rw[t] < S, "a row's adapter slot is out of range");
    if (rw[t] >= 0)
      for (int64_t g = 0; g < G; ++g) work += rk[rw[t] * G + g] * (K + bounds[g + 1] - bounds[g]);
  }
  if (work == 0) return out;
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (kind == at::kFloat) {
    run(xp, A.data_ptr<float>(), B.data_ptr<float>(), rk, rw, bounds, op, T, K, N, G, R, S, work);
  } else if (kind == at::kBFloat16) {
    run(xp, A.data_ptr<at::BFloat16>(), B.data_ptr<at::BFloat16>(), rk, rw, bounds, op, T, K, N, G, R, S, work);
  } else {
    run(xp, A.data_ptr<at::Half>(), B.data_ptr<at::Half>(), rk, rw, bounds, op, T, K, N, G, R, S, work);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenloom_lora, m) {
  m.def("lora_add(Tensor y, Tensor x, Tensor A, Tensor B, Tensor ranks, Tensor rows, int[] bounds) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_lora, CPU, m) { m.impl("lora_add", &lora_add); }
