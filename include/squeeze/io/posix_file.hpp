#pragma once
// POSIX files for checkpoints: whole writes, positioned reads, fsync of files and directories, renames.
// std::fstream cannot fsync, and a rename survives a power cut only once its directory is fsync'd too.
// Errors are squeeze::Error naming the path and the system's reason.
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "squeeze/error.hpp"

namespace squeeze::io {

// Called after each durable step of a save with the step's name ("index.json:fsynced"); tests throw or
// kill the process there to prove that a save interrupted at any point leaves the store consistent.
using FaultHook = std::function<void(std::string_view point)>;

namespace detail {
inline std::string sys_error(std::string_view what, const std::filesystem::path& p, int err) {
  return std::string(what) + " " + p.string() + ": " + std::strerror(err);
}
inline void hook(const FaultHook& h, std::string_view point) {
  if (h) h(point);
}
}  // namespace detail

// An owned file descriptor.
class PosixFile {
 public:
  PosixFile() = default;
  static PosixFile create(const std::filesystem::path& p) {
    const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) throw Error(detail::sys_error("cannot create", p, errno));
    return PosixFile(fd, p);
  }
  static PosixFile open_read(const std::filesystem::path& p) {
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw Error(detail::sys_error("cannot open", p, errno));
    return PosixFile(fd, p);
  }
  ~PosixFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  PosixFile(PosixFile&& o) noexcept : fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)) {}
  PosixFile& operator=(PosixFile&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(o.fd_, -1);
      path_ = std::move(o.path_);
    }
    return *this;
  }
  PosixFile(const PosixFile&) = delete;
  PosixFile& operator=(const PosixFile&) = delete;

  void write_all(std::span<const std::byte> b) {
    while (!b.empty()) {
      const ::ssize_t n = ::write(fd_, b.data(), b.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw Error(detail::sys_error("write failed (disk full?) on", path_, n < 0 ? errno : EIO));
      b = b.subspan(std::size_t(n));
    }
  }
  // Exactly out.size() bytes from `offset`; a file that ends first is an error naming the range.
  void pread_exact(std::uint64_t offset, std::span<std::byte> out) const {
    std::uint64_t at = offset;
    while (!out.empty()) {
      const ::ssize_t n = ::pread(fd_, out.data(), out.size(), ::off_t(at));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw Error(detail::sys_error("read failed on", path_, errno));
      if (n == 0)
        throw Error(path_.string() + ": the file ends at byte " + std::to_string(at) + ", inside the wanted range [" +
                    std::to_string(offset) + ", " + std::to_string(at + out.size()) + ")");
      out = out.subspan(std::size_t(n));
      at += std::uint64_t(n);
    }
  }
  void sync() {
    if (::fsync(fd_) != 0) throw Error(detail::sys_error("fsync failed on", path_, errno));
  }
  std::uint64_t size() const {
    struct ::stat st {};
    if (::fstat(fd_, &st) != 0) throw Error(detail::sys_error("fstat failed on", path_, errno));
    return std::uint64_t(st.st_size);
  }
  // Closing reports the errors of delayed writes (NFS); a destructor would swallow them.
  void close() {
    const int r = ::close(std::exchange(fd_, -1));
    if (r != 0) throw Error(detail::sys_error("close failed on", path_, errno));
  }
  const std::filesystem::path& path() const { return path_; }
  int fd() const { return fd_; }

 private:
  PosixFile(int fd, std::filesystem::path p) : fd_(fd), path_(std::move(p)) {}
  int fd_ = -1;
  std::filesystem::path path_;
};

// Makes the entries of `dir` (creations, renames, removals) durable.
inline void fsync_directory(const std::filesystem::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw Error(detail::sys_error("cannot open directory", dir, errno));
  const int r = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (r != 0) throw Error(detail::sys_error("fsync failed on directory", dir, err));
}

inline void rename_path(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) throw Error(detail::sys_error("cannot rename " + from.string() + " to", to, errno));
}

// Swaps two directory entries atomically (Linux renameat2 RENAME_EXCHANGE): replaces a directory that a
// reader may open at any moment without a window in which neither version exists. False where the
// kernel or file system does not support it.
inline bool exchange_paths(const std::filesystem::path& a, const std::filesystem::path& b) {
#if defined(__linux__) && defined(RENAME_EXCHANGE)
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return true;
  if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) return false;
  throw Error(detail::sys_error("cannot exchange " + a.string() + " with", b, errno));
#else
  (void)a, (void)b;
  return false;
#endif
}

// Writes `content` to `tmp`, fsyncs it and renames it to `path`; the caller fsyncs the directory.
// Hook points: "<label>:written", "<label>:fsynced", "<label>:renamed".
inline void write_file_durably(const std::filesystem::path& path, const std::filesystem::path& tmp, std::string_view content,
                               const FaultHook& hook, std::string_view label) {
  const std::string l(label);
  PosixFile f = PosixFile::create(tmp);
  f.write_all(std::as_bytes(std::span(content.data(), content.size())));
  detail::hook(hook, l + ":written");
  f.sync();
  detail::hook(hook, l + ":fsynced");
  f.close();
  rename_path(tmp, path);
  detail::hook(hook, l + ":renamed");
}

// Removes `path` and, for a directory, everything under it, without following symbolic links; returns the entries
// removed (0 when `path` does not exist). In place of std::filesystem::remove_all: PyTorch's wheels export their own
// statically linked copy of it (pytorch/pytorch#133437), which a program linked with libtorch binds to, and the
// copy in the 2.11 CUDA wheel crashed (SIGSEGV) removing a checkpoint directory. glibc's nftw has no such twin.
inline std::uintmax_t remove_tree(const std::filesystem::path& path) {
  static thread_local std::uintmax_t removed;
  static thread_local int failure;
  static thread_local std::string failed_at;
  removed = 0, failure = 0, failed_at.clear();
  auto remove_entry = [](const char* p, const struct stat*, int, struct FTW*) -> int {
    if (::remove(p) != 0) {
      failure = errno, failed_at = p;
      return 1;  // stops the walk
    }
    ++removed;
    return 0;
  };
  // FTW_DEPTH: a directory after its entries; FTW_PHYS: links removed, never followed; 16 descriptors at most.
  if (::nftw(path.c_str(), remove_entry, 16, FTW_DEPTH | FTW_PHYS) == 0) return removed;
  if (failure) throw Error(detail::sys_error("cannot remove", failed_at, failure));
  if (errno == ENOENT) return 0;  // `path` itself is missing
  throw Error(detail::sys_error("cannot remove", path, errno));
}

// As remove_tree, for clean-up on a path that is already failing: false instead of an exception.
inline bool try_remove_tree(const std::filesystem::path& path) noexcept {
  try {
    remove_tree(path);
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace squeeze::io
