// Causal attention for prompt chunks (several queries per sequence), float32, reading the keys
// and values from the paged cache where they lie. Built twice: for AVX-512 (16-lane vectors,
// library tokenloom_prefill512) and for AVX2 (8 lanes, tokenloom_prefill); the lane count is
// the queries a task holds and the width of a column group, the arithmetic is the same.
//
// q (T, H, D) holds every row of the step; sequence s owns rows [q_starts[s], + q_lens[s]),
// at positions ctx_lens[s] - q_lens[s] ... ctx_lens[s] - 1, and its keys/values (this step's
// already written) are in blocks tables[s] of k_cache/v_cache (num_blocks + 1, block_size,
// KVH, D). A query at position p attends to positions t <= p (and t > p - window when
// window > 0); softcap > 0 turns each score x into tanh(x / softcap) * softcap (Gemma 2). Only the listed sequences' rows of out (T, H, D) are written.
//
// One task = QT query rows (the vector's lanes) of one sequence and every query head of one kv
// head, the queries side by side in the lanes of a vector: q is transposed once per task and head (qt[d] =
// lane j's q[d]), so for every key t the QT scores are one FMA chain over d = 0..D-1 with
// k_t[d] broadcast, the softmax runs lane-wise, and the output is a chain over t of v_t[d]
// broadcast times the QT weights. No key tile is ever transposed and the FMA units stay busy.
// Up to three heads share each key tile's copy and each broadcast key element (heads sharing
// a kv head), and tiles no lane masks skip the mask. Up to 2048 positions of context it is
// faster than torch's flash attention; beyond, each task rereads its head's keys and values
// from L3 and torch wins (cpu_prefill.py routes such contexts to torch; docs/BENCHMARKS.md). Every query row is computed by the same chains in the same order
// whichever rows share its task: keys masked for it (past its position) add exactly zero.
// So a row's output is the same bits whether its prompt is prefilled whole, in chunks, after
// a prefix-cache hit, or batched with other prompts.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "paged_rows.h"

namespace {

#if defined(__AVX512F__)
#define TOKENLOOM_PREFILL_LIBRARY tokenloom_prefill512
extern "C" __m512 Sleef_expf16_u10avx512f(__m512);   // in libtorch_cpu (1-ulp exp, 16 lanes)
extern "C" __m512 Sleef_tanhf16_u10avx512f(__m512);  // in libtorch_cpu (1-ulp tanh, 16 lanes)
using vf = __m512;
constexpr int64_t QT = 16;    // query rows per task (the vector's lanes)
constexpr int REGISTERS = 32;  // vector registers (the accumulators' budget)
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_load_ps(p); }
inline vf vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_store_ps(p, x); }
inline void vstoreu(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vexp(vf x) { return Sleef_expf16_u10avx512f(x); }
inline vf vtanh(vf x) { return Sleef_tanhf16_u10avx512f(x); }
// sc where each lane (position pos[lane]) may attend to position t (t <= pos, and t > pos - window
// when window > 0), -inf elsewhere.
inline vf attendable(vf sc, const int32_t* pos, int64_t t, int64_t window) {
  const __m512i p = _mm512_loadu_si512(pos), tv = _mm512_set1_epi32(static_cast<int>(t));
  __mmask16 ok = _mm512_cmple_epi32_mask(tv, p);
  if (window > 0) ok &= _mm512_cmpgt_epi32_mask(tv, _mm512_sub_epi32(p, _mm512_set1_epi32(static_cast<int>(window))));
  return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), ok, sc);
}
#else
#define TOKENLOOM_PREFILL_LIBRARY tokenloom_prefill
extern "C" __m256 Sleef_expf8_u10avx2(__m256);   // in libtorch_cpu (1-ulp exp, 8 lanes)
extern "C" __m256 Sleef_tanhf8_u10avx2(__m256);  // in libtorch_cpu (1-ulp tanh, 8 lanes)
using vf = __m256;
constexpr int64_t QT = 8;
constexpr int REGISTERS = 16;
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_load_ps(p); }
inline vf vloadu(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm256_store_ps(p, x); }
inline void vstoreu(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vexp(vf x) { return Sleef_expf8_u10avx2(x); }
inline vf vtanh(vf x) { return Sleef_tanhf8_u10avx2(x); }
inline vf attendable(vf sc, const int32_t* pos, int64_t t, int64_t window) {
  const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos));
  const __m256i tv = _mm256_set1_epi32(static_cast<int>(t));
  __m256i bad = _mm256_cmpgt_epi32(tv, p);  // t > pos
  if (window > 0)  // t <= pos - window
    bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(_mm256_sub_epi32(p, _mm256_set1_epi32(static_cast<int>(window - 1))), tv));
  return _mm256_blendv_ps(sc, _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(bad));
}
#endif

struct Task {
  int64_t seq, group, first;  // sequence, kv head, first query row of the chunk (0-based in it)
  int64_t cost;              // keys read (for scheduling the longest first)
};

struct Layout {
  const float *q, *kc, *vc;
  float* out;
  const int64_t *tables, *q_starts, *q_lens, *ctx_lens;
  int64_t H, KVH, D, BS, W;
  float scale;
  int64_t window;
  float softcap;  // > 0: scores soft-capped; 0: not
};

// Scores of the n keys in rows.k for the task's QT queries of HP heads (qt[h][d * QT + lane])
// into st[h][t * QT + lane]: scale * sum_d q[d] k_t[d] (one chain over d; soft-capped if asked), -inf where a lane
// may not attend to position t_lo + t; top[h] gets each head's lane-wise maximum. Each key
// tile is copied first (contiguous rows give the broadcasts one base register); KP keys at a
// time, each broadcast key element multiplies all HP heads' queries (the heads share the kv
// head), HP x KP accumulators.
template <int D, int HP, int KP>
void scores(const float* const* qt, const Rows& rows, int64_t t_lo, const int32_t* lane_pos, const Layout& l,
            float* const* st, vf* top) {
  static_assert(16 % KP == 0 && HP * KP + HP + 1 <= REGISTERS, "register budget");
  const vf scale = vset1(l.scale), ninf = vset1(-INFINITY), cap = vset1(l.softcap);
  const bool capped = l.softcap > 0.f;
  const int64_t n = static_cast<int64_t>(rows.k.size());
  const int64_t lowest = lane_pos[0], highest = lane_pos[QT - 1];   // positions ascend over the lanes
  alignas(64) float keys[16 * D];
  for (int h = 0; h < HP; ++h) top[h] = ninf;
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, n - t0));
    for (int i = 0; i < 16; ++i) std::copy_n(rows.k[t0 + std::min(i, m - 1)], D, keys + i * D);
    // Every lane may attend to every key of the tile: no mask (same values as the masked path).
    const bool open = t_lo + t0 + m - 1 <= lowest && (l.window <= 0 || t_lo + t0 > highest - l.window);
    for (int k0 = 0; k0 < m; k0 += KP) {
      vf acc[HP][KP];
      for (int h = 0; h < HP; ++h)
        for (int i = 0; i < KP; ++i) acc[h][i] = vzero();
      for (int d = 0; d < D; ++d) {
        vf qd[HP];
        for (int h = 0; h < HP; ++h) qd[h] = vload(qt[h] + d * QT);
        for (int i = 0; i < KP; ++i) {
          const vf kb = vset1(keys[(k0 + i) * D + d]);
          for (int h = 0; h < HP; ++h) acc[h][i] = vfmadd(kb, qd[h], acc[h][i]);
        }
      }
      for (int i = 0; i < std::min(KP, m - k0); ++i) {
        const int64_t t = t0 + k0 + i;
        for (int h = 0; h < HP; ++h) {
          vf sc = vmul(acc[h][i], scale);
          if (capped) sc = vmul(vtanh(vdiv(sc, cap)), cap);
          if (!open) sc = attendable(sc, lane_pos, t_lo + t, l.window);
          vstoreu(st[h] + t * QT, sc);
          top[h] = vmax(top[h], sc);
        }
      }
    }
  }
}

// st <- exp(st - top) lane-wise; returns the lane-wise sums (one chain over t per lane).
inline vf exponentiate(float* st, int64_t n, vf top) {
  vf sum = vzero();
  for (int64_t t = 0; t < n; ++t) {
    const vf e = vexp(vsub(vloadu(st + t * QT), top));
    vstoreu(st + t * QT, e);
    sum = vadd(sum, e);
  }
  return sum;
}

// out rows of the task's queries (lanes j < m) for head h = (sum_t w_t[j] v_t[d]) / sum[j]:
// for QT columns of d at a time, query j's accumulator is a chain over t of its weight
// (broadcast from st) times v_t's columns. Keys go in runs of TB, the partial sums parked in
// the output rows between runs (the chain's order is unchanged), so a run's weights stay in
// L1 while every column group reads them.
constexpr int64_t TB = 256;
template <int D>
void values(const float* st, const Rows& rows, const float* inv, float* const* out_rows, int m, int64_t h) {
  const int64_t n = static_cast<int64_t>(rows.v.size());
  for (int64_t t0 = 0; t0 < n; t0 += TB) {
    const int64_t t1 = std::min(n, t0 + TB);
    for (int c = 0; c < D / QT; ++c) {  // column groups as wide as a vector
      vf acc[QT];
      for (int j = 0; j < QT; ++j) acc[j] = t0 == 0 ? vzero() : vloadu(out_rows[j] + h * D + QT * c);
      for (int64_t t = t0; t < t1; ++t) {
        const vf v = vloadu(rows.v[t] + QT * c);
        const float* w = st + t * QT;
        for (int j = 0; j < QT; ++j) acc[j] = vfmadd(vset1(w[j]), v, acc[j]);
      }
      for (int j = 0; j < m; ++j)
        vstoreu(out_rows[j] + h * D + QT * c, t1 == n ? vmul(acc[j], vset1(inv[j])) : acc[j]);
    }
  }
}

// Softmax and values of one head whose scores are in st (n keys x QT lanes), top its lane maxima.
template <int D>
void finish_head(float* st, int64_t n, vf top, const Rows& rows, float* const* out_rows, int m, int64_t h) {
  alignas(64) float inv[QT];
  vstore(inv, vdiv(vset1(1.f), exponentiate(st, n, top)));
  values<D>(st, rows, inv, out_rows, m, h);
}

// Heads [h0, h0 + HP) of the task (all share kv head g): their transposed queries in qt.
template <int D, int HP>
void heads_pass(const Layout& l, const Rows& rows, int64_t t_lo, int64_t n, const int32_t* pos, const int64_t* q_rows,
                float* const* out_rows, int m, int64_t h0, std::vector<float>& st) {
  constexpr int KP = QT == 16 ? (HP == 1 ? 16 : 8) : (HP == 1 ? 8 : HP == 2 ? 4 : 2);  // within the register budget
  alignas(64) float qt[HP][D * QT];
  for (int h = 0; h < HP; ++h)
    for (int j = 0; j < QT; ++j) {
      const float* qr = l.q + (q_rows[j] * l.H + h0 + h) * D;
      for (int d = 0; d < D; ++d) qt[h][d * QT + j] = qr[d];
    }
  st.resize(static_cast<size_t>(HP * n * QT));
  const float* qts[HP];
  float* sts[HP];
  for (int h = 0; h < HP; ++h) qts[h] = qt[h], sts[h] = st.data() + h * n * QT;
  vf top[HP];
  scores<D, HP, KP>(qts, rows, t_lo, pos, l, sts, top);
  for (int h = 0; h < HP; ++h) finish_head<D>(sts[h], n, top[h], rows, out_rows, m, h0 + h);
}

// The task's 16 query rows of every head reading kv head task.group (idle lanes repeat the
// last query: computed, not stored), in passes of up to three heads.
template <int D>
void run_task(const Task& task, const Layout& l, std::vector<float>& st, Rows& rows) {
  const int64_t s = task.seq, g = task.group, G = l.H / l.KVH;
  const int64_t q_len = l.q_lens[s], base = l.ctx_lens[s] - q_len;
  const int m = static_cast<int>(std::min<int64_t>(QT, q_len - task.first));
  alignas(64) int32_t pos[QT];
  int64_t q_rows[QT];
  float* out_rows[QT];
  for (int j = 0; j < QT; ++j) {
    const int64_t r = q_rows[j] = l.q_starts[s] + task.first + std::min(j, m - 1);
    pos[j] = static_cast<int32_t>(base + task.first + std::min(j, m - 1));
    out_rows[j] = l.out + r * l.H * D;
  }
  const int64_t t_hi = pos[m - 1] + 1;
  const int64_t t_lo = l.window > 0 ? std::max<int64_t>(0, pos[0] - l.window + 1) : 0, n = t_hi - t_lo;
  rows.fill(l.kc + g * D, l.vc + g * D, l.tables + s * l.W, t_lo, t_hi, l.BS, l.KVH * D);   // kv head g's rows
  for (int64_t h = g * G; h < (g + 1) * G;) {
    const int64_t left = (g + 1) * G - h;
    if (left >= 3 && left != 4) heads_pass<D, 3>(l, rows, t_lo, n, pos, q_rows, out_rows, m, h, st), h += 3;
    else if (left >= 2) heads_pass<D, 2>(l, rows, t_lo, n, pos, q_rows, out_rows, m, h, st), h += 2;
    else heads_pass<D, 1>(l, rows, t_lo, n, pos, q_rows, out_rows, m, h, st), h += 1;
  }
}

template <int D>
void run_all(const std::vector<Task>& tasks, const Layout& l) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {   // each thread pulls tasks
    std::vector<float> st;
    Rows rows;
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) run_task<D>(tasks[i], l, st, rows);
  });
}

// Writes the rows of the listed sequences into out (T, H, D); other rows are left as they are.
void paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                   const at::Tensor& q_starts, const at::Tensor& q_lens, const at::Tensor& ctx_lens, double scale,
                   int64_t window, double softcap, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous (T, H, D) float32");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out must be contiguous float32 shaped like q");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "caches must be contiguous (blocks, block_size, kv_heads, head_dim) float32");
  const int64_t S = tables.size(0), T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous(), "tables must be (S, W) int64");
  for (const at::Tensor* t : {&q_starts, &q_lens, &ctx_lens})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == S && t->scalar_type() == at::kLong && t->is_contiguous(),
                "q_starts, q_lens and ctx_lens must be (S,) int64");
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "head_dim or head counts disagree");
  TORCH_CHECK(D == 32 || D == 64 || D == 128 || D == 256, "paged_prefill: head_dim must be 32, 64, 128 or 256");
  const int64_t *starts = q_starts.data_ptr<int64_t>(), *lens = q_lens.data_ptr<int64_t>(),
                *ctxs = ctx_lens.data_ptr<int64_t>();
  const int64_t BS = k_cache.size(1), W = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= ctxs[s] && ctxs[s] <= W * BS && starts[s] >= 0 && starts[s] + lens[s] <= T,
                "sequence ", s, ": query rows or context length out of range");
    for (int64_t b = 0; b < (ctxs[s] + BS - 1) / BS; ++b)
      TORCH_CHECK(table[s * W + b] >= 0 && table[s * W + b] < k_cache.size(0), "sequence ", s, ": block id out of range");
    for (int64_t first = 0; first < lens[s]; first += QT)
      for (int64_t g = 0; g < KVH; ++g) {
        const int64_t hi = ctxs[s] - lens[s] + std::min(lens[s], first + QT);
        const int64_t lo = window > 0 ? std::max<int64_t>(0, ctxs[s] - lens[s] + first - window + 1) : 0;
        tasks.push_back({s, g, first, hi - lo});
      }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const Layout l{q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), out.data_ptr<float>(),
                 table, starts, lens, ctxs, H, KVH, D, BS, W, static_cast<float>(scale), window,
                 static_cast<float>(softcap)};
  if (D == 64) run_all<64>(tasks, l);
  else if (D == 128) run_all<128>(tasks, l);
  else if (D == 256) run_all<256>(tasks, l);
  else run_all<32>(tasks, l);
}

}  // namespace

TORCH_LIBRARY(TOKENLOOM_PREFILL_LIBRARY, m) {
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor q_starts, Tensor q_lens, "
        "Tensor ctx_lens, float scale, int window, float softcap, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(TOKENLOOM_PREFILL_LIBRARY, CPU, m) {
  m.impl("paged_prefill", &paged_prefill);
}
