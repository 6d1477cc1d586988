// GGUF Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and MXFP4 rows re-laid in the 16-row panels the panel kernel reads
// (quant/gguf/panels.py states the layout and keeps a numpy re-lay of the same bits for builds
// without these kernels). One pass over the file's bytes, panels spread over torch's threads:
// a load's re-lay costs about a read of the weights, not numpy's many temporaries.
//
// For output rows r = 16 p + n of one panel p and each 32-value block b of a row:
//   lo[p, b, c, 4 n + i]  = code[8 c + i] & 15  |  (code[8 c + 4 + i] & 15) << 4       (c, i < 4)
//   hi[p, b, j, 4 n + i]  = sum over c < 4, h < 2 of bit (4 + j) of code[8 c + 4 h + i] << (2 c + h)
//   scale[p, b, n] (per-16 types: scale[p, b, half, n]), offset likewise; K-quants' super-block
//   factors dsup[p, b / 8, n] = d and msup[p, b / 8, n] = -dmin.
// Codes are unsigned (0..15, 0..31 or 0..63; MXFP4's are its 4-bit indices into its value table,
// scale its e8m0 byte); zero points and tables are the kernel's business.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace tokenloom_relay {

constexpr int64_t kPanel = 16;
enum Kind : int64_t { Q5_0 = 6, Q5_1 = 7, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };

inline bool is_k_quant(int64_t kind) { return kind == Q4_K || kind == Q5_K || kind == Q6_K; }

inline uint16_t half_bits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

inline float half_value(const uint8_t* p) { return _cvtsh_ss(half_bits(p)); }

// Q4_K / Q5_K: the 6-bit scale and min of sub-block s (0..7) from the 12 packed bytes q.
template <typename T>
inline void scale_min_k4(int s, const uint8_t* q, T& sc, T& mn) {
  if (s < 4) {
    sc = q[s] & 63;
    mn = q[s + 4] & 63;
  } else {
    sc = (q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4);
    mn = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
  }
}

// The 32 codes of 32-value block b of one row (`row` points at the row's first byte).
inline void block_codes(int64_t kind, const uint8_t* row, int64_t b, uint8_t* code) {
  if (kind == MXFP4) {  // 17 bytes: e8m0 scale, then byte j holds index j (low) and j + 16 (high)
    const uint8_t* qs = row + b * 17 + 1;
    for (int j = 0; j < 16; ++j) {
      code[j] = qs[j] & 0xF;
      code[j + 16] = qs[j] >> 4;
    }
    return;
  }
  if (kind == Q5_0 || kind == Q5_1) {
    const uint8_t* blk = row + b * (kind == Q5_0 ? 22 : 24);
    const uint8_t* qs = blk + (kind == Q5_0 ? 6 : 8);
    uint32_t qh;
    std::memcpy(&qh, qs - 4, 4);
    for (int j = 0; j < 16; ++j) {
      code[j] = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
      code[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    }
    return;
  }
  const int s = static_cast<int>(b % 8);
  if (kind == Q6_K) {
    const uint8_t* blk = row + (b / 8) * 210;
    const int n = s / 4, j = s % 4;
    const uint8_t* ql = blk + n * 64 + (j & 1) * 32;
    const uint8_t* qh = blk + 128 + n * 32;
    for (int l = 0; l < 32; ++l)
      code[l] = (j < 2 ? ql[l] & 0xF : ql[l] >> 4) | (((qh[l] >> (2 * j)) & 3) << 4);
    return;
  }
  const int64_t bytes = kind == Q4_K ? 144 : 176;
  const uint8_t* blk = row + (b / 8) * bytes;
  const uint8_t* qs = blk + bytes - 128 + (s / 2) * 32;
  for (int l = 0; l < 32; ++l) code[l] = s % 2 ? qs[l] >> 4 : qs[l] & 0xF;
  if (kind == Q5_K)
    for (int l = 0; l < 32; ++l) code[l] |= ((blk[16 + l] >> s) & 1) << 4;
}

// Block b of row n's codes into the panel's lo (4 x 64 bytes) and hi (planes x 64 bytes).
inline void pack_codes(const uint8_t* code, int n, int planes, uint8_t* lo, uint8_t* hi) {
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 4; ++i)
      lo[c * 64 + n * 4 + i] = (code[8 * c + i] & 0xF) | ((code[8 * c + 4 + i] & 0xF) << 4);
  for (int j = 0; j < planes; ++j)
    for (int i = 0; i < 4; ++i) {
      uint8_t bits = 0;
      for (int c = 0; c < 4; ++c)
        for (int h = 0; h < 2; ++h) bits |= ((code[8 * c + 4 * h + i] >> (4 + j)) & 1) << (2 * c + h);
      hi[j * 64 + n * 4 + i] = bits;
    }
}

struct Out {
  uint8_t *lo, *hi;
  void *scale, *offset;  // float16 bits (Q5_0/Q5_1), uint8 (Q4_K/Q5_K; MXFP4's e8m0) or int8 (Q6_K)
  float *dsup, *msup;
};

// Row n of panel p, block b: its scales (and offsets, super-block factors) into `out`.
inline void block_sides(int64_t kind, const uint8_t* row, int64_t p, int64_t nb, int64_t b, int n, const Out& out) {
  const int64_t at = (p * nb + b) * kPanel + n;
  if (kind == MXFP4) {
    static_cast<uint8_t*>(out.scale)[at] = row[b * 17];
    return;
  }
  if (kind == Q5_0 || kind == Q5_1) {
    const uint8_t* blk = row + b * (kind == Q5_0 ? 22 : 24);
    static_cast<uint16_t*>(out.scale)[at] = half_bits(blk);
    if (kind == Q5_1) static_cast<uint16_t*>(out.offset)[at] = half_bits(blk + 2);
    return;
  }
  const int s = static_cast<int>(b % 8);
  const int64_t sup = (p * (nb / 8) + b / 8) * kPanel + n;
  if (kind == Q6_K) {
    const uint8_t* blk = row + (b / 8) * 210;
    int8_t* scale = static_cast<int8_t*>(out.scale);
    for (int half = 0; half < 2; ++half)
      scale[((p * nb + b) * 2 + half) * kPanel + n] = static_cast<int8_t>(blk[192 + 2 * s + half]);
    if (s == 0) out.dsup[sup] = half_value(blk + 208);
    return;
  }
  const uint8_t* blk = row + (b / 8) * (kind == Q4_K ? 144 : 176);
  scale_min_k4(s, blk + 4, static_cast<uint8_t*>(out.scale)[at], static_cast<uint8_t*>(out.offset)[at]);
  if (s == 0) {
    out.dsup[sup] = half_value(blk);
    out.msup[sup] = -half_value(blk + 2);
  }
}

inline int64_t row_bytes(int64_t kind, int64_t K) {
  switch (kind) {
    case Q5_0: return K / 32 * 22;
    case Q5_1: return K / 32 * 24;
    case Q4_K: return K / 256 * 144;
    case Q5_K: return K / 256 * 176;
    case Q6_K: return K / 256 * 210;
    case MXFP4: return K / 32 * 17;
    default: return -1;
  }
}

// raw (N, row_bytes) uint8 rows of GGUF type `kind` -> the panel tensors, allocated by the
// caller in the shapes panels.py gives them (hi, offset, dsup, msup where the type has them).
inline void relay_panels(const at::Tensor& raw, int64_t kind, int64_t K, const at::Tensor& lo,
                         const c10::optional<at::Tensor>& hi, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& offset, const c10::optional<at::Tensor>& dsup,
                         const c10::optional<at::Tensor>& msup) {
  const int64_t rb = row_bytes(kind, K);
  TORCH_CHECK(rb > 0 && K % (is_k_quant(kind) ? 256 : 32) == 0, "GGML type ", kind, " has no panel layout for K=", K);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.size(1) == rb && raw.stride(1) == 1 &&
              raw.size(0) % kPanel == 0, "raw must be (16 P, ", rb, ") uint8 rows");
  const int64_t P = raw.size(0) / kPanel, nb = K / 32, ld = raw.stride(0);
  const int planes = kind == Q6_K ? 2 : (kind == Q4_K || kind == MXFP4) ? 0 : 1;
  const bool offs = kind == Q5_1 || kind == Q4_K || kind == Q5_K, kq = is_k_quant(kind);
  auto filled = [](const at::Tensor& t, int64_t numel) { return t.is_contiguous() && t.numel() == numel; };
  TORCH_CHECK(lo.scalar_type() == at::kByte && filled(lo, P * nb * 256), "lo must be (P, K/32, 4, 64) uint8");
  TORCH_CHECK(!planes || (hi && hi->scalar_type() == at::kByte && filled(*hi, P * nb * planes * 64)),
              "hi must be (P, K/32, planes, 64) uint8");
  const int64_t sides = P * nb * kPanel * (kind == Q6_K ? 2 : 1);
  TORCH_CHECK(filled(scale, sides) && scale.element_size() == (kq || kind == MXFP4 ? 1 : 2),
              "scale has the wrong shape or dtype");
  TORCH_CHECK(!offs || (offset && filled(*offset, sides) && offset->element_size() == scale.element_size()),
              "offset must be shaped like scale");
  auto super_ok = [&](const c10::optional<at::Tensor>& t) {
    return t && t->scalar_type() == at::kFloat && filled(*t, P * (nb / 8) * kPanel);
  };
  TORCH_CHECK(!kq || (super_ok(dsup) && (!offs || super_ok(msup))), "K-quants need dsup (and msup) (P, K/256, 16)");
  const Out out{lo.data_ptr<uint8_t>(), planes ? hi->data_ptr<uint8_t>() : nullptr, scale.data_ptr(),
                offs ? offset->data_ptr() : nullptr, kq ? dsup->data_ptr<float>() : nullptr,
                kq && offs ? msup->data_ptr<float>() : nullptr};
  const uint8_t* base = raw.data_ptr<uint8_t>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    uint8_t code[32];
    for (int64_t p = p0; p < p1; ++p)
      for (int n = 0; n < kPanel; ++n) {
        const uint8_t* row = base + (p * kPanel + n) * ld;
        for (int64_t b = 0; b < nb; ++b) {
          block_codes(kind, row, b, code);
          pack_codes(code, n, planes, out.lo + (p * nb + b) * 256, planes ? out.hi + (p * nb + b) * planes * 64 : nullptr);
          block_sides(kind, row, p, nb, b, n, out);
        }
      }
  });
}

}  // namespace tokenloom_relay
