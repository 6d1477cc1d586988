// Where a sequence's cached positions lie in a paged cache (num_blocks, block_size, kv_heads,
// head_dim), shared by the decode (paged_decode_cpu.cpp) and prompt (paged_prefill_cpu.cpp)
// attention kernels.
#pragma once
#include <cstdint>
#include <vector>

// Row pointers of positions [start, end) in the key and the value cache, walked block by block
// through the sequence's block table (no division per position). Each pointer is the cache
// base plus the position's slot (slot_floats = kv_heads * head_dim floats per slot): pass
// base + g * head_dim to point at kv head g's row directly.
struct Rows {
  std::vector<const float*> k, v;
  void fill(const float* kc, const float* vc, const int64_t* table, int64_t start, int64_t end, int64_t block_size,
            int64_t slot_floats) {
    k.resize(end - start);
    v.resize(end - start);
    int64_t block = start / block_size, offset = start % block_size;
    for (int64_t t = 0; t < end - start; ++t) {
      const int64_t at = (table[block] * block_size + offset) * slot_floats;
      k[t] = kc + at;
      v[t] = vc + at;
      if (++offset == block_size) offset = 0, ++block;
    }
  }
};
