#pragma once
// CUDA launchers of AdamW with 8-bit block-wise state (maps, block update and CPU twin: adamw8.hpp).
//   adamw8_cuda(tensor, coeffs, dynamic, stream)   one flat buffer
//   adamw8_cuda(table, coeffs, dynamic, stream)    a DeviceTensorTable of tensors, ONE launch for all
//   adamw8_cuda<Policy>(...)                       the same with a kernel shape other than AdamW8DefaultPolicy<P, G>
// (advance a device step counter with adamw_commit_step_cuda from adamw.cuh, as for the fp32 state).
//
// The kernel's shape is a policy (the two below are the ones adamw8_cuda launches; the shapes they were chosen over, kept
// for the comparison, are in bench/kernels/adamw8_shapes.cuh). In every shape a group of lanes (a half-warp
// or a warp) owns one state block of 256 elements, per_lane elements a lane, moved with vector loads and stores; it
// decodes m and v from the value tables in shared memory, runs adamw_element, reduces the block's two absmax values
// with shuffles inside the group, and encodes by the bucket rule over the bucket tables in shared memory (one read per
// value; the tables are built once per block from the maps by bucket_entry, the CPU's own function). Blocks walk the
// 16 Ki-element chunks of tensor_list.hpp grid-stride, a resident grid's worth of blocks, so the tables are built a few
// times per SM, not once per chunk. Tensors whose buffers are not 16-byte aligned, and each tensor's last partial state
// block, take the same path element by element.
//
// Same arithmetic as the CPU twin, bit for bit, in every shape: adamw_element's multiply-adds are explicit FMAs on
// both sides (adamw.hpp), the maps, the bucket tables and the nearest-code rule are shared, and each absmax is the
// largest |value| over exactly its block's elements. tests/kernels/adamw8_cuda_test.cu checks one step bitwise for
// every shape (these and the benchmark's) and type pair.
#include <atomic>
#include <tuple>
#include <type_traits>

#include "squeeze/kernels/adamw8.hpp"
#include "squeeze/kernels/tensor_list.cuh"
#include "squeeze/kernels/types.cuh"

namespace squeeze::kernels {

static_assert(kChunkElems % kStateBlock == 0, "chunks must be whole state blocks");

// ---- shapes ---------------------------------------------------------------------------------------------
// A policy names one shape of adamw8_kernel:
//   threads            threads per block
//   per_lane           elements per lane: 16 (a half-warp per state block, two blocks per warp) or 8 (a full warp)
//   interleaved        false: a lane owns per_lane consecutive elements (one 16-byte load covers 4 floats of one
//                      lane, so a warp's load of fp32 or 16-bit data touches every 32-byte sector only in part and
//                      L2 sees twice the requests); true: a lane owns groups of 4 consecutive elements, group j of
//                      lane l at 4 (j x lanes + l), so each load and store instruction covers whole sectors
//   blocks_in_flight   1: a warp loads its state blocks, computes, stores, then loads the next ones;
//                      2: the next iteration's loads are issued before the current blocks are computed (software
//                      pipelined within a chunk), so a warp's memory requests overlap its arithmetic
//   min_blocks_per_sm  __launch_bounds__'s minimum resident blocks: caps registers at 64 Ki / (threads x this)
//   tensor_in_shared   tensor tables only: each warp keeps its tensor's record (7 pointers and the size) in shared
//                      memory and reads it afresh where used, so it holds no registers across the arithmetic (a flat
//                      tensor's record is a kernel parameter, in the constant bank, either way)
// The update is straight-line code (update_slice_branch_free); a policy may bring its own as a static member function
// update with update_slice's parameters (bench/kernels/adamw8_shapes.cuh's first shape does).
// Only the mapping of elements to lanes, the order of loads and stores and the instructions' spelling differ between
// shapes; the numbers computed are the same.
// Half-warp per state block, interleaved, the next blocks' loads in flight while computing.
struct AdamW8HalfWarpInterleavedPipelined {
  static constexpr const char* name = "half-warp-interleaved-pipelined";
  static constexpr int threads = 256, per_lane = 16, blocks_in_flight = 2, min_blocks_per_sm = 2;
  static constexpr bool interleaved = true, tensor_in_shared = true;
};
// A warp per state block, interleaved, the next block's loads in flight, 2 blocks per SM.
struct AdamW8WarpInterleavedPipelined {
  static constexpr const char* name = "warp-interleaved-pipelined";
  static constexpr int threads = 256, per_lane = 8, blocks_in_flight = 2, min_blocks_per_sm = 2;
  static constexpr bool interleaved = true, tensor_in_shared = true;
};

// The shape adamw8_cuda launches unless told otherwise, per parameter and gradient type: with 16-bit ones the fastest
// measured (half-warp-interleaved-pipelined; measured: docs/results.md, Fused AdamW, the 8-bit kernel's shapes); with a
// float among them that shape spills, so the warp-per-block pipelined one, which does not (same bits; not timed with
// float types).
template <class P, class G>
using AdamW8DefaultPolicy =
    std::conditional_t<sizeof(P) == 2 && sizeof(G) == 2, AdamW8HalfWarpInterleavedPipelined, AdamW8WarpInterleavedPipelined>;

template <class Policy>
inline constexpr bool adamw8_policy_ok = (Policy::per_lane == 8 || Policy::per_lane == 16) &&
                                         (Policy::blocks_in_flight == 1 || Policy::blocks_in_flight == 2) && Policy::threads % 32 == 0 &&
                                         Policy::threads >= 32 && Policy::threads <= 1024 && Policy::min_blocks_per_sm >= 1;

// The two maps' values, passed by value to the kernel (2 KiB of parameters); midpoints and bucket tables are rebuilt
// in shared memory with the host's expressions, so they are the same numbers.
struct StateMapValues {
  float m[kStateCodes];
  float v[kStateCodes];
};

inline StateMapValues state_map_values() {
  StateMapValues out;
  std::memcpy(out.m, signed_state_map().value, sizeof out.m);
  std::memcpy(out.v, unsigned_state_map().value, sizeof out.v);
  return out;
}

namespace detail {

// Largest value over each group of Lanes lanes (16: both halves of the warp at once, or each half alone when
// the halves took different branches: mask names this lane's group).
template <int Lanes>
SQUEEZE_DEVICE float group_max(float x, unsigned mask) {
#pragma unroll
  for (int o = Lanes / 2; o >= 1; o >>= 1) x = fmaxf(x, __shfl_xor_sync(mask, x, o));
  return x;
}
template <int Lanes>
SQUEEZE_DEVICE unsigned group_mask() {
  if constexpr (Lanes == 32)
    return 0xffffffffu;
  else
    return 0xffffu << (threadIdx.x & 16u);
}

template <class T>
SQUEEZE_DEVICE bool aligned16(const T* p) {
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
}

// Bytes (4, 8 or a multiple of 16) at p, aligned to their size (16 at most), as words: ld.global.cg (as the fp32
// kernels: through L2 only, the stream is read once) and back with st.global.wb.
template <int Bytes>
SQUEEZE_DEVICE void load_bytes(const void* p, std::uint32_t* out) {
  if constexpr (Bytes % 16 == 0) {
#pragma unroll
    for (int k = 0; k < Bytes / 16; ++k) {
      const uint4 u = __ldcg(static_cast<const uint4*>(p) + k);
      out[4 * k] = u.x, out[4 * k + 1] = u.y, out[4 * k + 2] = u.z, out[4 * k + 3] = u.w;
    }
  } else if constexpr (Bytes == 8) {
    const uint2 u = __ldcg(static_cast<const uint2*>(p));
    out[0] = u.x, out[1] = u.y;
  } else {
    static_assert(Bytes == 4, "4, 8 or a multiple of 16 bytes");
    out[0] = __ldcg(static_cast<const unsigned*>(p));
  }
}
template <int Bytes>
SQUEEZE_DEVICE void store_bytes(void* p, const std::uint32_t* in) {
  if constexpr (Bytes % 16 == 0) {
#pragma unroll
    for (int k = 0; k < Bytes / 16; ++k)
      __stwb(static_cast<uint4*>(p) + k, make_uint4(in[4 * k], in[4 * k + 1], in[4 * k + 2], in[4 * k + 3]));
  } else if constexpr (Bytes == 8) {
    __stwb(static_cast<uint2*>(p), make_uint2(in[0], in[1]));
  } else {
    static_assert(Bytes == 4, "4, 8 or a multiple of 16 bytes");
    __stwb(static_cast<unsigned*>(p), in[0]);
  }
}

// Which elements of a state block one lane owns (the policy's per_lane and interleaved).
template <int N, bool Interleaved>
struct LaneShare {
  static constexpr int kLanes = int(kStateBlock) / N;  // lanes per state block
  // Elements moved by one vector access: a group of 4 interleaved, the whole share otherwise.
  static constexpr int kGroup = Interleaved ? 4 : N;
  int lane;  // 0 .. kLanes - 1
  // Index inside the state block of this lane's k-th element (consecutive within a group).
  SQUEEZE_DEVICE int at(int k) const {
    if constexpr (Interleaved)
      return ((k / 4) * kLanes + lane) * 4 + k % 4;
    else
      return lane * N + k;
  }
};

// One lane's share of a state block as loaded, before any arithmetic (what a pipelined shape keeps in flight):
// raw bits, widened when computed. Element k of the share is word k of w, half k % 2 of g's word k / 2 (16-bit G) and
// byte k % 4 of word k / 4 of m and v.
template <class G, int N>
struct LaneSlice {
  std::uint32_t w[N];                       // fp32 weight bits (master, or the float param)
  std::uint32_t g[N * int(sizeof(G)) / 4];  // gradient bits
  std::uint32_t m[N / 4], v[N / 4];         // codes
  float m_scale, v_scale;                   // the block's absmax of m and v
};

template <class G, int N>
SQUEEZE_DEVICE float grad_at(const LaneSlice<G, N>& x, int k) {
  if constexpr (sizeof(G) == 4) {
    return __uint_as_float(x.g[k]);
  } else {
    const auto bits = std::uint16_t(x.g[k / 2] >> (16 * (k % 2)));
    G v;
    memcpy(&v, &bits, sizeof v);
    return to_float(v);
  }
}
template <int Words>
SQUEEZE_DEVICE int code_at(const std::uint32_t (&words)[Words], int k) {
  return int((words[k / 4] >> (8 * (k % 4))) & 0xffu);
}

// Which state block a lane group works on and how: b past `last` (the chunk's end) is no block at all (len 0);
// vector: whole and 16-byte aligned, moved in vectors; otherwise element by element.
struct BlockStep {
  std::int64_t b;
  int len;
  bool valid, vector;
};
SQUEEZE_DEVICE BlockStep block_step(std::int64_t b, std::int64_t last, std::int64_t n, bool aligned) {
  BlockStep st;
  st.b = b;
  st.valid = b < last;
  const std::int64_t lo = b * kStateBlock;
  st.len = st.valid ? int(n - lo < kStateBlock ? n - lo : kStateBlock) : 0;
  st.vector = aligned && st.len == kStateBlock;
  return st;
}

// The tables in shared memory.
struct StateTables {
  const float* mval;
  const float* vval;
  const std::int32_t* mbucket;
  const std::int32_t* vbucket;
};

// Where the kernel reads its tensor's record: the value itself (a flat tensor's is a kernel parameter, in the constant
// bank), or this warp's copy in shared memory, read at each use (volatile: the compiler neither keeps the fields in
// registers from one use to the next nor moves the reads), so a pointer is held only while it is used.
template <class P, class G, bool InShared>
struct TensorRecord {
  using Param = P;
  using Grad = G;
  const AdamW8Tensor<P, G>* slot;  // InShared
  AdamW8Tensor<P, G> value;        // otherwise

  template <class T>
  SQUEEZE_DEVICE T read(T AdamW8Tensor<P, G>::*field) const {
    if constexpr (InShared)
      return *const_cast<const volatile T*>(&(slot->*field));
    else
      return value.*field;
  }
  SQUEEZE_DEVICE P* param() const { return read(&AdamW8Tensor<P, G>::param); }
  SQUEEZE_DEVICE float* weights() const {  // the fp32 weights AdamW updates: the master, or the float param itself
    if constexpr (std::is_same_v<P, float>)
      return read(&AdamW8Tensor<P, G>::param);
    else
      return read(&AdamW8Tensor<P, G>::master);
  }
  SQUEEZE_DEVICE const G* grad() const { return read(&AdamW8Tensor<P, G>::grad); }
  SQUEEZE_DEVICE std::uint8_t* exp_avg() const { return read(&AdamW8Tensor<P, G>::exp_avg); }
  SQUEEZE_DEVICE std::uint8_t* exp_avg_sq() const { return read(&AdamW8Tensor<P, G>::exp_avg_sq); }
  SQUEEZE_DEVICE float* m_absmax() const { return read(&AdamW8Tensor<P, G>::exp_avg_absmax); }
  SQUEEZE_DEVICE float* v_absmax() const { return read(&AdamW8Tensor<P, G>::exp_avg_sq_absmax); }
};

// Loads this lane's share of the step's block. Elements past the block's end read as weight 0, gradient 0 and the
// zero codes.
template <class Rec, class G, int N, bool I>
SQUEEZE_DEVICE void load_slice(const Rec& t, const BlockStep& st, LaneShare<N, I> share, LaneSlice<G, N>& x) {
  constexpr int kG = LaneShare<N, I>::kGroup;
  const std::int64_t lo = st.b * kStateBlock;
  if (st.vector) {
    const float* wp = t.weights();
    const G* gp = t.grad();
    const std::uint8_t *mp = t.exp_avg(), *vp = t.exp_avg_sq();
#pragma unroll
    for (int j = 0; j < N / kG; ++j) {
      const std::int64_t a = lo + share.at(j * kG);
      load_bytes<4 * kG>(wp + a, x.w + j * kG);
      load_bytes<kG* int(sizeof(G))>(gp + a, x.g + j * kG * int(sizeof(G)) / 4);
      load_bytes<kG>(mp + a, x.m + j * kG / 4);
      load_bytes<kG>(vp + a, x.v + j * kG / 4);
    }
  } else {
    const float* wp = t.weights();
    const G* gp = t.grad();
    const std::uint8_t *mp = t.exp_avg(), *vp = t.exp_avg_sq();
    float w[N];
    G g[N];
    std::uint8_t mc[N], vc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const bool in = share.at(k) < st.len;
      const std::int64_t i = lo + share.at(k);
      w[k] = in ? wp[i] : 0.0f;
      g[k] = in ? gp[i] : from_float<G>(0.0f);
      mc[k] = in ? mp[i] : kZeroCodeSigned;
      vc[k] = in ? vp[i] : kZeroCodeUnsigned;
    }
    memcpy(x.w, w, sizeof w);
    memcpy(x.g, g, sizeof g);
    memcpy(x.m, mc, sizeof mc);
    memcpy(x.v, vc, sizeof vc);
  }
  x.m_scale = st.valid ? t.m_absmax()[st.b] : 0.0f;
  x.v_scale = st.valid ? t.v_absmax()[st.b] : 0.0f;
}

// The rounded parameters of w[k0 .. k0 + Count - 1], packed into words.
template <class P, int Count, int N>
SQUEEZE_DEVICE void pack_params(const float (&w)[N], int k0, std::uint32_t (&out)[Count * int(sizeof(P)) / 4]) {
  P p[Count];
#pragma unroll
  for (int j = 0; j < Count; ++j) p[j] = from_float<P>(w[k0 + j]);
  memcpy(out, p, sizeof p);
}

// Vector stores of the share's weights (and params), and of its codes.
template <class Rec, int N, bool I>
SQUEEZE_DEVICE void store_weights(const Rec& t, std::int64_t lo, LaneShare<N, I> share, const float (&w)[N]) {
  using P = typename Rec::Param;
  constexpr int kG = LaneShare<N, I>::kGroup;
  float* wp = t.weights();
  P* pp = t.param();
#pragma unroll
  for (int j = 0; j < N / kG; ++j) {
    const std::int64_t a = lo + share.at(j * kG);
    std::uint32_t wb[kG];
    memcpy(wb, w + j * kG, sizeof wb);
    store_bytes<4 * kG>(wp + a, wb);
    if constexpr (!std::is_same_v<P, float>) {
      std::uint32_t pw[kG * int(sizeof(P)) / 4];
      pack_params<P, kG>(w, j * kG, pw);
      store_bytes<kG* int(sizeof(P))>(pp + a, pw);
    }
  }
}
template <class Rec, int N, bool I>
SQUEEZE_DEVICE void store_codes(const Rec& t, std::int64_t lo, LaneShare<N, I> share, const std::uint8_t (&mc)[N],
                                const std::uint8_t (&vc)[N]) {
  constexpr int kG = LaneShare<N, I>::kGroup;
  std::uint8_t *mp = t.exp_avg(), *vp = t.exp_avg_sq();
  std::uint32_t mw[N / 4], vw[N / 4];
  memcpy(mw, mc, sizeof mw);
  memcpy(vw, vc, sizeof vw);
#pragma unroll
  for (int j = 0; j < N / kG; ++j) {
    const std::int64_t a = lo + share.at(j * kG);
    store_bytes<kG>(mp + a, mw + j * kG / 4);
    store_bytes<kG>(vp + a, vw + j * kG / 4);
  }
}
// Element stores of the share's elements inside the block (partial or misaligned blocks).
template <class Rec, int N, bool I>
SQUEEZE_DEVICE void store_elements(const Rec& t, const BlockStep& st, LaneShare<N, I> share, const float (&w)[N],
                                   const std::uint8_t (&mc)[N], const std::uint8_t (&vc)[N]) {
  using P = typename Rec::Param;
  const std::int64_t lo = st.b * kStateBlock;
  float* wp = t.weights();
  P* pp = t.param();
  std::uint8_t *mp = t.exp_avg(), *vp = t.exp_avg_sq();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (share.at(k) >= st.len) continue;
    const std::int64_t i = lo + share.at(k);
    wp[i] = w[k];
    if constexpr (!std::is_same_v<P, float>) pp[i] = from_float<P>(w[k]);
    mp[i] = mc[k];
    vp[i] = vc[k];
  }
}

// The same update in straight-line code (Vector: the step's block is whole and aligned). The absmax is fmaxf over
// every element: padding decodes to 0 (NaN for an infinite scale), which never wins, and fmaxf returns the same
// bits as the CPU's `a > max ? a : max` for a running max that starts at +0 and never holds NaN. Weights and params
// go out as soon as 4 of them (consecutive in memory) are done, so they need no registers across the shuffles.
template <bool Vector, class Rec, class G, int N, bool I>
SQUEEZE_DEVICE void update_slice_branch_free(const Rec& t, const BlockStep& st, LaneShare<N, I> share, const LaneSlice<G, N>& x,
                                             const StateTables& tab, const AdamWScalars& s) {
  using P = typename Rec::Param;
  // Params per store: the 4 of a group interleaved, 16 bytes' worth of consecutive ones otherwise.
  constexpr int kParamRun = I ? 4 : 16 / int(sizeof(P));
  const std::int64_t lo = st.b * kStateBlock;
  float* wp = nullptr;
  P* pp = nullptr;
  if constexpr (Vector) wp = t.weights(), pp = t.param();
  float w[N], m[N], v[N];
  float m_max = 0.0f, v_max = 0.0f;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    w[k] = __uint_as_float(x.w[k]);
    m[k] = tab.mval[code_at(x.m, k)] * x.m_scale;
    v[k] = tab.vval[code_at(x.v, k)] * x.v_scale;
    adamw_element(w[k], m[k], v[k], grad_at(x, k), s);
    m_max = fmaxf(m_max, fabsf(m[k]));
    v_max = fmaxf(v_max, fabsf(v[k]));
    if constexpr (Vector) {
      if (k % 4 == 3) {
        std::uint32_t wb[4];
        memcpy(wb, w + k - 3, sizeof wb);
        store_bytes<16>(wp + lo + share.at(k - 3), wb);
      }
      if constexpr (!std::is_same_v<P, float>) {
        if (k % kParamRun == kParamRun - 1) {
          std::uint32_t pw[kParamRun * int(sizeof(P)) / 4];
          pack_params<P, kParamRun>(w, k - kParamRun + 1, pw);
          store_bytes<kParamRun* int(sizeof(P))>(pp + lo + share.at(k - kParamRun + 1), pw);
        }
      }
    }
  }
  const unsigned mask = group_mask<LaneShare<N, I>::kLanes>();
  m_max = group_max<LaneShare<N, I>::kLanes>(m_max, mask);
  v_max = group_max<LaneShare<N, I>::kLanes>(v_max, mask);
  const float m_inv = inverse_absmax(m_max), v_inv = inverse_absmax(v_max);
  std::uint8_t mc[N], vc[N];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    mc[k] = std::uint8_t(bucket_code_branch_free(tab.mbucket, m[k] * m_inv, true));
    vc[k] = std::uint8_t(bucket_code_branch_free(tab.vbucket, v[k] * v_inv, false));
  }
  if constexpr (Vector)
    store_codes(t, lo, share, mc, vc);
  else
    store_elements(t, st, share, w, mc, vc);
  if (st.valid && share.lane == 0) {
    t.m_absmax()[st.b] = m_max;
    t.v_absmax()[st.b] = v_max;
  }
}

// The policy's own update where it has one, else the straight-line one.
template <class Policy, class Rec, class G, int N, bool I>
SQUEEZE_DEVICE void update_slice(const Rec& t, const BlockStep& st, LaneShare<N, I> share, const LaneSlice<G, N>& x, const StateTables& tab,
                                 const AdamWScalars& s) {
  if constexpr (requires { Policy::update(t, st, share, x, tab, s); }) {
    Policy::update(t, st, share, x, tab, s);
  } else if (st.vector) {
    update_slice_branch_free<true>(t, st, share, x, tab, s);
  } else {
    update_slice_branch_free<false>(t, st, share, x, tab, s);
  }
}

// The record's fp32 weights (master, or the float param itself).
template <class P, class G>
SQUEEZE_DEVICE float* weight_ptr(const AdamW8Tensor<P, G>& t) {
  if constexpr (std::is_same_v<P, float>)
    return t.param;
  else
    return t.master;
}

template <class Policy, class P, class G, class Source>
__global__ void __launch_bounds__(Policy::threads, Policy::min_blocks_per_sm)
    adamw8_kernel(const Source src, const StateMapValues maps, const AdamWCoeffs c, const AdamWDynamic d) {
  static_assert(adamw8_policy_ok<Policy>, "AdamW8 policy: per_lane 8 or 16, blocks_in_flight 1 or 2, threads a multiple of 32");
  constexpr int kN = Policy::per_lane;
  using Share = LaneShare<kN, Policy::interleaved>;
  constexpr int kBlocksPerWarp = 32 / Share::kLanes;
  constexpr int kWarps = Policy::threads / 32;
  __shared__ AdamWScalars shared;
  __shared__ float mval[kStateCodes], vval[kStateCodes], mmid[kStateCodes], vmid[kStateCodes];
  __shared__ std::int32_t mbucket[kCodeBuckets], vbucket[kCodeBuckets];
  constexpr bool kTensorInShared = Policy::tensor_in_shared && !std::is_same_v<Source, FlatSource<AdamW8Tensor<P, G>>>;
  __shared__ AdamW8Tensor<P, G> warp_tensor[kTensorInShared ? kWarps : 1];
  for (int i = threadIdx.x; i < kStateCodes; i += blockDim.x) {
    mval[i] = maps.m[i];
    vval[i] = maps.v[i];
  }
  if (threadIdx.x == 0) shared = adamw_scalars(c, d);
  __syncthreads();
  const AdamWScalars s = shared;
  if (s.skip) return;  // found_inf: uniform over the grid, nothing is written
  for (int i = threadIdx.x; i + 1 < kStateCodes; i += blockDim.x) {
    mmid[i] = 0.5f * (mval[i] + mval[i + 1]);
    vmid[i] = 0.5f * (vval[i] + vval[i + 1]);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kCodeBuckets; i += blockDim.x) {
    mbucket[i] = bucket_entry(mmid, kBucketKeyLo + i, true);
    vbucket[i] = bucket_entry(vmid, kBucketKeyLo + i, false);
  }
  __syncthreads();
  const StateTables tab{mval, vval, mbucket, vbucket};
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int sub = lane / Share::kLanes;  // which of the warp's blocks this lane works on
  const Share share{lane % Share::kLanes};
  constexpr std::int64_t kStride = std::int64_t(kBlocksPerWarp) * kWarps;  // blocks between a warp's steps
  for (std::int64_t chunk = blockIdx.x; chunk < src.chunks; chunk += gridDim.x) {
    std::int64_t local = 0;
    const AdamW8Tensor<P, G> located = src.locate(chunk, local);
    const std::int64_t first = local * (kChunkElems / kStateBlock);  // state block index inside the tensor
    const std::int64_t end = first + kChunkElems / kStateBlock, blocks = state_blocks(located.n);
    const std::int64_t last = end < blocks ? end : blocks, n = located.n;
    const bool aligned = aligned16(located.param) && aligned16(weight_ptr(located)) && aligned16(located.grad) &&
                         aligned16(located.exp_avg) && aligned16(located.exp_avg_sq);
    if constexpr (kTensorInShared) {
      __syncwarp();  // every lane is done with the previous chunk's record
      if (lane == 0) warp_tensor[warp] = located;
      __syncwarp();
    }
    const TensorRecord<P, G, kTensorInShared> t{&warp_tensor[kTensorInShared ? warp : 0], located};
    // The warp's blocks: base + sub for base = first + kBlocksPerWarp * warp, then every kStride blocks (base is
    // uniform over the warp, so are the loop's branches).
    std::int64_t base = first + std::int64_t(kBlocksPerWarp) * warp;
    if constexpr (Policy::blocks_in_flight == 1) {
      for (; base < last; base += kStride) {
        const BlockStep st = block_step(base + sub, last, n, aligned);
        LaneSlice<G, kN> x;
        load_slice(t, st, share, x);
        update_slice<Policy>(t, st, share, x, tab, s);
      }
    } else {
      // Software pipelined inside the chunk: the next step's loads go out before this one's arithmetic. (Across
      // chunks too was slower: the chunk change's state held through the arithmetic spilled at 128 registers.)
      LaneSlice<G, kN> next;
      BlockStep next_st{};
      if (base < last) {
        next_st = block_step(base + sub, last, n, aligned);
        load_slice(t, next_st, share, next);
      }
      while (base < last) {
        const LaneSlice<G, kN> cur = next;
        const BlockStep st = next_st;
        base += kStride;
        if (base < last) {
          next_st = block_step(base + sub, last, n, aligned);
          load_slice(t, next_st, share, next);
        }
        update_slice<Policy>(t, st, share, cur, tab, s);
      }
    }
  }
}

// Blocks for a launch over `chunks`: as many as are resident at once (the tables are built once per block), no
// more than there are chunks.
template <class Policy, class P, class G, class Source>
cudaError_t adamw8_grid(std::int64_t chunks, unsigned& grid) {
  static std::atomic<int> cached{0};  // per instantiation; the same on every GPU of one build's architecture
  int per_sm = cached.load(std::memory_order_relaxed);
  if (per_sm == 0) {
    if (const cudaError_t e =
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, adamw8_kernel<Policy, P, G, Source>, Policy::threads, 0);
        e != cudaSuccess)
      return e;
    per_sm = per_sm < 1 ? 1 : per_sm;
    cached.store(per_sm, std::memory_order_relaxed);
  }
  int sms = 1;
  if (const cudaError_t e = sm_count(sms); e != cudaSuccess) return e;
  grid = unsigned(std::min<std::int64_t>(chunks, std::int64_t(sms) * per_sm));
  return cudaSuccess;
}

}  // namespace detail

// One flat buffer. All pointers are device pointers (d's too). Returns the launch status.
template <class Policy = void, class P, class G>  // void: AdamW8DefaultPolicy<P, G>
cudaError_t adamw8_cuda(const AdamW8Tensor<P, G>& t, const AdamWCoeffs& c, const AdamWDynamic& d = {}, cudaStream_t stream = nullptr) {
  using Shape = std::conditional_t<std::is_void_v<Policy>, AdamW8DefaultPolicy<P, G>, Policy>;
  validate(t, "AdamW8 (CUDA) tensor");
  const std::int64_t chunks = chunks_of(t.n);
  if (chunks == 0) return cudaSuccess;
  using Source = FlatSource<AdamW8Tensor<P, G>>;
  unsigned grid = 0;
  if (const cudaError_t e = detail::adamw8_grid<Shape, P, G, Source>(chunks, grid); e != cudaSuccess) return e;
  detail::adamw8_kernel<Shape, P, G><<<grid, Shape::threads, 0, stream>>>(Source{t, chunks}, state_map_values(), c, d);
  return cudaGetLastError();
}

// A list of tensors in one launch. The table was validated when uploaded.
template <class Policy = void, class P, class G>  // void: AdamW8DefaultPolicy<P, G>
cudaError_t adamw8_cuda(const TensorTable<AdamW8Tensor<P, G>>& table, const AdamWCoeffs& c, const AdamWDynamic& d = {},
                        cudaStream_t stream = nullptr) {
  using Shape = std::conditional_t<std::is_void_v<Policy>, AdamW8DefaultPolicy<P, G>, Policy>;
  check(table.count == 0 || (table.entries != nullptr && table.chunk_prefix != nullptr),
        "AdamW8 (CUDA): tensor table has null entries; build it with DeviceTensorTable::upload");
  if (table.chunks == 0) return cudaSuccess;
  using Source = TableSource<AdamW8Tensor<P, G>>;
  unsigned grid = 0;
  if (const cudaError_t e = detail::adamw8_grid<Shape, P, G, Source>(table.chunks, grid); e != cudaSuccess) return e;
  detail::adamw8_kernel<Shape, P, G><<<grid, Shape::threads, 0, stream>>>(Source{table, table.chunks}, state_map_values(), c, d);
  return cudaGetLastError();
}

}  // namespace squeeze::kernels
