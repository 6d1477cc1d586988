// Float32 CPU passes over a batch of logit rows for the sampler's filters: each reads a row of
// the vocabulary once or twice (vectorized, rows split across cores) where torch would make
// several passes and temporaries. Row-independent, so a row's result does not depend on its
// batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kFlush = 1024;  // float lane sums are added into doubles every this many columns

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, op,
              " wants a float32 CPU x (B, V) with unit-stride rows");
}

// f(b, row) for every row b of x (B, V) (checked by check_rows), the rows spread over torch's threads.
template <typename F>
void for_each_row(const at::Tensor& x, const F& f) {
  const float* xp = x.data_ptr<float>();
  const int64_t ld = x.stride(0);
  at::parallel_for(0, x.size(0), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) f(b, xp + b * ld);
  });
}

// floor (B, 1) or (B,) float32, one per row of x, contiguous.
at::Tensor floor_per_row(const at::Tensor& x, const at::Tensor& floor, const char* op) {
  TORCH_CHECK(floor.scalar_type() == at::kFloat && floor.numel() == x.size(0), op, " wants one float32 floor per row");
  return floor.contiguous();
}

inline float lanes_sum(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float s = 0.f;
  for (float x : lanes) s += x;
  return s;
}

inline float lanes_max(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float m = kNegInf;
  for (float x : lanes) m = std::max(m, x);
  return m;
}

// Over row[0, V): a sum accumulated 8 columns at a time by `add8(s, x, finite)` -> s (x the
// columns, finite their mask of entries that are not -inf) in float lanes flushed into a double
// every kFlush columns, plus `add1(x)` for each finite entry of the columns past the last 8.
template <typename Add8, typename Add1>
double flushed_sum(const float* row, int64_t V, Add8 add8, Add1 add1) {
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  double total = 0;
  int64_t v = 0;
  while (v + 8 <= V) {
    __m256 s = _mm256_setzero_ps();
    const int64_t end = std::min(V, v + kFlush);
    for (; v + 8 <= end; v += 8) {
      const __m256 x = _mm256_loadu_ps(row + v);
      s = add8(s, x, _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_UQ));
    }
    total += lanes_sum(s);
  }
  for (; v < V; ++v)
    if (row[v] != kNegInf) total += add1(row[v]);
  return total;
}

// Over the entries of row[0, V) that are not -inf: their count, sum and maximum, in one pass.
void finite_sum_max(const float* row, int64_t V, int64_t& count, double& sum, float& top) {
  __m256 m = _mm256_set1_ps(kNegInf);
  float tail_top = kNegInf;
  count = 0;
  sum = flushed_sum(
      row, V,
      [&](__m256 s, __m256 x, __m256 finite) {
        m = _mm256_max_ps(m, x);
        count += __builtin_popcount(_mm256_movemask_ps(finite));
        return _mm256_add_ps(s, _mm256_and_ps(x, finite));
      },
      [&](float x) {
        ++count;
        tail_top = std::max(tail_top, x);
        return static_cast<double>(x);
      });
  top = std::max(lanes_max(m), tail_top);
}

// The sum of (x - mean)^2 over the entries of row[0, V) that are not -inf.
double finite_square_deviation(const float* row, int64_t V, float mean) {
  const __m256 mu = _mm256_set1_ps(mean);
  return flushed_sum(
      row, V,
      [&](__m256 s, __m256 x, __m256 finite) {
        const __m256 d = _mm256_and_ps(_mm256_sub_ps(x, mu), finite);
        return _mm256_fmadd_ps(d, d, s);
      },
      [&](float x) { return static_cast<double>(x - mean) * (x - mean); });
}

// Per row of x (B, V): the count, mean, population standard deviation and maximum of the
// entries that are not -inf -> (B, 4) float32; the statistics top-n-sigma cuts by. Two passes
// (sum and maximum, then squared deviations from the mean), so the deviation does not come
// from a difference of large sums. A row with no finite entry: count 0, mean 0, std 0, max -inf.
at::Tensor row_finite_stats(const at::Tensor& x) {
  check_rows(x, "row_finite_stats");
  const int64_t V = x.size(1);
  at::Tensor out = at::empty({x.size(0), 4}, x.options());
  float* op = out.data_ptr<float>();
  for_each_row(x, [&](int64_t b, const float* row) {
    int64_t count;
    double sum;
    float top;
    finite_sum_max(row, V, count, sum, top);
    const float mean = count ? static_cast<float>(sum / count) : 0.f;
    const double variance = count ? finite_square_deviation(row, V, mean) / count : 0.0;
    op[b * 4 + 0] = static_cast<float>(count);
    op[b * 4 + 1] = mean;
    op[b * 4 + 2] = static_cast<float>(std::sqrt(variance));
    op[b * 4 + 3] = top;
  });
  return out;
}

// e^x for 8 floats (Cephes' expf, as in avx_mathfun: x = n ln2 + r, |r| <= ln2 / 2, e^r by a
// degree-5 polynomial, 2^n put into the exponent): relative error ~2e-7; x < -87.3 gives ~0.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Per row of x (B, V): log sum exp of its entries (-inf entries add nothing; a row of -inf only
// gives -inf) -> (B,) float32. Two passes: the maximum, then e^(x - max) summed in float lanes
// flushed into a double every kFlush columns.
at::Tensor row_logsumexp(const at::Tensor& x) {
  check_rows(x, "row_logsumexp");
  const int64_t V = x.size(1);
  at::Tensor out = at::empty({x.size(0)}, x.options());
  float* op = out.data_ptr<float>();
  for_each_row(x, [&](int64_t b, const float* row) {
    int64_t count;
    double unused;
    float top;
    finite_sum_max(row, V, count, unused, top);
    if (std::isinf(top)) {                    // nothing finite (-inf), or +inf dominates
      op[b] = top;
      return;
    }
    const __m256 shift = _mm256_set1_ps(top);
    const double total = flushed_sum(
        row, V,
        [&](__m256 s, __m256 x, __m256 finite) {
          return _mm256_add_ps(s, _mm256_and_ps(exp8(_mm256_sub_ps(x, shift)), finite));
        },
        [&](float x) { return std::exp(static_cast<double>(x) - top); });
    op[b] = top + static_cast<float>(std::log(total));
  });
  return out;
}

// Per row of x (B, V): how many entries are at least floor[b] (floor (B, 1) or (B,)) -> (B,) int64.
at::Tensor row_count_at_least(const at::Tensor& x, const at::Tensor& floor) {
  check_rows(x, "row_count_at_least");
  const int64_t V = x.size(1);
  const at::Tensor f = floor_per_row(x, floor, "row_count_at_least");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* fp = f.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for_each_row(x, [&](int64_t b, const float* row) {
    const __m256 t = _mm256_set1_ps(fp[b]);
    int64_t count = 0, v = 0;
    for (; v + 8 <= V; v += 8)
      count += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + v), t, _CMP_GE_OQ)));
    for (; v < V; ++v) count += row[v] >= fp[b];
    op[b] = count;
  });
  return out;
}

// Per row of x (B, V): the entries at least floor[b], in column order, then (to `width`, which
// must be at least every row's count) the first columns below it, their values -inf ->
// (values (B, width) float32, columns (B, width) int64): a row narrowed to what a threshold
// keeps, each column named once.
std::tuple<at::Tensor, at::Tensor> row_at_least(const at::Tensor& x, const at::Tensor& floor, int64_t width) {
  check_rows(x, "row_at_least");
  const int64_t B = x.size(0), V = x.size(1);
  const at::Tensor f = floor_per_row(x, floor, "row_at_least");
  TORCH_CHECK(width >= 0 && width <= V, "row_at_least wants 0 <= width <= V");
  at::Tensor values = at::empty({B, width}, x.options()), columns = at::empty({B, width}, x.options().dtype(at::kLong));
  const float* fp = f.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* cp = columns.data_ptr<int64_t>();
  std::atomic<bool> too_many{false};
  for_each_row(x, [&](int64_t b, const float* row) {
    const __m256 t = _mm256_set1_ps(fp[b]);
    float* out_v = vp + b * width;
    int64_t* out_c = cp + b * width;
    int64_t n = 0, v = 0;
    for (; v + 8 <= V && n <= width; v += 8)
      for (int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + v), t, _CMP_GE_OQ)); hit;
           hit &= hit - 1) {
        const int64_t c = v + __builtin_ctz(hit);
        if (n < width) out_v[n] = row[c], out_c[n] = c;
        ++n;
      }
    for (; v < V && n <= width; ++v)
      if (row[v] >= fp[b]) {
        if (n < width) out_v[n] = row[v], out_c[n] = v;
        ++n;
      }
    if (n > width) {
      too_many = true;
      return;
    }
    for (int64_t c = 0; n < width; ++c)  // fill with the first columns below the floor
      if (!(row[c] >= fp[b])) out_v[n] = kNegInf, out_c[n++] = c;
  });
  TORCH_CHECK(!too_many, "row_at_least: a row has more than width=", width, " entries at its floor or above");
  return {values, columns};
}

using Entry = std::pair<float, int64_t>;  // (value, column)

// Larger value first, then the lower column: the order the k largest come out in.
inline bool ranks_before(const Entry& a, const Entry& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// The k largest entries of row[0, V) (k <= V / 8) into values/columns, largest first, ties by the
// lower column. First pass: the maxima of groups of `depth` entries (lane j of a step of 8 x depth
// columns is the group of columns j, j + 8, ...; depth 64 where there are at least 2k such groups,
// else 8); the k-th largest group maximum is at most the k-th largest entry (k groups each hold an
// entry at least that large), so every one of the k largest is at least it. Second pass: the
// entries at least that floor (a few more than k) are the candidates, ranked in full. NaN never
// ranks (max and the >= compare pass it over).
void top_k_row(const float* row, int64_t V, int64_t k, std::vector<float>& maxima, std::vector<Entry>& found,
               float* values, int64_t* columns) {
  const int64_t depth = V / 64 >= 2 * k ? 64 : 8, span = 8 * depth, steps = V / span, body = steps * span;
  maxima.resize(steps * 8);
  for (int64_t s = 0; s < steps; ++s) {
    __m256 m = _mm256_set1_ps(kNegInf);
    for (int64_t j = 0; j < depth; ++j) m = _mm256_max_ps(_mm256_loadu_ps(row + s * span + 8 * j), m);
    _mm256_storeu_ps(maxima.data() + 8 * s, m);
  }
  for (int64_t v = body; v < V; ++v) maxima.push_back(std::isnan(row[v]) ? kNegInf : row[v]);   // groups of one
  std::nth_element(maxima.begin(), maxima.begin() + (k - 1), maxima.end(), std::greater<float>());
  const float floor = maxima[k - 1];
  found.clear();
  const __m256 f = _mm256_set1_ps(floor);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + v), f, _CMP_GE_OQ));
    for (; hit; hit &= hit - 1) {
      const int64_t c = v + __builtin_ctz(hit);
      found.emplace_back(row[c], c);
    }
  }
  for (; v < V; ++v)
    if (row[v] >= floor) found.emplace_back(row[v], v);
  std::partial_sort(found.begin(), found.begin() + k, found.end(), ranks_before);
  for (int64_t i = 0; i < k; ++i) {
    values[i] = found[i].first;
    columns[i] = found[i].second;
  }
}

// Each row's k largest entries of x (B, V), largest first (ties: lower column first) ->
// (values (B, k) float32, columns (B, k) int64), for k <= V / 8 (top-k sampling's 40 of 49,152;
// the caller takes torch.topk where k is a larger share of V).
std::tuple<at::Tensor, at::Tensor> row_top_k(const at::Tensor& x, int64_t k) {
  check_rows(x, "row_top_k");
  const int64_t B = x.size(0), V = x.size(1), ld = x.stride(0);
  TORCH_CHECK(k >= 1 && k * 8 <= V, "row_top_k wants 1 <= k <= V / 8, got k=", k, " for V=", V);
  at::Tensor values = at::empty({B, k}, x.options()), columns = at::empty({B, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* cp = columns.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> maxima;
    std::vector<Entry> found;
    for (int64_t b = b0; b < b1; ++b) top_k_row(xp + b * ld, V, k, maxima, found, vp + b * k, cp + b * k);
  });
  return {values, columns};
}

}  // namespace

TORCH_LIBRARY(tokenloom_select, m) {
  m.def("row_finite_stats(Tensor x) -> Tensor");
  m.def("row_top_k(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("row_logsumexp(Tensor x) -> Tensor");
  m.def("row_count_at_least(Tensor x, Tensor floor) -> Tensor");
  m.def("row_at_least(Tensor x, Tensor floor, int width) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tokenloom_select, CPU, m) {
  m.impl("row_finite_stats", &row_finite_stats);
  m.impl("row_top_k", &row_top_k);
  m.impl("row_logsumexp", &row_logsumexp);
  m.impl("row_count_at_least", &row_count_at_least);
  m.impl("row_at_least", &row_at_least);
}
