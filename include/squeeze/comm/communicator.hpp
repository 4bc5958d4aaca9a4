#pragma once
// Collectives on raw buffers, one interface for every backend (layer 3: no torch, no kernels).
//
//   all_gather      send[count]            -> recv[size*count]   rank r's block lands at recv + r*count
//   reduce_scatter  send[size*count]       -> recv[count]        rank r gets op over every rank's block r
//   all_reduce      send[count]            -> recv[count]        op over every rank's buffer
//   broadcast       root's send[count]     -> recv[count]        on every rank (send ignored off root)
//   barrier         every rank arrives before any leaves
//
// Counts are per rank and equal on every rank, as in NCCL: a buffer whose length is not a multiple of
// the world size is padded by the caller to padded_count(n, world) elements (pad with zeros so sums and
// norms are unchanged); shard_count(n, world) is each rank's block. train::FlatParams lays buffers out so.
// In-place use is allowed: all_gather with send == recv + rank*count, reduce_scatter with
// recv == send + rank*count, all_reduce and broadcast with send == recv.
//
// Buffers are host or device memory (device only with a CUDA-capable backend); `stream` is a
// cudaStream_t passed as void* (nullptr: the default stream) and ignored for host memory. A backend
// may return before a device collective finishes (NCCL does); synchronize(stream) waits and throws
// squeeze::Error if the communicator failed or timed out. Every failure is a squeeze::Error.
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"

namespace squeeze::comm {

enum class DType : std::uint8_t { f32, f16, bf16, f64, i32, i64, u8 };
enum class ReduceOp : std::uint8_t { sum, avg, max };

using Stream = void*;  // cudaStream_t where CUDA exists

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
    case DType::f64:
      return "f64";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
  }
  return "?";
}

constexpr std::string_view op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
  }
  return "?";
}

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<half>() {
  return DType::f16;
}
template <>
constexpr DType dtype_of<bf16>() {
  return DType::bf16;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::f64;
}
template <>
constexpr DType dtype_of<std::int32_t>() {
  return DType::i32;
}
template <>
constexpr DType dtype_of<std::int64_t>() {
  return DType::i64;
}
template <>
constexpr DType dtype_of<std::uint8_t>() {
  return DType::u8;
}

// Each rank's block of an n-element buffer split over `world` ranks, and the padded length.
constexpr std::size_t shard_count(std::size_t n, int world) { return (n + std::size_t(world) - 1) / std::size_t(world); }
constexpr std::size_t padded_count(std::size_t n, int world) { return shard_count(n, world) * std::size_t(world); }

// The runtime interface: from_env() picks the backend at run time, so the trainer holds a
// std::shared_ptr<Communicator>. Collectives are coarse (one call per layer or bucket), so the virtual
// call costs nothing measurable.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend() const = 0;

  virtual void all_gather(const void* send, void* recv, std::size_t count, DType t, Stream s = nullptr) = 0;
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, Stream s = nullptr) = 0;
  virtual void all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, Stream s = nullptr) = 0;
  virtual void broadcast(const void* send, void* recv, std::size_t count, DType t, int root, Stream s = nullptr) = 0;
  virtual void barrier() = 0;
  // Waits for this communicator's work on `s`; throws if it failed or timed out.
  virtual void synchronize(Stream s = nullptr) = 0;
  // Which memory the collectives accept (NCCL: device only; LocalComm: host, and device when compiled
  // with the CUDA runtime).
  virtual bool host_buffers() const { return true; }
  virtual bool device_buffers() const { return false; }

  // Typed conveniences.
  template <class T>
  void all_gather(const T* send, T* recv, std::size_t count, Stream s = nullptr) {
    all_gather(static_cast<const void*>(send), static_cast<void*>(recv), count, dtype_of<T>(), s);
  }
  template <class T>
  void reduce_scatter(const T* send, T* recv, std::size_t count, ReduceOp op, Stream s = nullptr) {
    reduce_scatter(static_cast<const void*>(send), static_cast<void*>(recv), count, dtype_of<T>(), op, s);
  }
  template <class T>
  void all_reduce(const T* send, T* recv, std::size_t count, ReduceOp op, Stream s = nullptr) {
    all_reduce(static_cast<const void*>(send), static_cast<void*>(recv), count, dtype_of<T>(), op, s);
  }
  template <class T>
  void broadcast(const T* send, T* recv, std::size_t count, int root, Stream s = nullptr) {
    broadcast(static_cast<const void*>(send), static_cast<void*>(recv), count, dtype_of<T>(), root, s);
  }
};

// The compile-time shape of a communicator (what every backend provides); templates may constrain on it.
template <class C>
concept CommunicatorLike = requires(C& c, const void* in, void* out, std::size_t n, DType t, ReduceOp op, Stream s) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.all_gather(in, out, n, t, s);
  c.reduce_scatter(in, out, n, t, op, s);
  c.all_reduce(in, out, n, t, op, s);
  c.broadcast(in, out, n, t, 0, s);
  c.barrier();
  c.synchronize(s);
};
static_assert(CommunicatorLike<Communicator>);

using CommPtr = std::shared_ptr<Communicator>;

}  // namespace squeeze::comm
