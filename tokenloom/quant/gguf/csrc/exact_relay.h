// GGUF Q8_0, Q4_0 and Q4_1 rows re-laid straight into the int8 / int4 panel layout of
// quant/int8/panels.py (those types are tokenloom formats as they stand: quant/gguf/blocks.py).
// The same bytes as blocks.to_quantized then int8 panels.to_panels, in one pass over the file's
// bytes with the panels spread over torch's threads, instead of two re-lays through temporaries.
//
// For output row r = 16 p + n (p counted from panel_start) and 32-value block b of a row:
//   int4 (Q4_0, Q4_1): data[p, b, c, 4 n + i] = code[8 c + i] | code[8 c + 4 + i] << 4   (c, i < 4)
//   int8 (Q8_0):       data[p, b, c, 4 n + i] = code[4 c + i] + 128                        (c < 8, i < 4)
//   scales[p, b, n] = d; offsets[p, b, n] = m (Q4_1) or -8 d (Q4_0), float16.
// A Q8_0 code of -128 has no place in the panel layout (panels.fits): the call returns false.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <atomic>
#include <cstdint>
#include <cstring>

namespace tokenloom_exact {

constexpr int64_t kPanel = 16;
enum Kind : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

inline int64_t block_bytes(int64_t kind) { return kind == Q8_0 ? 34 : kind == Q4_1 ? 20 : kind == Q4_0 ? 18 : 0; }

// Block `blk` of a Q4_0 / Q4_1 row into its 4 chunks of panel row n (`out` = data[p, b]).
inline void int4_block(const uint8_t* blk, int64_t kind, int n, uint8_t* out) {
  const uint8_t* qs = blk + (kind == Q4_1 ? 4 : 2);
  uint8_t code[32];
  for (int j = 0; j < 16; ++j) {
    code[j] = qs[j] & 0xF;
    code[j + 16] = qs[j] >> 4;
  }
  for (int c = 0; c < 4; ++c)
    for (int i = 0; i < 4; ++i) out[c * 64 + 4 * n + i] = code[8 * c + i] | (code[8 * c + 4 + i] << 4);
}

// Block `blk` of a Q8_0 row into its 8 chunks of panel row n; false where a code is -128.
inline bool int8_block(const uint8_t* blk, int n, uint8_t* out) {
  const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
  bool ok = true;
  for (int c = 0; c < 8; ++c)
    for (int i = 0; i < 4; ++i) {
      const int8_t q = qs[4 * c + i];
      ok &= q != -128;
      out[c * 64 + 4 * n + i] = static_cast<uint8_t>(q + 128);
    }
  return ok;
}

inline bool relay_exact_panels(const at::Tensor& raw, int64_t kind, int64_t K, const at::Tensor& data,
                               const at::Tensor& scales, const c10::optional<at::Tensor>& offsets,
                               int64_t panel_start) {
  const int64_t bb = block_bytes(kind), nb = K / 32;
  TORCH_CHECK(bb > 0 && K % 32 == 0, "GGML type ", kind, " is not int8/int4 as it stands, or K=", K, " is not whole blocks");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.size(1) == nb * bb && raw.stride(1) == 1 &&
              raw.size(0) % kPanel == 0, "raw must be (16 P, ", nb * bb, ") uint8 rows");
  const int64_t P = raw.size(0) / kPanel, chunks = kind == Q8_0 ? 8 : 4, ld = raw.stride(0);
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.dim() == 4 && data.size(1) == nb &&
              data.size(2) == chunks && data.size(3) == 64 && panel_start >= 0 && panel_start + P <= data.size(0),
              "data must be (P, K/32, ", chunks, ", 64) uint8 with room for ", P, " panels at ", panel_start);
  auto sides_ok = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 3 && t.size(0) == data.size(0) &&
           t.size(1) == nb && t.size(2) == kPanel;
  };
  TORCH_CHECK(sides_ok(scales), "scales must be (P, K/32, 16) float16");
  TORCH_CHECK(kind == Q8_0 || (offsets && sides_ok(*offsets)), "int4 needs offsets shaped like scales");
  const uint8_t* base = raw.data_ptr<uint8_t>();
  uint8_t* dst = data.data_ptr<uint8_t>() + panel_start * nb * chunks * 64;
  uint16_t* scale = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>()) + panel_start * nb * kPanel;
  uint16_t* offset = kind == Q8_0 ? nullptr
                                  : reinterpret_cast<uint16_t*>(offsets->data_ptr<at::Half>()) + panel_start * nb * kPanel;
  std::atomic<bool> ok{true};
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    bool mine = true;
    for (int64_t p = p0; p < p1; ++p)
      for (int n = 0; n < kPanel; ++n) {
        const uint8_t* row = base + (p * kPanel + n) * ld;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = row + b * bb;
          uint8_t* out = dst + (p * nb + b) * chunks * 64;
          const int64_t side = (p * nb + b) * kPanel + n;
          std::memcpy(scale + side, blk, 2);
          if (kind == Q8_0) {
            mine &= int8_block(blk, n, out);
            continue;
          }
          int4_block(blk, kind, n, out);
          if (kind == Q4_1)
            std::memcpy(offset + side, blk + 2, 2);
          else
            offset[side] = _cvtss_sh(-8.0f * _cvtsh_ss(scale[side]), 0);
        }
      }
    if (!mine) ok = false;
  });
  return ok;
}

}  // namespace tokenloom_exact
