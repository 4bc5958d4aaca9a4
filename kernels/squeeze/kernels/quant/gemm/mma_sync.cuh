#pragma once
// The mma.sync family of the quantized GEMM (3-, 4- and 8-bit weights, fp16 / bf16 activations, any sm_80+ GPU):
// y [M, N] = x [M, K] * W^T on mma.sync.m16n8k16 from the tiles of layout.hpp. It serves what the sm90 kernel does not
// take (3 and 8 bits, other GPUs, builds without sm_90a).
//
// The mma multiplies x by the exact small integers (q - z) (decode.cuh), or with folded zero points by magic + q
// corrected once per group, into an fp32 group sum that is multiplied by the group's scale and added to the result:
// fp16 and bf16 activations get fp32-accurate products (w is never rounded), except with scaled B.
// Work split (plan.hpp, plan_qgemm): a block = W warps, each owning NT 16-column tiles, times `rows` x rows, times one
// K range of cps 64-k chunks. The block stages its x slice and its group table in shared memory once (one barrier),
// then every warp streams its own tiles with PF chunks in flight and no further barrier. K ranges write fp32 partials;
// the last block of a (z slice, strip) to finish sums them in split order (deterministic), writes y and resets its
// counter, so one launch does everything and the counters stay zero between launches.
// Weight loaders (QGemmKnobs::loader): each lane's loads into registers, per-thread cp.async into a shared ring, or
// (sm_90) one producer warp per block copying each chunk's whole strip (its tiles are contiguous) plus the group rows
// starting in it with bulk copies into a ring of mbarrier-guarded slots; with a persistent grid a block walks
// consecutive work items and the producer streams across them.
// The kernel (here, with its launchers) is composed of device functions along CUTLASS's seams, one file each under
// gemm/mma_sync/, each including the one before: params.cuh (QGemmParams, the work policy, QGemmTraits), scheduler.cuh
// (qgemm_item), mainloop.cuh (qgemm_bulk_producer, qgemm_load_chunk / qgemm_issue_chunk / qgemm_read_slot,
// qgemm_stage_x, qgemm_stage_groups), group_decode.cuh (QGemmGroupConsts, qgemm_decode_kstep), mma.cuh
// (QGemmAccumulators, qgemm_mma_kstep) and epilogue.cuh (qgemm_epilogue, with the split-K reduction).
#if !defined(__CUDACC__)
#error "gemm/mma_sync.cuh is a CUDA header: compile this translation unit with nvcc"
#endif

#include "squeeze/kernels/quant/gemm/mma_sync/epilogue.cuh"

namespace squeeze::kernels::quant {
namespace detail {

// ==== the kernel =======================================================================================================
// Per item: stage x and the group table (one barrier), then every warp streams its own tiles through the mainloop (the
// chunk's decode and mma, group constants advanced as K crosses groups) and the epilogue stores or reduces.
template <class T, int BITS, class C>
__global__ void __launch_bounds__(C::THREADS, C::MINB) qgemm_kernel(const QGemmParams p) {
  using K = QGemmTraits<T, BITS, C>;
  using Work = typename WorkOf<C, QGemmWork>::type;
  using Chunk = QGemmChunk<C::NT, K::LW>;
  constexpr int W = C::W, PF = C::PF, ROWS = C::ROWS, STRIP = C::STRIP, NC = K::NC;
  constexpr bool kBulk = K::kBulk;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int last_flag;
  __shared__ __align__(8) std::uint64_t bars[kBulk ? 2 * PF : 1];  // Bulk: full[PF], empty[PF]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g4 = lane >> 2, c4 = lane & 3;
  const int kchunks = p.Kpad / kTileK, ntiles = p.Npad / kTileN;
  const std::int64_t cstride = std::int64_t(ntiles) * K::TW;  // words between chunks
  const int xstride = p.cps * kTileK + 8;
  // x rows in shared memory (as plan_qgemm counts them): SWAP stages min(ROWS, M) rows, the B columns past them
  // read the last staged row (their results are never stored)
  const int XR = K::kSwap ? min(ROWS, p.M) : ROWS;
  const QGemmSmem lay = qgemm_smem(XR, p.cps, p.ngroups, STRIP, C::template kRingBytes<BITS>);
  std::uint16_t* xs = reinterpret_cast<std::uint16_t*>(smem + lay.x);
  half* ss = reinterpret_cast<half*>(smem + lay.scales);
  std::uint8_t* zs = smem + lay.zeros;

  const int n_items = p.zslices * p.strips * p.splits;
  const int item0 = blockIdx.x * p.items_per_block, item_end = min(n_items, item0 + p.items_per_block);

  unsigned char* bring = smem + lay.ring;  // Bulk: [PF][slot_bytes]
  std::uint64_t* const full = bars;
  std::uint64_t* const empty = bars + (kBulk ? PF : 0);
  if constexpr (kBulk) {
    if (warp == W && lane == 0) {
#pragma unroll
      for (int sl = 0; sl < PF; ++sl) {
        mbar_init(full + sl, 1);
        mbar_init(empty + sl, W);
      }
      mbar_init_fence();
    }
    __syncthreads();  // the only barrier the producer takes part in
    if (warp == W) {
      if (lane == 0) qgemm_bulk_producer<T, BITS, C>(p, bring, full, empty, item0, item_end, kchunks, ntiles, cstride);
      return;
    }
  }

  typename Work::Sink sink{};  // what a measuring Work skips
  int q_next = 0;              // Bulk: sequence number of the next chunk to read
  int x_key = -1;              // Bulk: (z, K range) of the staged x slice
  for (int item = item0; item < item_end; ++item) {
    const QGemmItem it = qgemm_item<kBulk>(p, kchunks, item);
    const int z = it.z, split = it.split, kc0 = it.kc0, nck = it.nck;
    const int kb = kc0 * kTileK;  // first k of this item
    const int m0 = z * ROWS, rows = min(ROWS, p.M - m0);
    const int col0 = it.strip * STRIP;
    const int nt0 = col0 / kTileN + warp * C::NT;  // this warp's first tile
    const bool active = nt0 < ntiles;              // warp-uniform

    const std::uint32_t* wbase = p.tiles + std::int64_t(kc0) * cstride + (BITS == 3 ? lane : lane * K::LW);  // this warp's weight stream
    int toff[C::NT];
#pragma unroll
    for (int t = 0; t < C::NT; ++t) toff[t] = min(nt0 + t, ntiles - 1) * K::TW;
    uint4* ring = reinterpret_cast<uint4*>(smem + lay.ring);  // [PF][W*32][NV] (CpAsync loader, 4/8 bits)

    // ---- prologue: weight loads first (the longest latency), then x and the group table ----
    Chunk bq[C::LOADER == QGemmLoader::Registers ? PF : 1];
    if constexpr (C::LOADER == QGemmLoader::Registers) {
#pragma unroll
      for (int c = 0; c < PF; ++c)
        if (active && c < nck) bq[c] = qgemm_load_chunk<T, BITS, C>(wbase, cstride, toff, c);
    }
    const int key = z + p.zslices * split;
    const bool stage_x = !kBulk || key != x_key;
    if (stage_x) {
      if (kBulk && item != item0) qgemm_sync_compute<kBulk, NC>();  // every warp is done with the previous x slice
      x_key = key;
      qgemm_stage_x<T, NC>(p, xs, xstride, XR, rows, m0, kb, tid);
    }
    const int g_first = kb / p.group;
    const int g_last = (min(kb + nck * kTileK, p.K) - 1) / p.group;
    if constexpr (!kBulk) qgemm_stage_groups<STRIP, NC>(p, ss, zs, g_first, g_last, col0, tid);
    if constexpr (C::LOADER == QGemmLoader::CpAsync) {
#pragma unroll
      for (int c = 0; c < PF - 1; ++c) {
        if (active && c < nck) qgemm_issue_chunk<T, BITS, C>(ring, tid, wbase, cstride, toff, c, c);
        cp_async_commit();
      }
      cp_async_wait<PF - 2>();  // x (the oldest group) has landed
    } else {
      cp_async_wait<0>();
    }
    if (stage_x) qgemm_sync_compute<kBulk, NC>();

    // ---- group constants: the table staged for the item (register / cp.async loaders), or the rows that came with
    // the current chunk's ring slot (Bulk); row r holds group tbl_g0 + r
    const half* tbl_s = ss;
    const std::uint8_t* tbl_z = zs;
    int tbl_g0 = g_first;
    QGemmGroupConsts<T, BITS, C> gc;
    int g = g_first;
    int next_k = (g + 1) * p.group < p.K ? (g + 1) * p.group : 0x7fffffff;  // k where the next group starts
    QGemmAccumulators<T, BITS, C> ac;
    ac.zero();
    if constexpr (Work::kDecode && !kBulk)
      gc.apply(qgemm_fetch_group<T, BITS, C>(tbl_s, tbl_z, tbl_g0, g, warp, g4, c4));  // (Bulk: with the first chunk's slot)
    auto advance_group = [&]() {
      if constexpr (Work::kMultiply) ac.flush(gc);
      ++g;
      next_k = (g + 1) * p.group < p.K ? (g + 1) * p.group : 0x7fffffff;
      gc.apply(qgemm_fetch_group<T, BITS, C>(tbl_s, tbl_z, tbl_g0, g, warp, g4, c4));
    };
    // One chunk: 4 k-steps of 16; per k-step decode NT * 2 B fragments and multiply (SWAP: NT A fragments). Groups that
    // end inside the chunk (group % 64 != 0) take the checked copy of the chunk body (k-steps never straddle groups:
    // group % 16 == 0).
    auto chunk_body = [&](const Chunk& ch, int kl, auto check_groups) {
      [[maybe_unused]] std::uint32_t a8[4];  // ROWS8 == 1: A of two k-steps (rows 0..7)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        if constexpr (decltype(check_groups)::value) {
          if (ks > 0 && kb + kl + ks * 16 >= next_k) advance_group();
        }
        std::uint32_t b[C::NT][2][2];
        qgemm_decode_kstep<T, BITS, C>(ch, ks, gc, b);
        if constexpr (!Work::kMultiply) {
          Work::keep(sink, b);
          continue;
        }
        qgemm_mma_kstep<T, BITS, C>(xs, xstride, XR, kl, ks, lane, a8, b, ac);
      }
    };
    auto compute = [&](const Chunk& ch, int c) {
      if constexpr (!Work::kDecode) {
        Work::keep(sink, ch.w);
        return;
      }
      const int kl = c * kTileK;               // local k in xs
      if (kb + kl >= next_k) advance_group();  // a group starting with this chunk (every group % 64 == 0 case)
      if (kb + kl + kTileK > next_k)
        chunk_body(ch, kl, std::true_type{});
      else
        chunk_body(ch, kl, std::false_type{});
    };

    // ---- mainloop: no block barriers; each warp keeps PF chunks of its own weights in flight (Bulk: the
    // producer keeps PF chunks of the block's strips in flight, across items) ----
    if constexpr (kBulk) {
      // every compute warp takes part in every chunk; warps past N skip the math
      for (int c = 0; c < nck; ++c) {
        const int q = q_next + c, slot = q % PF;
        mbar_wait(full + slot, unsigned(q / PF) & 1u);
        __syncwarp();  // lanes leave the wait loop separately; ldmatrix / mma.sync need the whole warp
        const unsigned char* sb = bring + slot * p.slot_bytes;
        const Chunk ch = qgemm_bulk_read<T, BITS, C>(sb, warp, lane);
        tbl_s = reinterpret_cast<const half*>(sb + K::kSlotBytes);
        tbl_z = sb + K::kSlotBytes + p.slot_rows * STRIP * 2;
        qgemm_slot_groups(p, kc0 + c, c == 0, tbl_g0);
        if (Work::kDecode && c == 0) gc.apply(qgemm_fetch_group<T, BITS, C>(tbl_s, tbl_z, tbl_g0, g, warp, g4, c4));
        if (active) compute(ch, c);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + slot);  // this warp is done with the slot
      }
      q_next += nck;
    } else if (active) {
      if constexpr (C::LOADER == QGemmLoader::Registers) {
        for (int base = 0; base < nck; base += PF) {
#pragma unroll
          for (int q = 0; q < PF; ++q) {
            const int c = base + q;
            if (c < nck) {
              const Chunk cur = bq[q];
              if (c + PF < nck) bq[q] = qgemm_load_chunk<T, BITS, C>(wbase, cstride, toff, c + PF);
              compute(cur, c);
            }
          }
        }
      } else {
        for (int c = 0; c < nck; ++c) {
          // slot (c + PF - 1) % PF was read (and consumed) in iteration c - 1
          if (c + PF - 1 < nck) qgemm_issue_chunk<T, BITS, C>(ring, tid, wbase, cstride, toff, c + PF - 1, (c + PF - 1) % PF);
          cp_async_commit();
          cp_async_wait<PF - 1>();  // chunk c has landed
          compute(qgemm_read_slot<T, BITS, C>(ring, tid, c % PF), c);
        }
      }
    }

    if constexpr (!Work::kMultiply) continue;
    ac.flush(gc);
    qgemm_epilogue<T, BITS, C>(p, ac, it, QGemmOut{m0, rows, col0, nt0, active}, ntiles, tid, g4, c4, last_flag);
  }  // items

  Work::template finish<T>(sink, p);
}

// Launch one configuration. Returns cudaErrorInvalidValue when the workspace is smaller than the plan.
template <class T, int BITS, class C>
cudaError_t launch_qgemm_cfg(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y,
                             const QGemmShape& s, const QGemmPlan& p, const QGemmWorkspace& ws, cudaStream_t stream) {
  if (p.splits > 1 && (ws.partial == nullptr || ws.partial_elems < p.partial_elems)) return cudaErrorInvalidValue;
  if (p.counter_elems > 0 && p.splits > 1 && (ws.counters == nullptr || ws.counter_elems < p.counter_elems)) return cudaErrorInvalidValue;
  // bulk copies need 16-byte aligned sources
  if (C::LOADER == QGemmLoader::Bulk &&
      ((reinterpret_cast<std::uintptr_t>(tiles) | reinterpret_cast<std::uintptr_t>(scales) | reinterpret_cast<std::uintptr_t>(zeros)) & 15))
    return cudaErrorInvalidValue;
  // Dynamic shared memory above 48 KB must be allowed per kernel; the limit counts static + dynamic
  // bytes, so allow the device's opt-in maximum minus this kernel's static shared memory (once per
  // instantiation). A refusal is cleared from the runtime's last error and leaves the 48 KB default.
  static const int max_dynamic = [] {
    int dev = 0, optin = 48 * 1024;
    cudaFuncAttributes fa{};
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
        cudaFuncGetAttributes(&fa, qgemm_kernel<T, BITS, C>) != cudaSuccess) {
      cudaGetLastError();
      return 48 * 1024 - 64;
    }
    const int bytes = optin - int(fa.sharedSizeBytes);
    if (cudaFuncSetAttribute(qgemm_kernel<T, BITS, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess) {
      cudaGetLastError();
      return 48 * 1024 - int(fa.sharedSizeBytes);
    }
    return bytes;
  }();
  if (p.smem_bytes > max_dynamic) return cudaErrorInvalidConfiguration;
  QGemmParams prm{
      x,           tiles,       scales,       zeros, y,        ws.partial, ws.counters, int(s.M),  int(s.N),          int(s.K),
      int(s.Npad), int(s.Kpad), int(s.group), p.cps, p.strips, p.splits,   p.zslices,   p.ngroups, p.items_per_block, p.slot_bytes,
      p.slot_rows};
  qgemm_kernel<T, BITS, C><<<unsigned(p.blocks()), C::THREADS, p.smem_bytes, stream>>>(prm);
  return cudaGetLastError();
}
}  // namespace detail

// y [M, N] = x [M, K] * W^T on `stream` (s.bits 3, 4 or 8) with the configuration and plan qgemm_plan names.
// cudaErrorInvalidValue for unsupported arguments or a workspace smaller than qgemm_workspace_size.
template <class T>
cudaError_t qgemm_cuda(const T* x, const std::uint32_t* tiles, const half* scales, const std::uint8_t* zeros, T* y, const QGemmShape& s,
                       const QGemmWorkspace& ws, int sm_count, cudaStream_t stream, int cps_override = 0) {
  static_assert(std::is_same_v<T, half> || std::is_same_v<T, bf16>, "the quantized GEMM takes fp16 or bf16 activations");
  if (s.M <= 0 || s.N <= 0 || s.K <= 0 || s.Kpad % kTileK || s.Npad % kTileN || s.Kpad < s.K || s.Kpad >= s.K + kTileK || s.Npad < s.N ||
      s.group <= 0 || s.group % 16 || s.K > (1ll << 30) || s.N > (1ll << 30) || s.M > (1ll << 24) ||
      !(s.bits == 3 || s.bits == 4 || s.bits == 8))
    return cudaErrorInvalidValue;
  return with_qgemm_cfg(s, [&](auto bits, auto c) {
    constexpr int BITS = decltype(bits)::value;
    using C = decltype(c);
    const QGemmPlan p = plan_qgemm(s, qgemm_geometry<C, BITS>(), sm_count, cps_override);
    return detail::launch_qgemm_cfg<T, BITS, C>(x, tiles, scales, zeros, y, s, p, ws, stream);
  });
}

}  // namespace squeeze::kernels::quant
