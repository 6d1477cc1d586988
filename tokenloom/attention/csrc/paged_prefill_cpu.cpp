// Causal attention for prompt chunks (several queries per sequence), float32, reading the keys
// and values from the paged cache where they lie, in float32 or a stored format (16-bit, int8,
// int4: widened as each tile is copied, Stored below). Built twice: for AVX-512 (16-lane vectors,
// library tokenloom_prefill512) and for AVX2 (8 lanes, tokenloom_prefill); the lane count QT is
// the queries a vector holds, the arithmetic is the same.
//
// q (T, H, D) holds every row of the step; sequence s owns rows [q_starts[s], + q_lens[s]),
// at positions ctx_lens[s] - q_lens[s] ... ctx_lens[s] - 1, and its keys/values (this step's
// already written) are in blocks tables[s] of k_cache/v_cache (num_blocks + 1, block_size,
// KVH, D). A query at position p attends to positions t <= p (and t > p - window when
// window > 0); softcap > 0 turns each score x into tanh(x / softcap) * softcap (Gemma 2). Only
// the listed sequences' rows of out (T, H, D) are written.
//
// A query vector = QT query rows of one head side by side in a vector's lanes, the queries
// transposed once (qt[d] = lane j's q[d]): for every key t the QT scores are one FMA chain over
// d with k_t[d] broadcast, the softmax runs lane-wise, and the output, kept transposed too, is
// for each d a chain over t of v_t[d] broadcast times the QT weights. No key is transposed.
// One task = up to MAX_GROUPS groups of QT rows of one sequence x every query head of one kv
// head: all its query vectors share the kv head's keys and values. The task walks its keys in
// tiles of tile_keys<D>() positions (16 KB of keys and of values), copying each tile once and running
// every query vector that attends to some of its keys against it while it is hot, in passes
// of up to PASS vectors that share each broadcast key or value element: scores, an
// online-softmax step (running maximum and sum per lane, the outputs rescaled when the
// maximum grows), then the values. So a key is read from memory once per task instead of
// once per QT rows, at any context length.
//
// Every query row is computed by the same chains in the same order whichever rows share its
// task or pass: tiles start at multiples of tile_keys<D>() in absolute positions, so a row
// sees the same tiles in any task, and keys or whole tiles masked for it (past its position,
// before its window) leave its state exactly unchanged (weight exp(-inf) = 0, alpha 1). So a
// row's output is the same bits whether its prompt is prefilled whole, in chunks, after a
// prefix-cache hit, or batched with other prompts. Tasks are sized so that the largest is at
// most a quarter of a thread's share (causal: later rows read more keys) and pulled longest
// first by every thread.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <vector>

#include "stored_checks.h"
#include "stored_lanes.h"

namespace {

#if defined(__AVX512F__)
#define TOKENLOOM_PREFILL_LIBRARY tokenloom_prefill512
extern "C" __m512 Sleef_tanhf16_u10avx512f(__m512);  // in libtorch_cpu (1-ulp tanh, 16 lanes)
using vf = __m512;
constexpr int64_t QT = 16;     // query rows per vector (its lanes)
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
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^n for whole n in [-126, 127]: n + 127 as the exponent field.
inline vf vexp2_whole(vf n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline vf vzero_below(vf y, vf x, vf lo) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), y); }
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
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vexp2_whole(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vf vzero_below(vf y, vf x, vf lo) { return _mm256_and_ps(y, _mm256_cmp_ps(x, lo, _CMP_GE_OQ)); }
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

// exp(x) for x <= 0 or -inf (a score minus a running maximum), lane-wise: x = n ln2 + r, |r| <=
// ln2 / 2, exp(r) by Cephes' expf polynomial (within 2 ulp of expf), times 2^n; exactly 0 below
// -87.3 (where 2^n would leave the normal range) and for -inf. Cheaper than Sleef's expf, which
// handles every x.
inline vf exp_nonpositive(vf x) {
  const vf lo = vset1(-87.33654f), xc = vmax(x, lo);
  const vf n = vround(vmul(xc, vset1(1.44269504088896341f)));
  vf r = vsub(xc, vmul(n, vset1(0.693359375f)));  // ln2 in two parts: n * 0.693359375 is exact
  r = vsub(r, vmul(n, vset1(-2.12194440e-4f)));
  vf p = vset1(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = vfmadd(p, r, vset1(c));
  p = vfmadd(p, vmul(r, r), vadd(r, vset1(1.f)));
  return vzero_below(vmul(p, vexp2_whole(n)), x, lo);
}

// How the cache stores a (slot, kv head) row r of D elements (kv_cache/quantized.py's layers):
// F32 floats at r * D; F16/BF16 16-bit elements at r * D; I8 int8 codes at r * D times the float32
// scale at r; I4 two 4-bit codes a byte at r * D / 2 (element 2i low, 2i + 1 high), x = (q - 8) d
// with d the float16 scale of its group of 32 at r * D / 32.
enum class Stored { F32, F16, BF16, I8, I4 };

struct Cache {
  const void *k, *v;                // elements or codes
  const void *k_scales, *v_scales;  // I8: float32, I4: float16 bits; else null
  Stored kind;
};

// Row r of `data` widened into dst (D floats): exactly the values the cache layer's own reads
// give (a 16-bit element widened; a code times its scale, one rounding, as torch multiplies).
template <int D>
void widen_row(const Cache& c, const void* data, const void* scales, int64_t r, float* dst) {
  switch (c.kind) {
    case Stored::F32:
      std::copy_n(static_cast<const float*>(data) + r * D, D, dst);
      return;
    case Stored::F16: {
      const uint16_t* x = static_cast<const uint16_t*>(data) + r * D;
      for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, widen8_f16(x + d));
      return;
    }
    case Stored::BF16: {
      const uint16_t* x = static_cast<const uint16_t*>(data) + r * D;
      for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, widen8_bf16(x + d));
      return;
    }
    case Stored::I8: {
      const int8_t* x = static_cast<const int8_t*>(data) + r * D;
      const __m256 scale = _mm256_set1_ps(static_cast<const float*>(scales)[r]);
      for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(widen8_codes(x + d), scale));
      return;
    }
    case Stored::I4: {
      const uint8_t* x = static_cast<const uint8_t*>(data) + r * (D / 2);
      const uint16_t* group_scales = static_cast<const uint16_t*>(scales) + r * (D / 32);
      for (int j = 0; j < D / 32; ++j) q4_group8(x + 16 * j, _cvtsh_ss(group_scales[j]), dst + 32 * j, 8);
      return;
    }
  }
}

// Bytes of one row of D elements as stored (the codes; scales are not counted).
inline int64_t row_bytes(Stored kind, int64_t D) {
  switch (kind) {
    case Stored::F32: return 4 * D;
    case Stored::F16:
    case Stored::BF16: return 2 * D;
    case Stored::I8: return D;
    case Stored::I4: return D / 2;
  }
  return 4 * D;
}

struct Layout {
  const float* q;
  Cache cache;
  float* out;
  const int64_t *tables, *q_starts, *q_lens, *ctx_lens;
  int64_t H, KVH, D, BS, W;
  float scale;
  int64_t window;
  float softcap;  // > 0: scores soft-capped; 0: not
};

// Keys a tile holds: TILE_FLOATS / D, 16 KB of keys and 16 KB of values (in L1/L2 while every
// query vector of the task runs against them; 2048 floats measured slower for heads of 128).
// Tiles start at multiples of it in absolute positions.
constexpr int64_t TILE_FLOATS = 4096;
template <int D>
constexpr int64_t tile_keys() {
  return TILE_FLOATS / D < 16 ? 16 : TILE_FLOATS / D;
}
constexpr int PASS = 3;                   // query vectors a pass takes at most (they share each broadcast)
constexpr int64_t ROWS_BUDGET = 1 << 18;  // bytes of a task's transposed queries and outputs (L2)
constexpr int64_t MAX_GROUPS = 16;        // QT-row groups a task holds at most
constexpr bool PREFETCH = true;

// Accumulators per query vector within the register budget (HP query vectors x KP keys or
// columns, plus HP query/weight vectors and a broadcast).
template <int HP>
constexpr int per_vector() {
  return QT == 16 ? (HP == 1 ? 16 : 8) : (HP == 1 ? 8 : 4);
}

// Scores of the tile's m keys (keys: row i = position t0 + i, D floats) for HP query vectors
// qt[h] (D x QT: qt[h][d * QT + j] = query j's q[d]) into st[h] (m x QT): scale * sum_d q[d] k[d]
// (one FMA chain over d per lane; soft-capped if asked), -inf where lane j may not attend (its
// position pos[h][j]); top[h] = lane-wise maximum. KP keys at a time, each broadcast key element
// multiplies all HP query vectors (they share the kv head). open[h]: every lane attends to
// every key (no mask; the same values as the masked path). keys holds whole runs of KP rows.
template <int D, int HP>
void scores(const float* const* qt, const float* keys, int m, int64_t t0, const int32_t* const* pos, const bool* open,
            const Layout& l, float* const* st, vf* top) {
  constexpr int KP = per_vector<HP>();
  static_assert(HP * KP + HP + 1 <= REGISTERS, "register budget");
  const vf scale = vset1(l.scale), ninf = vset1(-INFINITY), cap = vset1(l.softcap);
  const bool capped = l.softcap > 0.f;
  for (int h = 0; h < HP; ++h) top[h] = ninf;
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
    for (int i = 0; i < std::min(KP, m - k0); ++i)
      for (int h = 0; h < HP; ++h) {
        vf sc = vmul(acc[h][i], scale);
        if (capped) sc = vmul(vtanh(vdiv(sc, cap)), cap);
        if (!open[h]) sc = attendable(sc, pos[h], t0 + k0 + i, l.window);
        vstore(st[h] + (k0 + i) * QT, sc);
        top[h] = vmax(top[h], sc);
      }
  }
}

// The online-softmax step of one query vector over a tile's m scores st (m x QT), lane-wise:
// new = max(*mx, top); st <- exp(st - new); *ls <- *ls * alpha + (sum over t of st, one chain);
// *mx <- new; returns alpha = exp(old - new), exactly 1 where the maximum stayed. *mx starts at
// -FLT_MAX, not -inf: a lane with nothing to attend to in the tile (scores -inf) keeps it, gets
// alpha = 1 and weights exp(-inf) = 0, so such a tile leaves the lane's state unchanged.
inline vf softmax_step(float* st, int m, vf top, float* mx, float* ls) {
  const vf old = vload(mx), now = vmax(old, top);
  vf sum = vzero();
  for (int t = 0; t < m; ++t) {
    const vf e = exp_nonpositive(vsub(vload(st + t * QT), now));
    vstore(st + t * QT, e);
    sum = vadd(sum, e);
  }
  const vf alpha = exp_nonpositive(vsub(old, now));
  vstore(ls, vfmadd(vload(ls), alpha, sum));
  vstore(mx, now);
  return alpha;
}

// ot[h] (D x QT, lane j = query j's output column) <- ot[h] * alpha[h] + sum_t w_t v_t: for
// DC columns at a time, each column's accumulator is one chain over the tile's keys t of the
// broadcast v_t[d] times the weights st[h] (m x QT); each broadcast serves all HP vectors.
// rescale false: every alpha is 1 (the multiply skipped, the same bits).
template <int D, int HP>
void values(const float* const* st, const float* vals, int m, const vf* alpha, bool rescale, float* const* ot) {
  constexpr int DC = per_vector<HP>();
  static_assert(D % DC == 0 && HP * DC + HP + 1 <= REGISTERS, "register budget");
  for (int d0 = 0; d0 < D; d0 += DC) {
    vf acc[HP][DC];
    for (int h = 0; h < HP; ++h)
      for (int i = 0; i < DC; ++i) {
        const vf o = vload(ot[h] + (d0 + i) * QT);
        acc[h][i] = rescale ? vmul(o, alpha[h]) : o;
      }
    for (int t = 0; t < m; ++t) {
      vf w[HP];
      for (int h = 0; h < HP; ++h) w[h] = vload(st[h] + t * QT);
      for (int i = 0; i < DC; ++i) {
        const vf vb = vset1(vals[t * D + d0 + i]);
        for (int h = 0; h < HP; ++h) acc[h][i] = vfmadd(vb, w[h], acc[h][i]);
      }
    }
    for (int h = 0; h < HP; ++h)
      for (int i = 0; i < DC; ++i) vstore(ot[h] + (d0 + i) * QT, acc[h][i]);
  }
}

struct Task {
  int64_t seq, group, first, rows;  // sequence, kv head, first query row of the chunk (0-based in it), rows
  int64_t cost;                      // keys x QT-row groups (for scheduling the longest first)
};

// A task's state, per thread. Query vector i = (row group i / G, head i % G of the kv head):
// qt/ot + i * D * QT its transposed queries and outputs (D x QT), mx/ls + i * QT its lane-wise
// running maximum and sum of weights; st the scores of a pass (PASS x tile x QT); keys/vals
// the tile (tile x D); pos/rows + r * QT a row group's positions and rows of q (idle lanes
// repeat the group's last row: computed, not stored); lo/hi[r] its key range, m[r] its rows.
struct alignas(sizeof(vf)) Lanes {  // one vector's floats, aligned for vload/vstore (no padding)
  float x[QT];
};
static_assert(sizeof(Lanes) == sizeof(vf), "Lanes are read as consecutive vectors");
struct Work {
  std::vector<Lanes> qt, ot, mx, ls, st;
  std::vector<float> keys, vals;
  std::vector<int32_t> pos;
  std::vector<int64_t> rows, lo, hi, m;
  static float* qv(std::vector<Lanes>& buf, int64_t i, int64_t per) { return buf.data()->x + i * per; }
};

// Rows [t0, t1) of kv head g's keys and values (the cache's (slot, kv head) rows) into keys/vals
// as float32 (widen_row).
template <int D>
void copy_tile(const Layout& l, int64_t s, int64_t g, int64_t t0, int64_t t1, Work& w) {
  const int64_t* table = l.tables + s * l.W;
  const Cache& c = l.cache;
  int64_t block = t0 / l.BS, offset = t0 % l.BS;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t r = (table[block] * l.BS + offset) * l.KVH + g;
    widen_row<D>(c, c.k, c.k_scales, r, w.keys.data() + (t - t0) * D);
    widen_row<D>(c, c.v, c.v_scales, r, w.vals.data() + (t - t0) * D);
    if (++offset == l.BS) offset = 0, ++block;
  }
}

// Asks for rows [t0, t1) of kv head g's keys and values to be brought into L2 (the next tile,
// fetched while this one is computed: at long contexts they come from DRAM).
template <int D>
void prefetch_tile(const Layout& l, int64_t s, int64_t g, int64_t t0, int64_t t1) {
  const int64_t* table = l.tables + s * l.W;
  const int64_t bytes = row_bytes(l.cache.kind, D);
  const char *k = static_cast<const char*>(l.cache.k), *v = static_cast<const char*>(l.cache.v);
  int64_t block = t0 / l.BS, offset = t0 % l.BS;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t at = ((table[block] * l.BS + offset) * l.KVH + g) * bytes;
    for (int64_t b = 0; b < bytes; b += 64) {
      _mm_prefetch(k + at + b, _MM_HINT_T1);
      _mm_prefetch(v + at + b, _MM_HINT_T1);
    }
    if (++offset == l.BS) offset = 0, ++block;
  }
}

// One pass: query vectors [i0, i0 + HP) against the tile [t0, t0 + m).
template <int D, int HP>
void pass(const Layout& l, Work& w, int64_t G, int64_t i0, int64_t t0, int m) {
  const float* qts[HP];
  float *sts[HP], *ots[HP];
  const int32_t* pos[HP];
  bool open[HP];
  vf top[HP], alpha[HP];
  for (int h = 0; h < HP; ++h) {
    const int64_t i = i0 + h, r = i / G;
    qts[h] = w.qv(w.qt, i, D * QT), ots[h] = w.qv(w.ot, i, D * QT), sts[h] = w.qv(w.st, h, tile_keys<D>() * QT);
    pos[h] = w.pos.data() + r * QT;
    open[h] = t0 + m - 1 <= pos[h][0] && (l.window <= 0 || t0 > pos[h][QT - 1] - l.window);
  }
  scores<D, HP>(qts, w.keys.data(), m, t0, pos, open, l, sts, top);
  bool rescale = false;
  for (int h = 0; h < HP; ++h) {
    alpha[h] = softmax_step(sts[h], m, top[h], w.qv(w.mx, i0 + h, QT), w.qv(w.ls, i0 + h, QT));
    alignas(64) float a[QT];
    vstore(a, alpha[h]);
    for (int j = 0; j < QT; ++j) rescale |= a[j] != 1.f;
  }
  values<D, HP>(sts, w.vals.data(), m, alpha, rescale, ots);
}

// The task's row groups (QT rows each) of every head reading kv head task.group: query vectors
// transposed, then key tiles in order, each copied once and run against every query vector
// whose rows attend to some of its keys (passes of up to PASS vectors), then the outputs.
template <int D>
void run_task(const Task& task, const Layout& l, Work& w) {
  constexpr int64_t TK = tile_keys<D>();
  const int64_t s = task.seq, g = task.group, G = l.H / l.KVH;
  const int64_t q_len = l.q_lens[s], base = l.ctx_lens[s] - q_len;
  const int64_t R = (task.rows + QT - 1) / QT, NQ = R * G;
  Lanes lowest;
  std::fill_n(lowest.x, QT, -FLT_MAX);
  w.qt.resize(NQ * D), w.ot.assign(NQ * D, Lanes{}), w.mx.assign(NQ, lowest), w.ls.assign(NQ, Lanes{});
  w.st.resize(PASS * TK), w.keys.resize(TK * D), w.vals.resize(TK * D);
  w.pos.resize(R * QT), w.rows.resize(R * QT), w.lo.resize(R), w.hi.resize(R), w.m.resize(R);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t first = task.first + r * QT, m = w.m[r] = std::min<int64_t>(QT, q_len - first);
    for (int64_t j = 0; j < QT; ++j) {
      w.rows[r * QT + j] = l.q_starts[s] + first + std::min(j, m - 1);
      w.pos[r * QT + j] = static_cast<int32_t>(base + first + std::min(j, m - 1));
    }
    w.lo[r] = l.window > 0 ? std::max<int64_t>(0, w.pos[r * QT] - l.window + 1) : 0;
    w.hi[r] = w.pos[r * QT + QT - 1] + 1;
    for (int64_t h = 0; h < G; ++h) {
      float* qt = w.qv(w.qt, r * G + h, D * QT);
      for (int64_t j = 0; j < QT; ++j) {
        const float* qr = l.q + (w.rows[r * QT + j] * l.H + g * G + h) * D;
        for (int d = 0; d < D; ++d) qt[d * QT + j] = qr[d];
      }
    }
  }
  // lo and hi grow with r: the groups a tile concerns are a run [ra, rb).
  for (int64_t t0 = w.lo[0], ra = 0, rb = 0; t0 < w.hi[R - 1];) {
    const int64_t t1 = std::min((t0 / TK + 1) * TK, w.hi[R - 1]);
    while (w.hi[ra] <= t0) ++ra;
    while (rb < R && w.lo[rb] < t1) ++rb;
    copy_tile<D>(l, s, g, t0, t1, w);
    if (PREFETCH) prefetch_tile<D>(l, s, g, t1, std::min(t1 + TK, w.hi[R - 1]));
    const int m = static_cast<int>(t1 - t0);
    for (int64_t i = ra * G; i < rb * G;) {
      const int64_t left = rb * G - i;
      if (left >= PASS) pass<D, PASS>(l, w, G, i, t0, m), i += PASS;
      else if (left == 2) pass<D, 2>(l, w, G, i, t0, m), i += 2;
      else pass<D, 1>(l, w, G, i, t0, m), i += 1;
    }
    t0 = t1;
  }
  for (int64_t i = 0; i < NQ; ++i) {
    const int64_t r = i / G, h = g * G + i % G;
    const float *ot = w.qv(w.ot, i, D * QT), *ls = w.qv(w.ls, i, QT);
    for (int64_t j = 0; j < w.m[r]; ++j) {
      float* o = l.out + (w.rows[r * QT + j] * l.H + h) * D;
      for (int d = 0; d < D; ++d) o[d] = ot[d * QT + j] / ls[j];
    }
  }
}

template <int D>
void run_all(const std::vector<Task>& tasks, const Layout& l) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {  // each thread pulls tasks
    Work w;
    for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) run_task<D>(tasks[i], l, w);
  });
}

// Tasks of up to `groups` QT-row groups of one sequence x one kv head, longest first.
std::vector<Task> make_tasks(const int64_t* lens, const int64_t* ctxs, int64_t S, int64_t KVH, int64_t window,
                             int64_t groups) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t first = 0; first < lens[s]; first += groups * QT) {
      const int64_t rows = std::min(lens[s] - first, groups * QT);
      int64_t cost = 0;
      for (int64_t r = first; r < first + rows; r += QT) {
        const int64_t hi = ctxs[s] - lens[s] + std::min(lens[s], r + QT);
        cost += hi - (window > 0 ? std::max<int64_t>(0, ctxs[s] - lens[s] + r - window + 1) : 0);
      }
      for (int64_t g = 0; g < KVH; ++g) tasks.push_back({s, g, first, rows, cost});
    }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

// The most row groups a task may hold: its queries and outputs within ROWS_BUDGET, and no task
// above a quarter of a thread's share (the longest first, the rest fill in behind). A row's
// result does not depend on it.
std::vector<Task> balanced_tasks(const int64_t* lens, const int64_t* ctxs, int64_t S, int64_t KVH, int64_t G,
                                 int64_t D, int64_t window) {
  int64_t groups = std::clamp<int64_t>(ROWS_BUDGET / (G * D * QT * 8), 1, MAX_GROUPS);
  const int64_t threads = at::get_num_threads();
  for (;; groups = (groups + 1) / 2) {
    std::vector<Task> tasks = make_tasks(lens, ctxs, S, KVH, window, groups);
    int64_t total = 0;
    for (const Task& t : tasks) total += t.cost;
    if (groups == 1 || tasks[0].cost * 4 * threads <= total) return tasks;
  }
}

// The cache's storage from its arrays (Stored's layouts), checked: k_cache/v_cache alike,
// (blocks, block_size, kv_heads, D) float32, float16 or bfloat16, or int8 with (blocks, block_size,
// kv_heads) float32 scales, or uint8 (blocks, block_size, kv_heads, D / 2) int4 codes with (...,
// D / 32) float16 scales.
Cache stored_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scales,
                   const c10::optional<at::Tensor>& v_scales, int64_t D) {
  const auto type = k_cache.scalar_type();
  const bool coded = type == at::kChar || type == at::kByte;
  TORCH_CHECK(k_cache.dim() == 4, "caches must be (blocks, block_size, kv_heads, head_dim)");
  TORCH_CHECK(coded == (k_scales.has_value() && v_scales.has_value()), "int8 and int4 caches need their scales, no other");
  if (type == at::kChar) {
    check_int8_cache(k_cache, *k_scales, v_cache, *v_scales);
  } else if (type == at::kByte) {
    check_int4_cache(k_cache, *k_scales, v_cache, *v_scales, D);
  } else if (type == at::kHalf || type == at::kBFloat16) {
    check_half_cache(k_cache, v_cache);
  } else {
    TORCH_CHECK(type == at::kFloat, "caches must be float32, float16, bfloat16, int8 or uint8 (int4)");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == type &&
                    v_cache.is_contiguous(),
                "caches must be contiguous (blocks, block_size, kv_heads, head_dim) and alike");
  }
  TORCH_CHECK(k_cache.size(3) == (type == at::kByte ? D / 2 : D), "head_dim disagrees with the cache");
  const Stored kind = type == at::kFloat  ? Stored::F32
                      : type == at::kHalf ? Stored::F16
                      : type == at::kBFloat16 ? Stored::BF16
                      : type == at::kChar ? Stored::I8
                                          : Stored::I4;
  const void* ks = coded ? k_scales->data_ptr() : nullptr;
  const void* vs = coded ? v_scales->data_ptr() : nullptr;
  return {k_cache.data_ptr(), v_cache.data_ptr(), ks, vs, kind};
}

// Writes the rows of the listed sequences into out (T, H, D); other rows are left as they are.
// The caches are read as stored_cache describes (a stored format widened tile by tile).
void paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                   const at::Tensor& q_starts, const at::Tensor& q_lens, const at::Tensor& ctx_lens, double scale,
                   int64_t window, double softcap, at::Tensor& out, const c10::optional<at::Tensor>& k_scales,
                   const c10::optional<at::Tensor>& v_scales) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous (T, H, D) float32");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out must be contiguous float32 shaped like q");
  const Cache cache = stored_cache(k_cache, v_cache, k_scales, v_scales, q.size(2));
  const int64_t S = tables.size(0), T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous(), "tables must be (S, W) int64");
  for (const at::Tensor* t : {&q_starts, &q_lens, &ctx_lens})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == S && t->scalar_type() == at::kLong && t->is_contiguous(),
                "q_starts, q_lens and ctx_lens must be (S,) int64");
  TORCH_CHECK(H % KVH == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(D == 32 || D == 64 || D == 128 || D == 256, "paged_prefill: head_dim must be 32, 64, 128 or 256");
  const int64_t *starts = q_starts.data_ptr<int64_t>(), *lens = q_lens.data_ptr<int64_t>(),
                *ctxs = ctx_lens.data_ptr<int64_t>();
  const int64_t BS = k_cache.size(1), W = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= ctxs[s] && ctxs[s] <= W * BS && starts[s] >= 0 && starts[s] + lens[s] <= T,
                "sequence ", s, ": query rows or context length out of range");
    for (int64_t b = 0; b < (ctxs[s] + BS - 1) / BS; ++b)
      TORCH_CHECK(table[s * W + b] >= 0 && table[s * W + b] < k_cache.size(0), "sequence ", s, ": block id out of range");
  }
  if (S == 0) return;
  const std::vector<Task> tasks = balanced_tasks(lens, ctxs, S, KVH, H / KVH, D, window);
  const Layout l{q.data_ptr<float>(), cache, out.data_ptr<float>(), table, starts, lens, ctxs, H, KVH, D, BS, W,
                 static_cast<float>(scale), window, static_cast<float>(softcap)};
  if (D == 64) run_all<64>(tasks, l);
  else if (D == 128) run_all<128>(tasks, l);
  else if (D == 256) run_all<256>(tasks, l);
  else run_all<32>(tasks, l);
}

}  // namespace

TORCH_LIBRARY(TOKENLOOM_PREFILL_LIBRARY, m) {
  m.def("paged_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor q_starts, Tensor q_lens, "
        "Tensor ctx_lens, float scale, int window, float softcap, Tensor(a!) out, Tensor? k_scales=None, "
        "Tensor? v_scales=None) -> ()");
}

TORCH_LIBRARY_IMPL(TOKENLOOM_PREFILL_LIBRARY, CPU, m) {
  m.impl("paged_prefill", &paged_prefill);
}
