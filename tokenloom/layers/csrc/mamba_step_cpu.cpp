// One decode step of a Mamba-2 layer's two recurrences for S sequences, their states in slot caches
// and each state row read and written once.
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
  const at::Tensor xbc = conv_step(conv_states, slots, keep, zxbcdt.narrow(1, inner, conv_dim), conv_w, conv_b);
  float* xp = xbc.data_ptr<float>();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      float* row = xp + s * conv_dim;
      int64_t c = 0;
      for (; c + 8 <= conv_dim; c += 8) _mm256_storeu_ps(row + c, tokenloom_silu::silu8(_mm256_loadu_ps(row + c)));
      for (; c < conv_dim; ++c) row[c] = row[c] / (1.f + std::exp(-row[c]));
    }
  });
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

}  // namespace

TORCH_LIBRARY(tokenloom_ssm, m) {
  m.def(
      "mamba_decode(Tensor zxbcdt, Tensor(a!) conv_states, Tensor(b!) ssm_states, Tensor slots, Tensor keep, "
      "Tensor conv_w, Tensor? conv_b, Tensor dt_bias, Tensor A, Tensor D, Tensor norm_w, int groups, float eps, "
      "float dt_min, float dt_max) -> Tensor");
  m.def("conv_step(Tensor(a!) states, Tensor slots, Tensor keep, Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "ssm_step(Tensor(a!) states, Tensor slots, Tensor keep, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(tokenloom_ssm, CPU, m) {
  m.impl("conv_step", &conv_step);
  m.impl("mamba_decode", &mamba_decode);
  m.impl("ssm_step", &ssm_step);
}
