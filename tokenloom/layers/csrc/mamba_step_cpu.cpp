// One decode step of a hybrid's recurrent layer for S sequences, their states in slot caches and
// each state row read and written once: Mamba-2's two recurrences (conv_step, ssm_step, or the
// whole mixer in mamba_decode) and Gated DeltaNet's (deltanet_decode).
//
// conv_step: the causal depthwise conv (layers/causal_conv.py): out[s,c] = bias[c] + the K taps of
// channel c over the sequence's last K - 1 inputs (its state, zeros where keep[s] == 0) and x[s,c];
// the state then shifts in x.
//
// ssm_step: the selective state space (layers/ssm_scan.py says the recurrence):
//   H[s,h,p,:] = exp(dt[s,h] A[h]) H[s,h,p,:] + dt[s,h] x[s,h,p] B[s,g,:]      (g: head h's group)
//   y[s,h,p]   = H[s,h,p,:] . C[s,g,:]
// The states live in a slot cache (slots, H, P, N) float32; sequence s's is row slots[s], started
// from zero where keep[s] == 0 (a one-token prompt). One task per (sequence, head).
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "../../kernels/include/int8_dot.h"
#include "../../kernels/include/silu_mul_row.h"

namespace {

using tokenloom_int8::hsum;

// One (sequence, head): P rows of N state values.
void head_step(float* state, const float* x, float dt, float decay, const float* B, const float* C, float* y,
               int64_t P, int64_t N, bool keep) {
  const __m256 vdecay = _mm256_set1_ps(decay);
  for (int64_t p = 0; p < P; ++p) {
    float* row = state + p * N;
    const __m256 vin = _mm256_set1_ps(dt * x[p]);
    __m256 acc = _mm256_setzero_ps();
    int64_t n = 0;
    for (; n + 8 <= N; n += 8) {
      const __m256 b = _mm256_loadu_ps(B + n);
      const __m256 old = keep ? _mm256_loadu_ps(row + n) : _mm256_setzero_ps();
      const __m256 h = _mm256_fmadd_ps(old, vdecay, _mm256_mul_ps(vin, b));
      _mm256_storeu_ps(row + n, h);
      acc = _mm256_fmadd_ps(h, _mm256_loadu_ps(C + n), acc);
    }
    float tail = 0.0f;
    for (; n < N; ++n) {
      const float h = (keep ? row[n] : 0.0f) * decay + dt * x[p] * B[n];
      row[n] = h;
      tail += h * C[n];
    }
    y[p] = hsum(acc) + tail;
  }
}

at::Tensor conv_step(at::Tensor& states, const at::Tensor& slots, const at::Tensor& keep, const at::Tensor& x,
                     const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(states.dim() == 3 && states.scalar_type() == at::kFloat && states.is_contiguous(),
              "states must be contiguous (slots, channels, K - 1) float32");
  const int64_t S = x.size(0), Cn = states.size(1), W = states.size(2), num_slots = states.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == Cn && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be (S, channels) float32 with unit column stride");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == Cn * (W + 1),
              "weight must be contiguous (channels, 1, K) float32");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == Cn),
              "bias must be (channels,) float32");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == S && slots.is_contiguous(),
              "slots must be contiguous (S,) int64");
  TORCH_CHECK(keep.scalar_type() == at::kFloat && keep.numel() == S && keep.is_contiguous(), "keep must be (S,) float32");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) TORCH_CHECK(slot[s] >= 0 && slot[s] < num_slots, "a slot is out of range");
  at::Tensor out = at::empty({S, Cn}, x.options());
  float* sp = states.data_ptr<float>();
  const float *wp = weight.data_ptr<float>(), *bp = bias ? bias->data_ptr<float>() : nullptr;
  const float *kp = keep.data_ptr<float>(), *xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      float* st = sp + slot[s] * Cn * W;
      const float* xs = xp + s * ldx;
      const bool keep_state = kp[s] != 0.0f;
      for (int64_t c = 0; c < Cn; ++c) {
        float* row = st + c * W;
        const float* w = wp + c * (W + 1);
        float acc = 0.0f;
        for (int64_t k = 0; k < W; ++k) {  // the taps in order, as (window * weight).sum(-1) adds them
          const float v = keep_state ? row[k] : 0.0f;
          acc += w[k] * v;
          if (k > 0) row[k - 1] = v;
        }
        acc += w[W] * xs[c];
        if (W > 0) row[W - 1] = xs[c];
        op[s * Cn + c] = bp ? acc + bp[c] : acc;
      }
    }
  });
  return out;
}

// conv_step, then SiLU over its output in place: the mixers' conv and activation in one pass.
at::Tensor conv_silu_step(at::Tensor& states, const at::Tensor& slots, const at::Tensor& keep, const at::Tensor& x,
                          const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  at::Tensor out = conv_step(states, slots, keep, x, weight, bias);
  float* op = out.data_ptr<float>();
  const int64_t S = out.size(0), Cn = out.size(1);
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      float* row = op + s * Cn;
      int64_t c = 0;
      for (; c + 8 <= Cn; c += 8) _mm256_storeu_ps(row + c, tokenloom_silu::silu8(_mm256_loadu_ps(row + c)));
      for (; c < Cn; ++c) row[c] = row[c] / (1.f + std::exp(-row[c]));
    }
  });
  return out;
}

at::Tensor ssm_step(at::Tensor& states, const at::Tensor& slots, const at::Tensor& keep, const at::Tensor& x,
                    const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C) {
  TORCH_CHECK(states.dim() == 4 && states.scalar_type() == at::kFloat && states.is_contiguous(),
              "states must be contiguous (slots, heads, head_dim, N) float32");
  const int64_t H = states.size(1), P = states.size(2), N = states.size(3), S = x.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3 && x.size(1) == H && x.size(2) == P,
              "x must be contiguous (S, heads, head_dim) float32");
  TORCH_CHECK(dt.scalar_type() == at::kFloat && dt.is_contiguous() && dt.sizes() == at::IntArrayRef({S, H}),
              "dt must be contiguous (S, heads) float32");
  TORCH_CHECK(A.scalar_type() == at::kFloat && A.is_contiguous() && A.numel() == H, "A must be (heads,) float32");
  TORCH_CHECK(B.scalar_type() == at::kFloat && B.is_contiguous() && B.dim() == 3 && B.size(0) == S && B.size(2) == N &&
                  B.size(1) > 0 && H % B.size(1) == 0,
              "B must be contiguous (S, groups, N) float32 with the groups dividing the heads");
  TORCH_CHECK(C.sizes() == B.sizes() && C.scalar_type() == at::kFloat && C.is_contiguous(), "C must be like B");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == S && slots.is_contiguous(),
              "slots must be contiguous (S,) int64");
  TORCH_CHECK(keep.scalar_type() == at::kFloat && keep.numel() == S && keep.is_contiguous(), "keep must be (S,) float32");
  const int64_t G = B.size(1), per_group = H / G, num_slots = states.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) TORCH_CHECK(slot[s] >= 0 && slot[s] < num_slots, "a slot is out of range");
  at::Tensor y = at::empty({S, H, P}, x.options());
  float* sp = states.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *ap = A.data_ptr<float>();
  const float *bp = B.data_ptr<float>(), *cp = C.data_ptr<float>(), *kp = keep.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, S * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / H, h = task % H, g = h / per_group;
      const float step = dtp[s * H + h];
      head_step(sp + (slot[s] * H + h) * P * N, xp + (s * H + h) * P, step, std::exp(step * ap[h]),
                bp + (s * G + g) * N, cp + (s * G + g) * N, yp + (s * H + h) * P, P, N, kp[s] != 0.0f);
    }
  });
  return y;
}

// softplus(v) as torch computes it (beta 1, threshold 20), clamped to [lo, hi].
inline float softplus_clamped(float v, float lo, float hi) {
  const float sp = v > 20.0f ? v : std::log1p(std::exp(v));
  return std::min(std::max(sp, lo), hi);
}

// y (S, inner) in place -> w * rms_norm(y * silu(z)) over each of G equal groups of a row (z: rows
// of stride ldz); transformers' RMSNormGated.
void gated_group_norm(float* y, const float* z, int64_t ldz, const float* w, int64_t S, int64_t inner, int64_t G,
                      float eps) {
  const int64_t width = inner / G;
  at::parallel_for(0, S * G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / G, g = task % G;
      float* v = y + s * inner + g * width;
      const float* zg = z + s * ldz + g * width;
      double squares = 0.0;
      for (int64_t i = 0; i < width; ++i) {
        v[i] *= zg[i] / (1.f + std::exp(-zg[i]));
        squares += static_cast<double>(v[i]) * v[i];
      }
      const float inv = 1.0f / std::sqrt(static_cast<float>(squares / width) + eps);
      for (int64_t i = 0; i < width; ++i) v[i] = w[g * width + i] * (v[i] * inv);
    }
  });
}

// A whole Mamba-2 decode step between in_proj and out_proj for S sequences (layers/mamba2.py):
// zxbcdt (S, inner + conv_dim + heads) -> (S, inner) =
//   norm_w * group_rms_norm(y * silu(z)),  y = ssm(x, dt, A, B, C) + D x,
//   [x, B, C] = silu(conv(xBC)),  dt = clamp(softplus(dt + dt_bias), dt_min, dt_max);
// the conv and SSM states of rows `slots` advanced in place (from zero where keep[s] == 0).
at::Tensor mamba_decode(const at::Tensor& zxbcdt, at::Tensor& conv_states, at::Tensor& ssm_states,
                        const at::Tensor& slots, const at::Tensor& keep, const at::Tensor& conv_w,
                        const c10::optional<at::Tensor>& conv_b, const at::Tensor& dt_bias, const at::Tensor& A,
                        const at::Tensor& D, const at::Tensor& norm_w, int64_t groups, double eps, double dt_min,
                        double dt_max) {
  TORCH_CHECK(ssm_states.dim() == 4 && ssm_states.scalar_type() == at::kFloat && ssm_states.is_contiguous(),
              "ssm_states must be contiguous (slots, heads, head_dim, N) float32");
  const int64_t H = ssm_states.size(1), P = ssm_states.size(2), N = ssm_states.size(3), inner = H * P;
  const int64_t conv_dim = conv_states.size(1), S = zxbcdt.size(0), G = groups;
  TORCH_CHECK(G > 0 && H % G == 0 && conv_dim == inner + 2 * G * N, "conv channels must be inner + 2 groups N");
  TORCH_CHECK(zxbcdt.dim() == 2 && zxbcdt.scalar_type() == at::kFloat && zxbcdt.stride(1) == 1 &&
                  zxbcdt.size(1) == inner + conv_dim + H,
              "zxbcdt must be (S, inner + conv_dim + heads) float32 with unit column stride");
  for (const at::Tensor* t : {&dt_bias, &A, &D})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == H, "dt_bias, A, D must be (heads,)");
  TORCH_CHECK(norm_w.scalar_type() == at::kFloat && norm_w.is_contiguous() && norm_w.numel() == inner,
              "norm_w must be (inner,) float32");
  TORCH_CHECK(conv_states.size(0) == ssm_states.size(0), "the conv and SSM state caches must hold the same slots");
  // the conv step: x, B, C before their SiLU, the states shifted
  const at::Tensor xbc = conv_silu_step(conv_states, slots, keep, zxbcdt.narrow(1, inner, conv_dim), conv_w, conv_b);
  float* xp = xbc.data_ptr<float>();
  at::Tensor y = at::empty({S, inner}, zxbcdt.options());
  float* yp = y.data_ptr<float>();
  float* sp = ssm_states.data_ptr<float>();
  const float *zp = zxbcdt.data_ptr<float>(), *bias = dt_bias.data_ptr<float>(), *ap = A.data_ptr<float>();
  const float *dp = D.data_ptr<float>(), *kp = keep.data_ptr<float>(), *wp = norm_w.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t ldz = zxbcdt.stride(0), per_group = H / G;
  at::parallel_for(0, S * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / H, h = task % H, g = h / per_group;
      const float dt = softplus_clamped(zp[s * ldz + inner + conv_dim + h] + bias[h], dt_min, dt_max);
      const float* x = xp + s * conv_dim + h * P;
      const float* B = xp + s * conv_dim + inner + g * N;
      float* out = yp + s * inner + h * P;
      head_step(sp + (slot[s] * H + h) * P * N, x, dt, std::exp(dt * ap[h]), B, B + G * N, out, P, N, kp[s] != 0.0f);
      for (int64_t p = 0; p < P; ++p) out[p] += dp[h] * x[p];
    }
  });
  gated_group_norm(yp, zp, ldz, wp, S, inner, G, static_cast<float>(eps));
  return y;
}

// One (sequence, value head) of the gated delta rule (layers/delta_rule.py): state (dk, dv),
// forget = exp(g) (0 where the sequence starts from zero):
//   S' = forget S;  u = beta (v - S'^T k);  S = S' + k u^T;  o = S^T q
// Two passes over the state (the second from cache): S'^T k, then the update and S^T q.
void delta_head_step(float* state, const float* q, const float* k, const float* v, float beta, float forget,
                     float* o, int64_t dk, int64_t dv) {
  float read[256], u[256];  // dv <= 256 (checked)
  for (int64_t j = 0; j < dv; ++j) read[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = state + i * dv;
    const float ki = k[i] * forget;
    int64_t j = 0;
    for (; j + 8 <= dv; j += 8)
      _mm256_storeu_ps(read + j, _mm256_fmadd_ps(_mm256_loadu_ps(row + j), _mm256_set1_ps(ki), _mm256_loadu_ps(read + j)));
    for (; j < dv; ++j) read[j] += row[j] * ki;
  }
  for (int64_t j = 0; j < dv; ++j) {
    u[j] = beta * (v[j] - read[j]);
    o[j] = 0.0f;
  }
  const __m256 vforget = _mm256_set1_ps(forget);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = state + i * dv;
    const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
    int64_t j = 0;
    for (; j + 8 <= dv; j += 8) {
      const __m256 h = _mm256_fmadd_ps(ki, _mm256_loadu_ps(u + j), _mm256_mul_ps(_mm256_loadu_ps(row + j), vforget));
      _mm256_storeu_ps(row + j, h);
      _mm256_storeu_ps(o + j, _mm256_fmadd_ps(h, qi, _mm256_loadu_ps(o + j)));
    }
    for (; j < dv; ++j) {
      const float h = row[j] * forget + k[i] * u[j];
      row[j] = h;
      o[j] += h * q[i];
    }
  }
}

// x (n,) in place -> x / sqrt(sum x^2 + eps) * scale (transformers' l2norm, then the query's scale).
void l2_normalize(float* x, int64_t n, float eps, float scale) {
  float squares = 0.0f;
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float inv = scale / std::sqrt(squares + eps);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

// A whole Gated DeltaNet decode step between the input projections and out_proj for S sequences
// (layers/gated_deltanet.py): qkvz (S, 2 Hk dk + 2 Hv dv), ba (S, 2 Hv) -> (S, Hv dv) =
//   norm_w * rms_norm_per_head(o) * silu(z),  o = delta_rule(q / sqrt(dk), k, v, g, beta),
//   [q, k, v] = silu(conv(qkv)), q and k L2-normed per key head (each serving Hv / Hk value heads),
//   beta = sigmoid(b),  g = A softplus(a + dt_bias)  (A = -exp(A_log));
// the conv and delta states of rows `slots` advanced in place (from zero where keep[s] == 0).
at::Tensor deltanet_decode(const at::Tensor& qkvz, const at::Tensor& ba, at::Tensor& conv_states,
                           at::Tensor& delta_states, const at::Tensor& slots, const at::Tensor& keep,
                           const at::Tensor& conv_w, const at::Tensor& dt_bias, const at::Tensor& A,
                           const at::Tensor& norm_w, int64_t key_heads, double eps) {
  TORCH_CHECK(delta_states.dim() == 4 && delta_states.scalar_type() == at::kFloat && delta_states.is_contiguous(),
              "delta_states must be contiguous (slots, value heads, dk, dv) float32");
  const int64_t Hv = delta_states.size(1), dk = delta_states.size(2), dv = delta_states.size(3), Hk = key_heads;
  const int64_t conv_dim = conv_states.size(1), value_dim = Hv * dv, S = qkvz.size(0);
  TORCH_CHECK(Hk > 0 && Hv % Hk == 0 && conv_dim == 2 * Hk * dk + value_dim && dv <= 256,
              "conv channels must be 2 key_heads dk + value heads dv (dv <= 256)");
  TORCH_CHECK(qkvz.dim() == 2 && qkvz.scalar_type() == at::kFloat && qkvz.stride(1) == 1 &&
                  qkvz.size(1) == conv_dim + value_dim,
              "qkvz must be (S, conv_dim + value heads dv) float32 with unit column stride");
  TORCH_CHECK(ba.dim() == 2 && ba.scalar_type() == at::kFloat && ba.stride(1) == 1 && ba.size(0) == S &&
                  ba.size(1) == 2 * Hv,
              "ba must be (S, 2 value heads) float32 with unit column stride");
  for (const at::Tensor* t : {&dt_bias, &A})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == Hv, "dt_bias, A must be (Hv,)");
  TORCH_CHECK(norm_w.scalar_type() == at::kFloat && norm_w.is_contiguous() && norm_w.numel() == dv,
              "norm_w must be (dv,) float32");
  TORCH_CHECK(conv_states.size(0) == delta_states.size(0), "the conv and delta state caches must hold the same slots");
  const at::Tensor x = conv_silu_step(conv_states, slots, keep, qkvz.narrow(1, 0, conv_dim), conv_w, c10::nullopt);
  float* xp = x.data_ptr<float>();
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      float* row = xp + s * conv_dim;
      for (int64_t h = 0; h < Hk; ++h) {
        l2_normalize(row + h * dk, dk, 1e-6f, q_scale);
        l2_normalize(row + (Hk + h) * dk, dk, 1e-6f, 1.0f);
      }
    }
  });
  at::Tensor out = at::empty({S, value_dim}, qkvz.options());
  float *op = out.data_ptr<float>(), *sp = delta_states.data_ptr<float>();
  const float *zp = qkvz.data_ptr<float>(), *bap = ba.data_ptr<float>(), *bias = dt_bias.data_ptr<float>();
  const float *ap = A.data_ptr<float>(), *kp = keep.data_ptr<float>(), *wp = norm_w.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t ldz = qkvz.stride(0), ldba = ba.stride(0), per_key = Hv / Hk;
  at::parallel_for(0, S * Hv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / Hv, h = task % Hv, hk = h / per_key;
      const float b = bap[s * ldba + h], a = bap[s * ldba + Hv + h] + bias[h];
      const float beta = 1.0f / (1.0f + std::exp(-b));
      const float softplus = a > 20.0f ? a : std::log1p(std::exp(a));
      const float forget = kp[s] != 0.0f ? std::exp(ap[h] * softplus) : 0.0f;
      const float* row = xp + s * conv_dim;
      float* o = op + s * value_dim + h * dv;
      delta_head_step(sp + (slot[s] * Hv + h) * dk * dv, row + hk * dk, row + (Hk + hk) * dk,
                      row + 2 * Hk * dk + h * dv, beta, forget, o, dk, dv);
      float squares = 0.0f;  // the gated norm: o normed over the head, times w and silu(z)
      for (int64_t j = 0; j < dv; ++j) squares += o[j] * o[j];
      const float inv = 1.0f / std::sqrt(squares / dv + static_cast<float>(eps));
      const float* z = zp + s * ldz + conv_dim + h * dv;
      for (int64_t j = 0; j < dv; ++j) o[j] = wp[j] * (o[j] * inv) * (z[j] / (1.f + std::exp(-z[j])));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenloom_ssm, m) {
  m.def(
      "mamba_decode(Tensor zxbcdt, Tensor(a!) conv_states, Tensor(b!) ssm_states, Tensor slots, Tensor keep, "
      "Tensor conv_w, Tensor? conv_b, Tensor dt_bias, Tensor A, Tensor D, Tensor norm_w, int groups, float eps, "
      "float dt_min, float dt_max) -> Tensor");
  m.def("conv_step(Tensor(a!) states, Tensor slots, Tensor keep, Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "deltanet_decode(Tensor qkvz, Tensor ba, Tensor(a!) conv_states, Tensor(b!) delta_states, Tensor slots, "
      "Tensor keep, Tensor conv_w, Tensor dt_bias, Tensor A, Tensor norm_w, int key_heads, float eps) -> Tensor");
  m.def(
      "ssm_step(Tensor(a!) states, Tensor slots, Tensor keep, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_ssm, CPU, m) {
  m.impl("conv_step", &conv_step);
  m.impl("mamba_decode", &mamba_decode);
  m.impl("deltanet_decode", &deltanet_decode);
  m.impl("ssm_step", &ssm_step);
}
