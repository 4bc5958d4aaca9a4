#pragma once
// The sm90 family of the quantized GEMM (4-bit weights, Hopper, sm_90a builds): y [M, N] = x [M, K] * W^T computed
// transposed, Y^T [N, M] = W [N, K] * X^T [K, M], so the large N is wgmma's M dimension (64 per instruction) and the
// batch is wgmma's N (BN = 16, 32, 64 or 128): one m64nBNk16 wgmma covers 64 output features x the batch slice x 16 k.
// Below 9 batch rows mma.sync consumers (Sm90Knobs::mma_sync) run in the same warp-specialised ring. Why a second
// family: the mma.sync kernel re-reads x per strip and runs far below the tensor-core rate from M = 64 on.
// The kernel (here, with its launchers: capacity query, tensor map, checks) is composed of device functions along
// CUTLASS's seams, one file each under gemm/sm90/, each including the one before: params.cuh (Sm90Group, Sm90Params,
// the work policy), scheduler.cuh (sm90_tile), mainloop.cuh (sm90_load_chunk, sm90_produce), mma.cuh (decode and
// mma: sm90_mma_chunk, sm90_retire, sm90_scale_group), epilogue.cuh (with the K-split reductions: sm90_epilogue,
// sm90_store_tile, sm90_store_sums). A few small helpers are `inline`, not forced (sm90_group_of, sm90_retire, sm90_scale_group, the
// store helpers), and sm90_mma_chunk takes the kernel's values by reference as the lambda it replaces captured them:
// nvcc then inlines and folds them as it did the lambdas, and the kernels' code is unchanged (forced, or by value, the
// address arithmetic and the reduction loops came out differently).
//
// Operands:
//   A (weights) from registers. The tile layout (layout.hpp) already holds, in 32-bit word ks of lane l of a tile, the
//     eight codes of that lane's A fragment for k-step ks: pairs 0 / 2 / 1 / 3 of the word are the fragment's
//     registers a0..a3 (rows n = l/4, l/4 + 8; k = 2 (l%4), 2 (l%4) + 8). wgmma's register A fragment is the
//     mma.m16n8k16 one per warp, warp w of the warpgroup taking rows 16 w .. 16 w + 15, so warp w decodes tile w of
//     four consecutive tiles and the four warps form the m64 operand. Decode: magic + q minus (magic + z) is the exact
//     q - z, times the group's scale gives the weight, rounded to T once (fp16: 2^-11 relative; bf16: the fp16 scale
//     rounded to bf16 and the product rounded, ~2^-8); with group_scale the exact q - z, each group's fp32 sums scaled.
//   B (x^T) from shared memory, K-major, 128-byte swizzle: a stage holds x [BN rows][64 k] (128 B per row, 8-row atoms
//     of 1024 B, 16-byte chunk c of row r at chunk c ^ (r % 8)); the descriptor of k-step ks starts 32 B further into
//     the atom (the hardware applies the swizzle to the address bits).
// Block: WGS consumer warpgroups take a strip of 64 WM WGS output features x BN batch rows x one K range of cps 64-k
// chunks through a STAGES-deep ring; one stage = x [BN][64] (swizzled), the strip's weight tiles of the chunk and the
// scale / zero-point rows of the (at most four) groups the chunk touches. Per chunk and k-step a consumer decodes its
// WM A fragments, fences and queues WM wgmma, then waits for the chunk's wgmma before the stage is refilled. The ring is
// filled either block-synchronously (every thread's cp.async, a block barrier per chunk) or, in what the dispatch runs,
// warp-specialised: one producer warp queues a chunk as one TMA copy of x (zeros past M and K) plus bulk copies of the
// tiles and group rows on a full mbarrier, and each consumer warp releases a stage on its empty mbarrier (much faster
// than block-synchronous; measured: docs/kernels/quant-gemm.md).
// K splits (plan.hpp): summed in a cluster's distributed shared memory, or through global memory by every block of a
// tile (spread) or by its last block; all in K-range order (deterministic).
//
// Limits (qgemm_sm90_reason; qgemm_cuda serves the rest): 4-bit tiles, K % 8 == 0 (16-byte x copies; the tensor map's
// row pitch), 16-byte aligned x / tiles / scales / zeros, group % 16 == 0. Any M, N and K (more batch slices past BN;
// zero-filled copies and predicated stores at the edges). Act-order: the caller gathers x by QTiles::perm. Compiled
// for another target than sm_90a the kernel is empty and the launcher returns cudaErrorNotSupported
// (qgemm_sm90_supported() says so without launching the GEMM).
#if !defined(__CUDACC__)
#error "gemm/sm90.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include "squeeze/kernels/quant/gemm/sm90/epilogue.cuh"

namespace squeeze::kernels::quant {
namespace detail {

// ==== the kernel =======================================================================================================
// grid (zslices x strips, 1, splits); C::THREADS threads, C::SMEM_BYTES dynamic shared memory.
// CLUSTER: K splits reduce within clusters of (1, 1, splits) blocks; otherwise K splits (if any) go through global
// memory. Two kernels rather than a flag, so that the global one carries no cluster code (one kernel holding both ran
// the global plans slower).
// x_map: (WS) x as a TMA tensor map, box [64 k] x [BN rows], 128-byte swizzle (unused otherwise)
template <class T, class C, bool CLUSTER>
__global__ void __launch_bounds__(C::THREADS, C::MINB) qgemm_sm90_kernel(const Sm90Params p, const __grid_constant__ CUtensorMap x_map) {
#if SQUEEZE_SM90_WGMMA
  using Work = typename WorkOf<C, Sm90Work>::type;
  constexpr int BN = C::BN, WM = C::WM, S = C::STAGES, STRIP = C::STRIP, NACC = BN / 2;
  constexpr int XB = C::X_BYTES, WB = C::W_BYTES, SB = C::S_BYTES;
  extern __shared__ unsigned char smem_raw[];
  __shared__ int last_flag;  // K splits through global memory: this block is the tile's last
  // the 128B swizzle repeats every 1024 B of address: align the ring to it
  unsigned char* const smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);

  // the warp index through a shuffle: the compiler then knows it is warp-uniform, so a branch on it (the
  // producer's) is not a divergent path around the wgmma (which would serialize them)
  const int tid = threadIdx.x, lane = tid & 31, warp = __shfl_sync(0xffffffffu, tid >> 5, 0), wg = warp >> 2, wq = warp & 3;
  if (tid == 0) Work::at(p, Sm90Point::Entry);
  const int g4 = lane >> 2, c4 = lane & 3;
  const int ntiles = p.Npad / kTileN;
  const Sm90Tile b = sm90_tile<C>(p);
  const int kc0 = b.kc0, nck = b.nck;

  float acc[WM][NACC];
  // GSCALE: the wgmma accumulate the current group's unscaled sums here; sm90_scale_group adds them, scaled, to acc
  float acc_group[WM][NACC];
  float(&mma_acc)[WM][NACC] = C::GSCALE ? acc_group : acc;

  // this thread's A rows: tile (wg * 4 WM + 4 t + wq) of the strip, rows l/4 and l/4 + 8 of it
  const int nl = wg * 64 * WM + wq * 16 + g4;  // feature of row l/4 of tile t = 0, relative to the strip
  // The first k of the group after the one grp holds. Starts at the first k-step's own group, so that the first k-step
  // loads its constants.
  int next_group_k = sm90_group_of(p, kc0 * kTileK) * p.group;
#pragma unroll
  for (int t = 0; t < WM; ++t)
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[t][i] = acc_group[t][i] = 0.f;
  Sm90Group grp[WM];
  // x's descriptor at the ring's base: a stage's and k-step's descriptor adds their byte offset / 16 (the start
  // address field; the ring lies below 2^18 bytes, so the sum stays within it)
  const std::uint64_t x_desc0 = sw128_desc(smem_addr(smem));
  // A fragments, two sets used by alternate chunks: a wgmma reads its A registers until it completes, so with
  // OVERLAP (chunk c in flight while chunk c + 1 is decoded) chunk c + 1 must decode into the other set. Each set
  // is pinned after the wait that retires its chunk, which keeps its registers reserved until then (a rolled loop
  // with one set would decode chunk c + 1 into the registers chunk c's wgmma is still reading).
  std::uint32_t a0[4][WM][4] = {}, a1[4][WM][4] = {};
  auto mma_chunk = [&](const unsigned char* st, int kc, auto& a, auto&& after_first) {
    sm90_mma_chunk<T, C, Work>(p, smem, st, kc, x_desc0, wg, wq, lane, nl, next_group_k, grp, mma_acc, a, after_first);
  };
  auto epilogue = [&] {
    if constexpr (C::OVERLAP) {  // the last chunk's wgmma; accumulators are read only after this
      wgmma_wait<0>();
      pin_operands(a0, mma_acc);
      pin_a(a1);
    }
    sm90_epilogue<T, C, CLUSTER, Work>(p, smem, b, acc, tid, lane, c4, nl, last_flag);
  };

  if constexpr (C::WS) {
    // full[s]: the producer's expect-tx arrive + the TMA / bulk bytes;
    // empty[s]: one arrive per consumer warp once the wgmma reading stage s finished
    __shared__ std::uint64_t full_bar[S], empty_bar[S];
    // the producer's first TMA copy needs x's tensor map: fetch it while the barriers are set up
    if (warp == C::CONSUMERS / 32 && lane == 0) asm volatile("prefetch.tensormap [%0];\n" ::"l"(&x_map) : "memory");
    if (tid == 0) {
#pragma unroll
      for (int sl = 0; sl < S; ++sl) {
        mbar_init(full_bar + sl, 1);
        mbar_init(empty_bar + sl, C::CONSUMERS / 32);
      }
      mbar_init_fence();
    }
    __syncthreads();
    if (tid == 0) Work::at(p, Sm90Point::SetUp);
    if (warp >= C::CONSUMERS / 32) {  // the producer (warp CONSUMERS / 32; with WGS = 4 the rest of its warpgroup idles)
      if constexpr (C::PRODUCERS == 128) set_max_regs_dec<C::PRODUCER_REGS>();
      // the cluster barriers of the K-split reduction count every thread: the producer's take part, idle
      if (warp > C::CONSUMERS / 32) {
        if (CLUSTER && p.splits > 1) {
          cluster_sync();
          cluster_sync();
        }
        return;
      }
      sm90_produce<T, C, Work>(p, x_map, smem, full_bar, empty_bar, b, ntiles, lane);
      if (CLUSTER && p.splits > 1) {  // the reduction's two cluster barriers (see sm90_epilogue)
        cluster_sync();
        cluster_sync();
      }
      return;  // the consumers wait for every copy it queued (full barriers) before they leave
    } else {
      if constexpr (C::PRODUCERS == 128) set_max_regs_inc<C::CONSUMER_REGS>();
      auto consume = [&](int c, auto& a_cur, auto& a_other) {  // chunk c of the K range, from ring stage c % S
        const int ring = c % S;
        mbar_wait(full_bar + ring, unsigned(c / S) & 1u);
        if (c == 0 && tid == 0) Work::at(p, Sm90Point::FirstChunk);
        __syncwarp();  // converged again before the .aligned wgmma operations
        if constexpr (!Work::kConsume) {
          if (lane == 0) mbar_arrive(empty_bar + ring);
          __syncwarp();
          return;
        }
        mma_chunk(smem + ring * C::STAGE_BYTES, kc0 + c, a_cur, [] {});
        sm90_retire<C>(a_cur, a_other, mma_acc);
        // GSCALE: the group ends with this chunk (the K range's last, or the next chunk starts the group after:
        // groups are whole chunks, and next_group_k is where the one grp holds ends)
        if constexpr (C::GSCALE)
          if (c + 1 == nck || (kc0 + c + 1) * kTileK >= next_group_k) sm90_scale_group<C>(acc, acc_group, grp);
        // the stage the finished wgmma read goes back to the producer (OVERLAP: the chunk before's)
        if (lane == 0 && (!C::OVERLAP || c > 0)) mbar_arrive(empty_bar + (C::OVERLAP ? (c + S - 1) % S : ring));
        __syncwarp();
      };
      for (int c = 0; c < nck; c += 2) {  // pairs: the two A sets alternate with static names
        consume(c, a0, a1);
        if (c + 1 < nck) consume(c + 1, a1, a0);
      }
      if (tid == 0) Work::at(p, Sm90Point::LoopEnd);
      epilogue();
      if (tid == 0) Work::at(p, Sm90Point::End);
    }
  } else {
    constexpr int AHEAD = C::AHEAD;
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {  // prologue: AHEAD chunks in flight (a group per stage, empty ones too)
      if (s < nck) sm90_load_chunk<T, C>(p, smem, b, ntiles, tid, kc0 + s, s);
      cp_async_commit();
    }
    auto step = [&](int c, auto& a_cur, auto& a_other) {
      cp_async_wait<AHEAD - 1>();  // this thread's copies of chunk c landed
      fence_proxy_async();
      // everyone's copies landed; every wgmma of chunk c - 1 (OVERLAP: c - 2) finished (retired below), so the
      // stage it read may be refilled
      __syncthreads();
      mma_chunk(smem + (c % S) * C::STAGE_BYTES, kc0 + c, a_cur, [&] {  // refill the stage chunk c - 1 (OVERLAP: c - 2) used
        const int nx = c + AHEAD;
        if (nx < nck) sm90_load_chunk<T, C>(p, smem, b, ntiles, tid, kc0 + nx, nx % S);
        cp_async_commit();
        __syncwarp();  // the copy loops' trip counts differ per thread: reconverge before the .aligned wgmma ops
      });
      sm90_retire<C>(a_cur, a_other, mma_acc);
    };
    for (int c = 0; c < nck; c += 2) {
      step(c, a0, a1);
      if (c + 1 < nck) step(c + 1, a1, a0);
    }
    cp_async_wait<0>();  // no copy may land after the block exits
    epilogue();
  }
#endif
}

// Writes 1 when this build's device code has wgmma (compiled for sm_90a), 0 otherwise. A template, so that several
// translation units of one program may include this header.
template <int = 0>
__global__ void sm90_wgmma_available(int* out) {
  *out = SQUEEZE_SM90_WGMMA;
}

}  // namespace detail

// ---- host launchers ------------------------------------------------------------------------------------
// True when the current device is sm_90 and this build's device code has wgmma (sm_90a). The first call
// launches a one-thread probe and synchronizes; the answer is cached for the process.
inline bool qgemm_sm90_supported() {
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess || major != 9 || minor != 0) {
      cudaGetLastError();
      return false;
    }
    int* flag = nullptr;
    int host = 0;
    bool good = cudaMalloc(&flag, sizeof(int)) == cudaSuccess;
    if (good) {
      detail::sm90_wgmma_available<><<<1, 1>>>(flag);
      good = cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess && host == 1;
      cudaFree(flag);
    }
    cudaGetLastError();  // a launch without a kernel image for this device is an answer, not a sticky error
    return good;
  }();
  return ok;
}

namespace detail {
// x [M, K] (fp16 / bf16, row-major, K % 8 == 0, 16-byte aligned) as a TMA tensor map: boxes of [64 k] x [box_rows]
// rows, 128-byte swizzle (the layout sw128_desc describes), zeros past M and K. The driver's encoder is looked up
// once through the runtime (no link against libcuda); cudaErrorNotSupported when the driver has none.
inline cudaError_t make_x_tensor_map(CUtensorMap& map, const void* x, std::int64_t M, std::int64_t K, int box_rows, bool bf16_data) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    cudaGetLastError();
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {cuuint64_t(K), cuuint64_t(M)};
  const cuuint64_t row_stride[1] = {cuuint64_t(K) * 2};
  const cuuint32_t box[2] = {cuuint32_t(kTileK), cuuint32_t(box_rows)};
  const cuuint32_t step[2] = {1, 1};
  const CUresult r = encode(&map, bf16_data ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, const_cast<void*>(x),
                            dims, row_stride, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The launch of a configuration-C kernel over `grid`, in clusters of (1, 1, cluster) blocks (the K ranges of a tile),
// or without a cluster attribute for cluster 0; for cudaLaunchKernelEx and cudaOccupancyMaxActiveClusters (which
// wants the attribute, 1 included). cooperative: every block resident at once, or the launch fails (the spread
// reduction's blocks wait for each other). Not copyable: cfg points at attrs.
template <class C>
struct Sm90Launch {
  cudaLaunchAttribute attrs[2]{};
  cudaLaunchConfig_t cfg{};
  Sm90Launch(dim3 grid, int cluster, cudaStream_t stream, bool cooperative = false) {
    cfg.gridDim = grid;
    cfg.blockDim = dim3(C::THREADS);
    cfg.dynamicSmemBytes = C::SMEM_BYTES;
    cfg.stream = stream;
    cfg.attrs = attrs;
    if (cluster > 0) {
      cudaLaunchAttribute& a = attrs[cfg.numAttrs++];
      a.id = cudaLaunchAttributeClusterDimension;
      a.val.clusterDim.x = 1;
      a.val.clusterDim.y = 1;
      a.val.clusterDim.z = unsigned(cluster);
    }
    if (cooperative) {
      cudaLaunchAttribute& a = attrs[cfg.numAttrs++];
      a.id = cudaLaunchAttributeCooperative;
      a.val.cooperative = 1;
    }
  }
  Sm90Launch(const Sm90Launch&) = delete;
  Sm90Launch& operator=(const Sm90Launch&) = delete;
};

// Lets the kernels of (T, C), both reductions, take C::SMEM_BYTES of dynamic shared memory: once per (T, C), for the
// launcher and the capacity query alike.
template <class T, class C>
cudaError_t sm90_allow_smem() {
  static const cudaError_t attr = [] {
    const cudaError_t a = cudaFuncSetAttribute(qgemm_sm90_kernel<T, C, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM_BYTES);
    return a != cudaSuccess
               ? a
               : cudaFuncSetAttribute(qgemm_sm90_kernel<T, C, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM_BYTES);
  }();
  return attr;
}

// The current device's capacity for configuration C: blocks per SM x SMs, and cudaOccupancyMaxActiveClusters per
// cluster size; asked once per configuration. Where the device cannot say (no sm_90a code, not an sm_90 device), the
// even capacity of sm_count SMs.
template <class C>
Sm90Capacity sm90_capacity(int sm_count) {
  static const Sm90Capacity asked = [] {
    Sm90Capacity c;
    c.slots = 0;
    if (!qgemm_sm90_supported()) return c;
    const auto kernel = qgemm_sm90_kernel<bf16, C, true>;  // the cluster kernels (fp16 takes the same resources)
    int dev = 0, sms = 0, per_sm = 0, per_sm_bf16 = 0, per_sm_half = 0;
    if (sm90_allow_smem<bf16, C>() != cudaSuccess || sm90_allow_smem<half, C>() != cudaSuccess || cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, C::THREADS, C::SMEM_BYTES) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_bf16, qgemm_sm90_kernel<bf16, C, false>, C::THREADS, C::SMEM_BYTES) !=
            cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm_half, qgemm_sm90_kernel<half, C, false>, C::THREADS, C::SMEM_BYTES) !=
            cudaSuccess) {
      cudaGetLastError();
      return c;
    }
    c.slots = per_sm * sms;
    c.spread_slots = std::min(per_sm_bf16, per_sm_half) * sms;
    for (int k = 1; k <= kSm90MaxClusterSplits; ++k) {
      const Sm90Launch<C> launch(dim3(1, 1, unsigned(k)), k, nullptr);
      if (cudaOccupancyMaxActiveClusters(&c.clusters[k], kernel, &launch.cfg) != cudaSuccess) {
        cudaGetLastError();
        c.clusters[k] = 0;
      }
    }
    return c;
  }();
  return asked.slots > 0 ? asked : sm90_even_capacity<C>(sm_count);
}

// Configuration C with an explicit plan (benchmarks, tests). K splits reduced in a cluster launch as clusters of
// (1, 1, splits) blocks; reduced through global memory they need the plan's workspace. work_data: Sm90Params::work_data
// (a measuring Work's buffer; the GEMM's takes none).
template <class T, class C>
cudaError_t launch_qgemm_sm90_cfg(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y,
                                  const QGemmShape& s, const Sm90Plan& p, const QGemmWorkspace& ws, cudaStream_t stream,
                                  void* work_data = nullptr) {
  static_assert(std::is_same_v<T, half> || std::is_same_v<T, bf16>, "the quantized GEMM takes fp16 or bf16 activations");
  if (!qgemm_sm90_reason(s).empty()) return cudaErrorInvalidValue;
  if ((reinterpret_cast<std::uintptr_t>(x) | reinterpret_cast<std::uintptr_t>(tiles) | reinterpret_cast<std::uintptr_t>(scales) |
       reinterpret_cast<std::uintptr_t>(zeros)) &
      15)
    return cudaErrorInvalidValue;                                                     // 16-byte copies
  if (std::int64_t(p.zslices) * p.strips > 0x7fffffff) return cudaErrorInvalidValue;  // the grid's x dimension
  if (p.splits < 1 || p.splits > (p.cluster ? kSm90MaxClusterSplits : kSm90MaxSplits)) return cudaErrorInvalidValue;  // a portable cluster
  if (!sm90_ranges_cover(p, s.Kpad / kTileK) || (p.cluster && p.lead < p.splits)) return cudaErrorInvalidValue;
  if (C::GSCALE && s.group % kTileK) return cudaErrorInvalidValue;  // per-group scaling: groups of whole chunks
  const bool global = p.splits > 1 && !p.cluster;
  if (global &&
      (ws.partial == nullptr || ws.partial_elems < p.partial_elems || ws.counters == nullptr || ws.counter_elems < p.counter_elems))
    return cudaErrorInvalidValue;
  if (global && (reinterpret_cast<std::uintptr_t>(ws.partial) & 15)) return cudaErrorInvalidValue;  // float4 sums
  if (!qgemm_sm90_supported()) return cudaErrorNotSupported;
  const auto kernel = p.cluster ? qgemm_sm90_kernel<T, C, true> : qgemm_sm90_kernel<T, C, false>;
  if (const cudaError_t attr = sm90_allow_smem<T, C>(); attr != cudaSuccess) return attr;
  CUtensorMap x_map{};
  if constexpr (C::WS)
    if (const cudaError_t e = make_x_tensor_map(x_map, x, s.M, s.K, C::BN, std::is_same_v<T, bf16>); e != cudaSuccess) return e;
  const Sm90Params prm{x,
                       tiles,
                       scales,
                       zeros,
                       y,
                       ws.partial,
                       ws.counters,
                       int(s.M),
                       int(s.N),
                       int(s.K),
                       int(s.Npad),
                       int(s.group),
                       int(s.Kpad / kTileK),
                       p.cps,
                       p.lead,
                       p.cps_tail,
                       p.strips,
                       p.splits,
                       p.zslices,
                       int(global && p.spread),
                       work_data};
  const Sm90Launch<C> launch(dim3(unsigned(p.zslices * p.strips), 1, unsigned(p.splits)), p.cluster ? p.splits : 0, stream,
                             global && p.spread);
  return cudaLaunchKernelEx(&launch.cfg, kernel, prm, x_map);
}
}  // namespace detail

// The plan qgemm_sm90_cuda uses for s on this device (splits_override > 0 forces the K splits), and its workspace.
inline Sm90Plan qgemm_sm90_plan(const QGemmShape& s, int sm_count, int splits_override = 0) {
  return with_sm90_cfg(s, [&](auto c) {
    using C = decltype(c);
    return plan_qgemm_sm90<C>(s, detail::sm90_capacity<C>(sm_count), splits_override);
  });
}

inline QGemmWorkspace qgemm_sm90_workspace_size(const QGemmShape& s, int sm_count, int splits_override = 0) {
  const Sm90Plan p = qgemm_sm90_plan(s, sm_count, splits_override);
  return {nullptr, p.partial_elems, nullptr, p.counter_elems};
}

// y [M, N] = x [M, K] * W^T with the same arguments as qgemm_cuda (4-bit tiles). cudaErrorInvalidValue: a shape
// qgemm_sm90_reason rejects, misaligned pointers or a short workspace; cudaErrorNotSupported: no sm_90a device
// code or not an sm_90 device (qgemm_sm90_supported).
template <class T>
cudaError_t qgemm_sm90_cuda(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y,
                            const QGemmShape& s, const QGemmWorkspace& ws, int sm_count, cudaStream_t stream, int splits_override = 0) {
  return with_sm90_cfg(s, [&](auto c) {
    using C = decltype(c);
    const Sm90Plan p = plan_qgemm_sm90<C>(s, detail::sm90_capacity<C>(sm_count), splits_override);
    return detail::launch_qgemm_sm90_cfg<T, C>(x, tiles, scales, zeros, y, s, p, ws, stream);
  });
}

}  // namespace squeeze::kernels::quant
