// Batched LoRA: every row of a step adds the low-rank product of its own adapter (punica's BGMV,
// one call for a batch that mixes adapters and rows without one).
//
//   out[t, n] = y[t, n] + sum_j B[s, n, j] * (A[s, g*R + j, :] . x[t, :])    j < ranks[s, g]
//
// with s = rows[t] (the row's adapter slot; -1: the row has none and out[t] = y[t]) and g the
// output group of column n: bounds[g] <= n < bounds[g + 1] (a fused projection's q/k/v or
// gate/up shards, each with its own A and B; one group for a plain projection). A is
// (S, G*R, K) and B (S, N, R), both float32 with the adapter's scaling folded into B; rows of
// A past a group's rank are never read. The product x A^T for all of a row's groups comes
// first (phase 1), then each output column reads its group's R values (phase 2).
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  acc0 = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc0), _mm256_extractf128_ps(acc0, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float total = _mm_cvtss_f32(s);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

constexpr int64_t kColumnsPerTask = 64;
constexpr int64_t kSerialBelow = 1 << 16;  // multiply-adds: below this one thread is faster than a fork

at::Tensor lora_add(const at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                    const at::Tensor& ranks, const at::Tensor& rows, at::IntArrayRef bounds) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (T, K) float32");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.size(0) == x.size(0), "y must be (T, N) float32");
  TORCH_CHECK(A.dim() == 3 && A.scalar_type() == at::kFloat && A.is_contiguous(), "A must be contiguous (S, G*R, K)");
  TORCH_CHECK(B.dim() == 3 && B.scalar_type() == at::kFloat && B.is_contiguous(), "B must be contiguous (S, N, R)");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), S = A.size(0), R = B.size(2);
  const int64_t G = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(G >= 1 && bounds[0] == 0 && bounds[G] == N, "bounds must run from 0 to N");
  TORCH_CHECK(A.size(2) == K && A.size(1) == G * R && B.size(0) == S && B.size(1) == N, "A, B and x do not agree");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous() && ranks.numel() == S * G, "ranks must be (S, G) int32");
  TORCH_CHECK(rows.scalar_type() == at::kInt && rows.is_contiguous() && rows.numel() == T, "rows must be (T,) int32");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = y.contiguous().clone();
  const float *xp = xc.data_ptr<float>(), *ap = A.data_ptr<float>(), *bp = B.data_ptr<float>();
  const int32_t *rk = ranks.data_ptr<int32_t>(), *rw = rows.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(rw[t] >= -1 && rw[t] < S, "a row's adapter slot is out of range");
  std::vector<int64_t> group_of(N);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t n = bounds[g]; n < bounds[g + 1]; ++n) group_of[n] = g;
  std::vector<float> xa(T * G * R, 0.f);  // (T, G*R): x A^T per row, zeros past each group's rank
  int64_t work = 0;
  for (int64_t t = 0; t < T; ++t) work += rw[t] >= 0 ? G * R * K + N * R : 0;
  if (work == 0) return out;
  const int64_t tasks = (N + kColumnsPerTask - 1) / kColumnsPerTask;
#pragma omp parallel if (work >= kSerialBelow)
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < T * G * R; ++task) {
      const int64_t t = task / (G * R), c = task % (G * R), s = rw[t];
      if (s >= 0 && c % R < rk[s * G + c / R]) xa[task] = dot(ap + (s * G * R + c) * K, xp + t * K, K);
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < T * tasks; ++task) {
      const int64_t t = task / tasks, s = rw[t];
      if (s < 0) continue;
      const int64_t n0 = (task % tasks) * kColumnsPerTask, n1 = std::min(N, n0 + kColumnsPerTask);
      for (int64_t n = n0; n < n1; ++n) {
        const int64_t g = group_of[n], r = rk[s * G + g];
        if (r > 0) op[t * N + n] += dot(bp + (s * N + n) * R, xa.data() + t * G * R + g * R, r);
      }
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenloom_lora, m) {
  m.def("lora_add(Tensor y, Tensor x, Tensor A, Tensor B, Tensor ranks, Tensor rows, int[] bounds) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_lora, CPU, m) { m.impl("lora_add", &lora_add); }
