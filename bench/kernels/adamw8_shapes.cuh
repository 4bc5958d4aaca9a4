#pragma once
// The 8-bit AdamW kernel's shapes that the library does not launch, kept for the comparison (bench_adamw8_shapes,
// bench_adamw) and checked bitwise by tests/kernels/adamw8_cuda_test.cu like the two it launches
// (kernels/adamw8.cuh). Fractions of a same-bytes copy on an H200 (bench_adamw8_shapes, 1 Gi bf16 params, flat / 64
// tensors; bench/results/h200/adamw8_shapes.jsonl), against 0.83 / 0.81 for half-warp-interleaved-pipelined and
// 0.77 / 0.75 for warp-interleaved-pipelined:
//   half-warp                  the first shape: 0.65 / 0.56 (bench_adamw: 0.58 flat, bench/results/h200/adamw.jsonl)
//   half-warp-branch-free      the same mapping, straight-line per-element code, 128 registers: 0.67 / 0.64
//   half-warp-interleaved      + whole sectors per instruction: 0.77 / 0.75
//   warp-interleaved           a warp per state block, half the registers a lane, 4 blocks (32 warps) per SM: 0.75 / 0.75
// With a float among the types half-warp-interleaved-pipelined spills 150-238 bytes a thread.
#include <tuple>

#include "squeeze/kernels/adamw8.cuh"

namespace squeeze::bench::adamw8 {

namespace sk = squeeze::kernels;

// The update as first written: decode, adamw_element, absmax over the valid elements (a branch per element),
// shuffles over the whole warp, bucket_code, all stores at the end (vector or element stores by the step).
template <class Rec, class G, int N, bool I>
SQUEEZE_DEVICE void update_slice_masked(const Rec& t, const sk::detail::BlockStep& st, sk::detail::LaneShare<N, I> share,
                                        const sk::detail::LaneSlice<G, N>& x, const sk::detail::StateTables& tab, const sk::AdamWScalars& s) {
  using namespace sk::detail;
  float w[N], m[N], v[N];
  float m_max = 0.0f, v_max = 0.0f;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    w[k] = __uint_as_float(x.w[k]);
    m[k] = tab.mval[code_at(x.m, k)] * x.m_scale;
    v[k] = tab.vval[code_at(x.v, k)] * x.v_scale;
    sk::adamw_element(w[k], m[k], v[k], grad_at(x, k), s);
    if (share.at(k) < st.len) {
      m_max = fabsf(m[k]) > m_max ? fabsf(m[k]) : m_max;  // as the CPU twin (NaN never wins)
      v_max = fabsf(v[k]) > v_max ? fabsf(v[k]) : v_max;
    }
  }
  m_max = group_max<LaneShare<N, I>::kLanes>(m_max, 0xffffffffu);
  v_max = group_max<LaneShare<N, I>::kLanes>(v_max, 0xffffffffu);
  const float m_inv = sk::inverse_absmax(m_max), v_inv = sk::inverse_absmax(v_max);
  std::uint8_t mc[N], vc[N];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    mc[k] = std::uint8_t(sk::bucket_code(tab.mbucket, m[k] * m_inv, true));
    vc[k] = std::uint8_t(sk::bucket_code(tab.vbucket, v[k] * v_inv, false));
  }
  if (st.vector) {
    store_weights(t, st.b * sk::kStateBlock, share, w);
    store_codes(t, st.b * sk::kStateBlock, share, mc, vc);
  } else {
    store_elements(t, st, share, w, mc, vc);
  }
  if (st.valid && share.lane == 0) {
    t.m_absmax()[st.b] = m_max;
    t.v_absmax()[st.b] = v_max;
  }
}

// The shapes (kernels/adamw8.cuh describes the knobs); branch_free: the straight-line update (false: the masked one).
struct HalfWarp {
  static constexpr const char* name = "half-warp";
  static constexpr int threads = 256, per_lane = 16, blocks_in_flight = 1, min_blocks_per_sm = 1;
  static constexpr bool interleaved = false, tensor_in_shared = false, branch_free = false;
  template <class... A>
  SQUEEZE_DEVICE static void update(const A&... a) {
    update_slice_masked(a...);
  }
};
struct HalfWarpBranchFree {
  static constexpr const char* name = "half-warp-branch-free";
  static constexpr int threads = 256, per_lane = 16, blocks_in_flight = 1, min_blocks_per_sm = 2;
  static constexpr bool interleaved = false, tensor_in_shared = true, branch_free = true;
};
struct HalfWarpInterleaved {
  static constexpr const char* name = "half-warp-interleaved";
  static constexpr int threads = 256, per_lane = 16, blocks_in_flight = 1, min_blocks_per_sm = 2;
  static constexpr bool interleaved = true, tensor_in_shared = true, branch_free = true;
};
struct WarpInterleaved {
  static constexpr const char* name = "warp-interleaved";
  static constexpr int threads = 256, per_lane = 8, blocks_in_flight = 1, min_blocks_per_sm = 4;
  static constexpr bool interleaved = true, tensor_in_shared = true, branch_free = true;
};

// Every shape, the library's two included, in the order they were tried (the tests and benchmarks run each one).
using Shapes = std::tuple<HalfWarp, HalfWarpBranchFree, HalfWarpInterleaved, sk::AdamW8HalfWarpInterleavedPipelined, WarpInterleaved,
                          sk::AdamW8WarpInterleavedPipelined>;
// Whether a shape's update is the straight-line one (the library's always are).
template <class Policy>
constexpr bool branch_free() {
  if constexpr (requires { Policy::branch_free; }) return Policy::branch_free;
  else return true;
}

}  // namespace squeeze::bench::adamw8
