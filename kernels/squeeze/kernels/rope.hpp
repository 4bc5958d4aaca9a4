#pragma once
// Rotary position embedding, in place (or from `in` to x): the element functor, shared with rope.cuh, and the CPU twin.
// Layout (nn::Llama's projections before the head transpose): x [B, T, H, D] contiguous, i.e. rows = B * T rows
// of H heads of D elements; row r is position r % T. Each pair (x_i, x_{i+D/2}), i < D/2, is rotated by the
// angle of (position, i):
//   forward   (a, b) -> (a cos - b sin, b cos + a sin)      (nn::apply_rope's rotate-half form)
//   inverse   (a, b) -> (a cos + b sin, b cos - a sin)      (the backward: the transpose of a rotation)
// cos and sin are fp32 tables (double for double x) with row stride `table_stride` >= D/2: the [T, D] tables of
// nn::rope_tables (both halves equal) or [T, D/2]. Math in fp32, one rounding per element; nothing is saved.
#include <cstdint>
#include <string>

#include "squeeze/kernels/fused_common.hpp"

namespace squeeze::kernels {

template <class Acc>
struct RopeOp {
  // sign = +1: forward rotation; -1: inverse.
  SQUEEZE_HD static void rotate(Acc& a, Acc& b, Acc c, Acc s, Acc sign) {
    const Acc ss = sign * s;
    const Acc na = a * c - b * ss, nb = b * c + a * ss;
    a = na;
    b = nb;
  }
};

template <FusedElement T>
struct RopeArgs {
  T* x = nullptr;                 // [rows, heads, head_dim]: the output (rotated in place when `in` is null)
  const T* in = nullptr;          // [rows, heads, head_dim] source, or null: x itself (in place)
  const acc_t<T>* cos = nullptr;  // [T, table_stride]: the first head_dim / 2 columns are read
  const acc_t<T>* sin = nullptr;
  std::int64_t rows = 0, seq = 0, heads = 0, head_dim = 0, table_stride = 0;
  bool inverse = false;
};

template <class T>
void validate(const RopeArgs<T>& a, const std::string& what = "rope") {
  check(a.rows >= 0 && a.seq > 0 && a.heads > 0 && a.head_dim > 0,
        what + ": need rows >= 0 and positive seq, heads, head_dim; got rows " + std::to_string(a.rows) + ", seq " + std::to_string(a.seq) +
            ", heads " + std::to_string(a.heads) + ", head_dim " + std::to_string(a.head_dim));
  check(a.head_dim % 2 == 0, what + ": head_dim must be even, got " + std::to_string(a.head_dim));
  check(a.rows % a.seq == 0,
        what + ": rows (" + std::to_string(a.rows) + " = batch * seq) must be a multiple of seq (" + std::to_string(a.seq) + ")");
  check(a.table_stride >= a.head_dim / 2,
        what + ": table row stride " + std::to_string(a.table_stride) + " < head_dim / 2 (" + std::to_string(a.head_dim / 2) + ")");
  if (a.rows == 0) return;
  check(a.x != nullptr && a.cos != nullptr && a.sin != nullptr, what + ": x, cos and sin must not be null");
}

// Pair p of the whole tensor (p < rows * heads * head_dim / 2): rotates it in place.
template <class T>
SQUEEZE_HD void rope_pair(const RopeArgs<T>& a, std::int64_t p) {
  using Acc = acc_t<T>;
  const std::int64_t half = a.head_dim / 2, per_row = a.heads * half;
  const std::int64_t row = p / per_row, in_row = p - row * per_row;
  const std::int64_t head = in_row / half, i = in_row - head * half;
  const std::int64_t pos = row % a.seq;
  const std::int64_t offset = row * a.heads * a.head_dim + head * a.head_dim;
  T* base = a.x + offset;
  const T* src = a.in ? a.in + offset : base;
  Acc x1 = load_acc(src[i]), x2 = load_acc(src[i + half]);
  RopeOp<Acc>::rotate(x1, x2, a.cos[pos * a.table_stride + i], a.sin[pos * a.table_stride + i], a.inverse ? Acc(-1) : Acc(1));
  base[i] = store_acc<T>(x1);
  base[i + half] = store_acc<T>(x2);
}

template <FusedElement T>
void rope_cpu(const RopeArgs<T>& a) {
  validate(a, "rope (CPU)");
  const std::int64_t per_row = a.heads * (a.head_dim / 2);
  cpu::parallel_rows(a.rows, 2 * per_row, [&](int, std::int64_t r0, std::int64_t r1) {
    for (std::int64_t p = r0 * per_row; p < r1 * per_row; ++p) rope_pair(a, p);
  });
}

}  // namespace squeeze::kernels
