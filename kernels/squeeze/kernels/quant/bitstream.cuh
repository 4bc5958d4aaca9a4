#pragma once
// Codes of `bits` bits packed as one little-endian bit stream in 32-bit words (the GPTQ packing rule):
// code j occupies stream bits [j*bits, (j+1)*bits); word w holds stream bits [32w, 32w+32). 3-bit codes
// may straddle two words. `stride` is the distance between consecutive words of one stream, so the same
// functions walk a column of qweight (stride = out) or a row of qzeros (stride = 1).
#include <cstdint>

#include "squeeze/dtype.hpp"

namespace squeeze::kernels::quant {

SQUEEZE_HD std::uint32_t stream_get(const std::int32_t* words, std::int64_t stride, std::int64_t j, int bits) {
  const std::int64_t bit = j * bits;
  const std::int64_t w = bit >> 5;
  const int off = int(bit & 31);
  const std::uint32_t mask = (1u << bits) - 1u;
  std::uint32_t v = std::uint32_t(words[w * stride]) >> off;
  if (off + bits > 32) v |= std::uint32_t(words[(w + 1) * stride]) << (32 - off);  // straddles (3-bit)
  return v & mask;
}

inline void stream_put(std::int32_t* words, std::int64_t stride, std::int64_t j, int bits, std::uint32_t v) {
  const std::int64_t bit = j * bits;
  const std::int64_t w = bit >> 5;
  const int off = int(bit & 31);
  const std::uint32_t mask = (1u << bits) - 1u;
  v &= mask;
  auto* p = reinterpret_cast<std::uint32_t*>(words);
  p[w * stride] = (p[w * stride] & ~(mask << off)) | (v << off);
  if (off + bits > 32) {
    const int lo = 32 - off;  // bits already written into word w
    p[(w + 1) * stride] = (p[(w + 1) * stride] & ~(mask >> lo)) | (v >> lo);
  }
}

}  // namespace squeeze::kernels::quant
