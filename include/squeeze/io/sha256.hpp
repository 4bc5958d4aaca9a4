#pragma once
// SHA-256 through OpenSSL's EVP interface (consumers link OpenSSL::Crypto). Checkpoints record every
// file's digest, so a flipped or missing byte is caught on load instead of being trained on.
#include <openssl/evp.h>

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "squeeze/error.hpp"
#include "squeeze/io/chunk_pipeline.hpp"
#include "squeeze/io/posix_file.hpp"

namespace squeeze::io {

// Incremental digest: update() any number of times, then hex() once.
class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) {
    if (!ctx_ || EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr) != 1) {
      EVP_MD_CTX_free(ctx_);
      throw Error("sha256: OpenSSL could not start a SHA-256 digest");
    }
  }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(Sha256&& o) noexcept : ctx_(std::exchange(o.ctx_, nullptr)) {}
  Sha256& operator=(Sha256&& o) noexcept {
    std::swap(ctx_, o.ctx_);
    return *this;
  }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void update(std::span<const std::byte> b) {
    if (!b.empty()) check(EVP_DigestUpdate(ctx_, b.data(), b.size()) == 1, "sha256: EVP_DigestUpdate failed");
  }
  // The digest as 64 lowercase hex digits; finishes the digest.
  std::string hex() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    check(EVP_DigestFinal_ex(ctx_, md, &n) == 1 && n == 32, "sha256: EVP_DigestFinal_ex failed");
    static constexpr char kHex[] = "0123456789abcdef";
    std::string s(2 * n, '0');
    for (unsigned i = 0; i < n; ++i) {
      s[2 * i] = kHex[md[i] >> 4];
      s[2 * i + 1] = kHex[md[i] & 15];
    }
    return s;
  }

 private:
  EVP_MD_CTX* ctx_ = nullptr;
};

inline std::string sha256_hex(std::span<const std::byte> b) {
  Sha256 h;
  h.update(b);
  return h.hex();
}

// Streams the file through the digest in chunks (a checkpoint shard can be tens of GB), reading the next chunk
// while the last one is hashed.
inline std::string sha256_file(const std::filesystem::path& path, std::size_t chunk_bytes = std::size_t(8) << 20) {
  const PosixFile f = PosixFile::open_read(path);
  const std::uint64_t size = f.size();
  const std::size_t chunk = std::max<std::size_t>(1, std::min<std::uint64_t>(chunk_bytes, size));
  std::vector<std::byte> buf[2] = {std::vector<std::byte>(chunk), std::vector<std::byte>(chunk)};
  auto bytes_of = [&](std::size_t i) { return std::size_t(std::min<std::uint64_t>(chunk, size - i * chunk)); };
  Sha256 h;
  pipeline_chunks(
      std::size_t((size + chunk - 1) / chunk),
      [&](std::size_t i, int slot) { f.pread_exact(i * chunk, std::span(buf[slot].data(), bytes_of(i))); },
      [&](std::size_t i, int slot) { h.update(std::span(buf[slot].data(), bytes_of(i))); });
  return h.hex();
}

}  // namespace squeeze::io
