#pragma once
// Token-shard datasets, torch-free: files of token ids in llm.c's format, memory-mapped, cut into training
// windows of T + 1 tokens (inputs and their next-token targets).
//
// File: a header of 256 little-endian int32 — [0] magic, [1] version, [2] token count, the rest 0 — then the
// tokens. llm.c's two kinds, followed as they are so its files and ours are interchangeable:
//   magic 20240520, version 1: uint16 tokens (GPT-2-sized vocabularies, LLaMA-1/2's 32000)
//   magic 20240801, version 7: uint32 tokens (LLaMA 3's 128256 and any vocabulary over 65536)
// The count is an int32, so one shard holds fewer than 2^31 tokens; a dataset is several shards.
//
// TokenDataset: window w of a shard holds its tokens [w T, w T + T + 1); windows never cross shards. Each
// epoch visits every window once, in order (sequential) or in a pseudo-random order that is a pure function
// of (seed, epoch) — a keyed bijection on the window indices, so nothing of size #windows is stored and
// the same seed gives the same batches on every machine and after a restart at any step. Data-parallel
// rank r of N takes positions r, r + N, r + 2N, ... of the epoch's order, so ranks see disjoint windows;
// every rank gets the same number of batches (the last windows that would leave a rank short are skipped
// that epoch). batch(step) is [B, T + 1] row-major int32.
#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "squeeze/error.hpp"
#include "squeeze/io/safetensors.hpp"  // detail::Fd, detail::errno_text

namespace squeeze::io {

enum class TokenWidth { U16, U32 };

inline constexpr std::int32_t kTokenShardMagicU16 = 20240520, kTokenShardVersionU16 = 1;
inline constexpr std::int32_t kTokenShardMagicU32 = 20240801, kTokenShardVersionU32 = 7;
inline constexpr std::size_t kTokenShardHeaderInts = 256;
inline constexpr std::size_t kTokenShardHeaderBytes = kTokenShardHeaderInts * 4;
inline constexpr std::uint64_t kTokenShardMaxTokens = 0x7fffffffull;  // the header's int32 count

inline std::size_t token_bytes(TokenWidth w) { return w == TokenWidth::U16 ? 2 : 4; }
// The narrowest width that holds ids 0 .. vocab - 1.
inline TokenWidth token_width_for(std::int64_t vocab) { return vocab <= 65536 ? TokenWidth::U16 : TokenWidth::U32; }

// Writes one shard: tokens appended in pieces, the count patched into the header on close(). The file
// appears (renamed from "<path>.tmp") only when close() succeeds.
class TokenShardWriter {
 public:
  TokenShardWriter(std::filesystem::path path, TokenWidth width) : path_(std::move(path)), tmp_(path_.string() + ".tmp"), width_(width) {
    static_assert(std::endian::native == std::endian::little, "token shards store little-endian ids");
    fd_ = detail::Fd(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    check(fd_.get() >= 0, "token shard: cannot create " + tmp_.string() + ": " + detail::errno_text());
    const std::vector<std::byte> zero(kTokenShardHeaderBytes);
    write_all(zero);
  }
  TokenShardWriter(const TokenShardWriter&) = delete;
  TokenShardWriter& operator=(const TokenShardWriter&) = delete;
  ~TokenShardWriter() {
    if (!closed_) {
      fd_ = detail::Fd();
      std::error_code ec;
      std::filesystem::remove(tmp_, ec);
    }
  }

  // Ids must fit the width (< 65536 for uint16) and be non-negative.
  template <class Int>
  void append(std::span<const Int> tokens) {
    check(!closed_, "token shard " + path_.string() + ": already closed");
    check(count_ + tokens.size() <= kTokenShardMaxTokens,
          "token shard " + path_.string() + ": more than 2^31 - 1 tokens (the header's int32 count); start another shard");
    const std::uint64_t limit = width_ == TokenWidth::U16 ? 0xffffull : 0xffffffffull;
    std::vector<std::byte> buf(tokens.size() * token_bytes(width_));
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const auto t = tokens[i];
      bool negative = false;
      if constexpr (std::is_signed_v<Int>) negative = t < 0;
      check(!negative && std::uint64_t(t) <= limit, "token shard " + path_.string() + ": token " + std::to_string(t) + " at position " +
                                                        std::to_string(count_ + i) + " does not fit a " +
                                                        (width_ == TokenWidth::U16 ? "uint16" : "uint32") + " shard");
      if (width_ == TokenWidth::U16) {
        const auto v = std::uint16_t(t);
        std::memcpy(buf.data() + 2 * i, &v, 2);
      } else {
        const auto v = std::uint32_t(t);
        std::memcpy(buf.data() + 4 * i, &v, 4);
      }
    }
    write_all(buf);
    count_ += tokens.size();
  }
  template <class Int>
  void append(const std::vector<Int>& tokens) {
    append(std::span<const Int>(tokens));
  }

  std::uint64_t count() const { return count_; }

  void close() {
    check(!closed_, "token shard " + path_.string() + ": already closed");
    std::int32_t header[3] = {width_ == TokenWidth::U16 ? kTokenShardMagicU16 : kTokenShardMagicU32,
                              width_ == TokenWidth::U16 ? kTokenShardVersionU16 : kTokenShardVersionU32, std::int32_t(count_)};
    check(::pwrite(fd_.get(), header, sizeof header, 0) == ::ssize_t(sizeof header) && ::fsync(fd_.get()) == 0,
          "token shard: writing the header of " + tmp_.string() + " failed: " + detail::errno_text());
    fd_ = detail::Fd();
    std::filesystem::rename(tmp_, path_);
    closed_ = true;
  }

 private:
  void write_all(std::span<const std::byte> b) {
    std::size_t done = 0;
    while (done < b.size()) {
      const ::ssize_t r = ::write(fd_.get(), b.data() + done, b.size() - done);
      if (r < 0 && errno == EINTR) continue;
      check(r > 0, "token shard: writing " + tmp_.string() + " failed: " + detail::errno_text());
      done += std::size_t(r);
    }
  }

  std::filesystem::path path_, tmp_;
  TokenWidth width_;
  detail::Fd fd_;
  std::uint64_t count_ = 0;
  bool closed_ = false;
};

template <class Int>
void write_token_shard(const std::filesystem::path& path, std::span<const Int> tokens, TokenWidth width) {
  TokenShardWriter w(path, width);
  w.append(tokens);
  w.close();
}
template <class Int>
void write_token_shard(const std::filesystem::path& path, const std::vector<Int>& tokens, TokenWidth width) {
  write_token_shard(path, std::span<const Int>(tokens), width);
}

// The shards of one split in `dir`, sorted by name: the regular *.bin files that have `split` ("train", "val") as one
// of the '_'-separated words of their name, as llm.c names them (fineweb_train_000001.bin, tiny_shakespeare_val.bin)
// and squeeze-tokenize writes them (train_000000.bin). A missing directory is an error; no match is an empty list.
inline std::vector<std::filesystem::path> token_shard_files(const std::filesystem::path& dir, std::string_view split) {
  check(std::filesystem::is_directory(dir), "token shards: " + dir.string() + " is not a directory");
  std::vector<std::filesystem::path> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (!e.is_regular_file() || e.path().extension() != ".bin") continue;
    const std::string stem = e.path().stem().string();
    for (std::size_t b = 0; b <= stem.size();) {
      const std::size_t u = std::min(stem.find('_', b), stem.size());
      if (std::string_view(stem).substr(b, u - b) == split) {
        out.push_back(e.path());
        break;
      }
      b = u + 1;
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// One shard, memory-mapped read-only and validated on open (magic, version, size == header + count tokens).
class TokenShard {
 public:
  static TokenShard open(const std::filesystem::path& path) {
    TokenShard s;
    s.path_ = path;
    const std::string src = "token shard " + path.string();
    detail::Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    check(fd.get() >= 0, "token shard: cannot open " + path.string() + ": " + detail::errno_text());
    struct ::stat st {};
    check(::fstat(fd.get(), &st) == 0 && S_ISREG(st.st_mode), src + ": not a readable regular file");
    const auto size = std::uint64_t(st.st_size);
    check(size >= kTokenShardHeaderBytes, src + ": " + std::to_string(size) + " bytes, shorter than the " +
                                              std::to_string(kTokenShardHeaderBytes) + "-byte header (truncated?)");
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    check(p != MAP_FAILED, src + ": mmap failed: " + detail::errno_text());
    s.map_ = static_cast<const std::byte*>(p);
    s.map_size_ = size;
    std::int32_t h[3];
    std::memcpy(h, s.map_, sizeof h);
    if (h[0] == kTokenShardMagicU16) {
      check(h[1] == kTokenShardVersionU16, src + ": magic " + std::to_string(h[0]) + " (uint16 tokens) needs version " +
                                               std::to_string(kTokenShardVersionU16) + ", the header says " + std::to_string(h[1]));
      s.width_ = TokenWidth::U16;
    } else if (h[0] == kTokenShardMagicU32) {
      check(h[1] == kTokenShardVersionU32, src + ": magic " + std::to_string(h[0]) + " (uint32 tokens) needs version " +
                                               std::to_string(kTokenShardVersionU32) + ", the header says " + std::to_string(h[1]));
      s.width_ = TokenWidth::U32;
    } else {
      throw Error(src + ": bad magic " + std::to_string(h[0]) + " (llm.c token shards start with " + std::to_string(kTokenShardMagicU16) +
                  " for uint16 or " + std::to_string(kTokenShardMagicU32) + " for uint32 tokens)");
    }
    check(h[2] >= 0, src + ": negative token count " + std::to_string(h[2]));
    s.count_ = std::uint64_t(h[2]);
    const std::uint64_t want = kTokenShardHeaderBytes + s.count_ * token_bytes(s.width_);
    check(size >= want, src + ": the header promises " + std::to_string(s.count_) + " tokens (" + std::to_string(want) +
                            " bytes) but the file has " + std::to_string(size) + " bytes (truncated?)");
    check(size == want, src + ": " + std::to_string(size - want) + " bytes after the " + std::to_string(s.count_) +
                            " tokens the header promises (not a token shard, or a wrong count)");
    return s;
  }

  TokenShard(TokenShard&& o) noexcept
      : path_(std::move(o.path_)), map_(std::exchange(o.map_, nullptr)), map_size_(o.map_size_), width_(o.width_), count_(o.count_) {}
  TokenShard& operator=(TokenShard&& o) noexcept {
    if (this != &o) {
      unmap();
      path_ = std::move(o.path_);
      map_ = std::exchange(o.map_, nullptr);
      map_size_ = o.map_size_, width_ = o.width_, count_ = o.count_;
    }
    return *this;
  }
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  ~TokenShard() { unmap(); }

  const std::filesystem::path& path() const { return path_; }
  TokenWidth width() const { return width_; }
  std::uint64_t size() const { return count_; }

  std::uint32_t operator[](std::uint64_t i) const {
    const std::byte* p = map_ + kTokenShardHeaderBytes + i * token_bytes(width_);
    if (width_ == TokenWidth::U16) {
      std::uint16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    std::uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }

  // Tokens [begin, begin + out.size()) as int32; each must be < vocab (vocab 0: only that it fits int32).
  void copy(std::uint64_t begin, std::span<std::int32_t> out, std::int64_t vocab = 0) const {
    check(begin <= count_ && out.size() <= count_ - begin, "token shard " + path_.string() + ": tokens [" + std::to_string(begin) + ", " +
                                                               std::to_string(begin + out.size()) + ") requested of " +
                                                               std::to_string(count_));
    const std::uint64_t limit = vocab > 0 ? std::uint64_t(vocab) : 0x80000000ull;
    for (std::size_t i = 0; i < out.size(); ++i) {
      const std::uint32_t t = (*this)[begin + i];
      if (t >= limit)
        throw Error("token shard " + path_.string() + ": token " + std::to_string(t) + " at position " + std::to_string(begin + i) +
                    (vocab > 0 ? " is outside the vocabulary of " + std::to_string(vocab) : std::string(" does not fit int32")));
      out[i] = std::int32_t(t);
    }
  }
  // Every token < vocab (a whole-file scan; copy() checks each window it reads anyway).
  void check_vocab(std::int64_t vocab) const {
    std::vector<std::int32_t> buf;
    for (std::uint64_t b = 0; b < count_; b += 1 << 20) {
      buf.resize(std::size_t(std::min<std::uint64_t>(1 << 20, count_ - b)));
      copy(b, buf, vocab);
    }
  }

 private:
  TokenShard() = default;
  void unmap() {
    if (map_) ::munmap(const_cast<std::byte*>(map_), map_size_);
    map_ = nullptr;
  }
  std::filesystem::path path_;
  const std::byte* map_ = nullptr;
  std::uint64_t map_size_ = 0;
  TokenWidth width_ = TokenWidth::U16;
  std::uint64_t count_ = 0;
};

namespace detail {
inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A keyed bijection of [0, n): a balanced 4-round Feistel network on the smallest even number of bits that
// covers n, walking the cycle until the value lands inside [0, n) (fewer than 4 steps on average).
class IndexPermutation {
 public:
  IndexPermutation(std::uint64_t n, std::uint64_t key) : n_(n), key_(key) {
    int bits = 2;
    while (bits < 64 && (std::uint64_t(1) << bits) < n) bits += 2;
    half_ = bits / 2;
    mask_ = (std::uint64_t(1) << half_) - 1;
  }
  std::uint64_t operator()(std::uint64_t i) const {
    std::uint64_t x = i;
    do x = round_trip(x);
    while (x >= n_);
    return x;
  }

 private:
  std::uint64_t round_trip(std::uint64_t x) const {
    std::uint64_t l = x >> half_, r = x & mask_;
    for (std::uint64_t k = 0; k < 4; ++k) {
      const std::uint64_t f = splitmix64(key_ ^ splitmix64((k << 56) ^ r)) & mask_;
      l = std::exchange(r, l ^ f);
    }
    return (l << half_) | r;
  }
  std::uint64_t n_, key_, mask_ = 0;
  int half_ = 1;
};
}  // namespace detail

struct TokenDatasetOptions {
  std::int64_t batch = 1;  // B windows per batch (per rank)
  std::int64_t seq = 128;  // T: each window holds T + 1 tokens
  std::int64_t vocab = 0;  // > 0: every token read is checked against it
  bool shuffle = true;     // false: windows in file order
  std::uint64_t seed = 0;
  std::int64_t rank = 0, world = 1;  // data-parallel position
};

class TokenDataset {
 public:
  TokenDataset(const std::vector<std::filesystem::path>& shards, TokenDatasetOptions o) : o_(o) {
    check(!shards.empty(), "TokenDataset: no shard files given");
    check(o.batch > 0 && o.seq > 0, "TokenDataset: batch and seq must be positive");
    check(o.world > 0 && o.rank >= 0 && o.rank < o.world,
          "TokenDataset: rank " + std::to_string(o.rank) + " is not in [0, world = " + std::to_string(o.world) + ")");
    std::uint64_t total = 0;
    for (const auto& p : shards) {
      shards_.push_back(TokenShard::open(p));
      const std::uint64_t n = shards_.back().size();
      total += n >= std::uint64_t(o.seq) + 1 ? (n - 1) / std::uint64_t(o.seq) : 0;
      window_end_.push_back(total);
    }
    windows_ = total;
    per_rank_ = windows_ / std::uint64_t(o.world);
    batches_ = per_rank_ / std::uint64_t(o.batch);
    check(batches_ > 0, "TokenDataset: " + std::to_string(windows_) + " windows of " + std::to_string(o.seq + 1) + " tokens in " +
                            std::to_string(shards.size()) + " shard(s) are fewer than one batch of " + std::to_string(o.batch) +
                            " for each of " + std::to_string(o.world) + " rank(s)");
  }

  std::uint64_t windows() const { return windows_; }            // all windows, all ranks
  std::uint64_t batches_per_epoch() const { return batches_; }  // per rank
  std::size_t shard_count() const { return shards_.size(); }
  const TokenShard& shard(std::size_t i) const { return shards_.at(i); }
  const TokenDatasetOptions& options() const { return o_; }

  // The global window indices of this rank's batch at `step` (epoch = step / batches_per_epoch()).
  std::vector<std::uint64_t> window_ids(std::uint64_t step) const {
    const std::uint64_t epoch = step / batches_, b = step % batches_;
    const detail::IndexPermutation perm(windows_, detail::splitmix64(o_.seed ^ detail::splitmix64(epoch + 1)));
    std::vector<std::uint64_t> ids(std::size_t(o_.batch));
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::uint64_t pos = (b * std::uint64_t(o_.batch) + i) * std::uint64_t(o_.world) + std::uint64_t(o_.rank);
      ids[i] = o_.shuffle ? perm(pos) : pos;
    }
    return ids;
  }

  // [B, T + 1] token ids, row-major.
  std::vector<std::int32_t> batch(std::uint64_t step) const {
    const std::size_t row = std::size_t(o_.seq + 1);
    std::vector<std::int32_t> out(std::size_t(o_.batch) * row);
    const auto ids = window_ids(step);
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const auto [s, w] = locate(ids[i]);
      shards_[s].copy(w * std::uint64_t(o_.seq), std::span(out).subspan(i * row, row), o_.vocab);
    }
    return out;
  }

  // Sequential use: the batch at the current step, then the next step.
  std::vector<std::int32_t> next() { return batch(step_++); }
  std::uint64_t step() const { return step_; }
  void seek(std::uint64_t step) { step_ = step; }

 private:
  // (shard, window within it) of a global window index
  std::pair<std::size_t, std::uint64_t> locate(std::uint64_t id) const {
    const auto it = std::upper_bound(window_end_.begin(), window_end_.end(), id);
    const std::size_t s = std::size_t(it - window_end_.begin());
    const std::uint64_t base = s == 0 ? 0 : window_end_[s - 1];
    return {s, id - base};
  }

  TokenDatasetOptions o_;
  std::vector<TokenShard> shards_;
  std::vector<std::uint64_t> window_end_;  // window_end_[s]: windows in shards 0..s (a prefix sum)
  std::uint64_t windows_ = 0, per_rank_ = 0, batches_ = 0;
  std::uint64_t step_ = 0;
};

}  // namespace squeeze::io
