// 4-bit GEMM benchmark without libtorch: one translation unit that builds in well under a minute, for kernel work
// on the GPU machine (bench_quant_gemm, with libtorch and every mma.sync variant, takes minutes to build).
// For each of the four LLaMA (K, N) and batch M it times, in the same run, cold L2, median of --reps:
//   ours     the library's dispatch (kq::quant_gemm_cuda: wgmma for 4-bit layers on sm_90a, see quant_gemm_uses_sm90)
//   mma      qgemm_cuda (the mma.sync kernel) at every M
//   wg_*     every configuration of Sm90TuningCfgs (gemm_configs.cuh; wgmma, mma_*: mma.sync consumers) at K splits
//            {its plan, 1, 2, 3, 4, 6, 8, 12, 16} (--splits), each K-split count reduced each way (in a cluster up to 8;
//            through global memory summed by every block of a tile where the grid fits the GPU, "spread", and by the
//            tile's last block, "global")
//   extra    (--extra) Sm90ExtraCfgs, timed the same way (not checked by the GPU tests)
//   sv_*     (--streaming) every configuration of the streaming kernel (qgemv.cuh, M <= 16) with its own plan
//   probes   (--probes) Sm90ProbeCfgs at their own plans: the dispatched forms without their decode
//            (_probe1) or without any consumer work (_probe2), i.e. what the copies alone cost; results not checked
//   cuBLAS   bf16 GEMM (cublasGemmEx, W [N, K] bf16 as nn.Linear stores it), the peer
// Weights are random codes, scales and zero points (group 128): only time is measured here; the GPU tests check
// the numbers. Each wgmma result is still compared with the mma.sync kernel's on the same data (max error
// relative to max |y|), so a broken configuration shows as "BAD" and never as the fastest.
// Roofline: weight + scale + zero + x + y bytes over the time, as a fraction of a device-to-device copy's
// bandwidth measured in the same run; and the GEMM's flops over the dense bf16 rate cuBLAS reaches on an
// 8192 x 8192 x 8192 GEMM in the same run (tensor_fraction: the bound that matters from batch ~64 on). Per shape also
// the read bound of the 4-bit tiles and of the bf16 weights (read_bound.cuh: the fastest of several plain reads, timed the
// same way): what merely reading those bytes costs at this size. The "bound" column, cuBLAS's time over the tiles' read
// bound, is the ratio against cuBLAS no kernel that reads the tiles from DRAM can pass.
// Usage: bench_qgemm_sm90 [--out FILE] [--reps N] [--only CASE-SUBSTRING] [--m LIST] [--shapes KxN,...] [--splits LIST] [--taper LIST] [--cfg NAME-SUBSTRING]
//                         [--l2-flush clean|dirty] [--probes] [--streaming] [--extra] [--timeline]
//   (--cfg: only the wgmma configurations whose names contain it (or one of a comma-separated list), and not the
//    dispatch: for a profiler; --splits: the K split counts swept, besides the plan's own (default 1,2,3,4,6,8,12,16);
//    --taper: each plan through global memory of more than one wave also with its last K ranges shorter, these ratios
//    of the lead ones' length (kq::sm90_taper_ratio; "global taper L+C": L lead ranges, C chunks in each of the rest);
//    --l2-flush: how L2 is swept before each timed launch, see gemm_timing.cuh; default clean; --timeline: where the
//    dispatched configuration's time goes, per block (see trace_cfg; not with --cfg, which skips the dispatch))
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <set>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <squeeze/error.hpp>
#include <squeeze/kernels/quant/gemm.cuh>

#include "gemm_configs.cuh"
#include "gemm_timing.cuh"
#include "qgemv.cuh"
#include "read_bound.cuh"

namespace kq = squeeze::kernels::quant;
namespace bg = squeeze::bench::gemm;
using squeeze::bf16;
using squeeze::half;
using squeeze::bench::time_ms;
using squeeze::bench::watchdog_note;
using squeeze::bench::DevBuf;
using squeeze::bench::comma_list;
using squeeze::bench::positive;

namespace {

// Split-K scratch of the sizes a plan asks for: fp32 partials (any contents) and counters (zeroed).
struct Workspace {
  DevBuf<float> partial;
  DevBuf<int> counters;
  kq::QGemmWorkspace ws;
  explicit Workspace(const kq::QGemmWorkspace& need)
      : partial(std::size_t(std::max<std::int64_t>(need.partial_elems, 1))), counters(std::size_t(std::max<std::int64_t>(need.counter_elems, 1))),
        ws{partial.p, need.partial_elems, counters.p, need.counter_elems} {
    SQUEEZE_CUDA_CHECK(cudaMemset(counters.p, 0, counters.n * sizeof(int)));
  }
};

void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(std::string("cuBLAS: ") + what + " failed (status " + std::to_string(int(s)) + ")");
}

// One 4-bit layer [N, K] in the tile layout with random contents, and its bf16 twin for cuBLAS.
struct Layer {
  std::int64_t K, N, Kpad, Npad;
  int group = 128;
  DevBuf<std::uint32_t> tiles;
  DevBuf<half> scales;
  DevBuf<std::uint8_t> zeros;
  DevBuf<bf16> w_bf16;
  static std::vector<std::uint32_t> random_words(std::size_t n, std::mt19937& rng) {
    std::vector<std::uint32_t> v(n);
    for (auto& w : v) w = rng();
    return v;
  }
  Layer(std::int64_t k, std::int64_t n, std::mt19937& rng)
      : K(k), N(n), Kpad((k + kq::kTileK - 1) / kq::kTileK * kq::kTileK), Npad((n + kq::kTileN - 1) / kq::kTileN * kq::kTileN),
        tiles(random_words(std::size_t(Kpad * Npad / 8), rng)), scales(random_scales(std::size_t((Kpad + 127) / 128 * Npad), rng)),
        zeros(random_zeros(std::size_t((Kpad + 127) / 128 * Npad), rng)), w_bf16(random_bf16(std::size_t(N * K), 0.02f, rng)) {}
  static std::vector<half> random_scales(std::size_t n, std::mt19937& rng) {
    std::uniform_real_distribution<float> u(0.002f, 0.02f);
    std::vector<half> v(n);
    for (auto& s : v) s = __float2half(u(rng));
    return v;
  }
  static std::vector<std::uint8_t> random_zeros(std::size_t n, std::mt19937& rng) {
    std::vector<std::uint8_t> v(n);
    for (auto& z : v) z = std::uint8_t(1 + rng() % 15);
    return v;
  }
  static std::vector<bf16> random_bf16(std::size_t n, float scale, std::mt19937& rng) {
    std::normal_distribution<float> g(0.f, scale);
    std::vector<bf16> v(n);
    for (auto& e : v) e = __float2bfloat16(g(rng));
    return v;
  }
  kq::QGemmShape shape(std::int64_t M) const { return {M, N, K, Kpad, Npad, group, 4}; }
  double weight_bytes() const { return double(Kpad) * Npad / 2 + double((Kpad + 127) / 128) * Npad * 3; }
};

double max_rel(const std::vector<bf16>& got, const std::vector<bf16>& ref) {
  double err = 0, mag = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double r = __bfloat162float(ref[i]), g = __bfloat162float(got[i]);
    err = std::max(err, std::abs(g - r));
    mag = std::max(mag, std::abs(r));
  }
  return err / std::max(mag, 1e-30);
}

struct Timed {
  std::string name;
  int splits = 0;  // K splits (the streaming kernel: K parts)
  std::string reduce;  // the wgmma kernel's K-split reduction: reduce_name ("" for one K range)
  double ms = 0, err = 0;
};

// One configuration and plan: its result against ref (BAD past 2e-2 of max |y|), then timed when good.
template <class Launch>
void check_and_time(const std::string& name, const std::string& plan, int splits, const std::string& reduce, Launch launch, bf16* y,
                    std::size_t ny, const std::vector<bf16>& ref, int reps, std::vector<Timed>& out, bool check = true) {
  watchdog_note(name + " " + plan);
  SQUEEZE_CUDA_CHECK(cudaMemset(y, 0xff, ny * sizeof(bf16)));
  if (const cudaError_t e = launch(); e != cudaSuccess) {
    std::printf("  %s (%s): %s\n", name.c_str(), plan.c_str(), cudaGetErrorString(e));
    cudaGetLastError();
    return;
  }
  SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<bf16> got(ny);
  SQUEEZE_CUDA_CHECK(cudaMemcpy(got.data(), y, ny * sizeof(bf16), cudaMemcpyDeviceToHost));
  Timed t{name, splits, reduce, 0, max_rel(got, ref)};
  if (t.err < 2e-2 || !check) t.ms = time_ms([&] { SQUEEZE_CUDA_CHECK(launch()); }, reps);
  out.push_back(t);
}

// A plan's K-split reduction in the results: "cluster", "spread" (global memory, every block of a tile sums a share)
// or "global" (global memory, the tile's last block sums); "" for one K range.
std::string reduce_name(const kq::Sm90Plan& plan) { return plan.splits == 1 ? "" : plan.cluster ? "cluster" : plan.spread ? "spread" : "global"; }

// Per configuration: blocks the GPU holds at once (the cluster kernels, the global ones), and clusters of 1..8 blocks (sm90_capacity).
template <class... Cs>
void print_capacities(bg::CfgList<Cs...>, int sm) {
  auto one = [&](auto c) {
    using C = decltype(c);
    const kq::Sm90Capacity cap = kq::detail::sm90_capacity<C>(sm);
    std::printf("capacity %-16s slots %3d (global kernels %3d) clusters", kq::detail::sm90_cfg_name<C>().c_str(), cap.slots, cap.spread_slots);
    for (int k = 1; k <= kq::kSm90MaxClusterSplits; ++k) std::printf(" %d:%d", k, cap.clusters[k]);
    std::printf("\n");
  };
  (one(Cs{}), ...);
}

// Every wgmma configuration of the list whose name contains one of only_cfgs (all when empty), at each distinct (K
// split count, reduction).
template <class... Cs>
void time_cfgs(bg::CfgList<Cs...>, const Layer& L, const kq::QGemmShape& s, const bf16* x, bf16* y, std::size_t ny,
               const std::vector<bf16>& ref, int sm, int reps, const std::vector<std::string>& only_cfgs, const std::vector<int>& split_counts,
               const std::vector<double>& tapers, std::vector<Timed>& out) {
  auto one = [&](auto c) {
    using C = decltype(c);
    const std::string name = kq::detail::sm90_cfg_name<C>();
    if (!only_cfgs.empty() &&
        std::none_of(only_cfgs.begin(), only_cfgs.end(), [&](const std::string& part) { return name.find(part) != std::string::npos; }))
      return;
    std::set<std::pair<int, std::string>> seen;  // (splits, reduction) already timed
    for (const int sp : split_counts)
      for (const auto reduce : {kq::Sm90Reduce::Cluster, kq::Sm90Reduce::Global, kq::Sm90Reduce::GlobalLast}) {
        const auto plan = kq::plan_qgemm_sm90<C>(s, kq::detail::sm90_capacity<C>(sm), sp, sp == 0 ? kq::Sm90Reduce::Auto : reduce);
        if (!seen.insert({plan.splits, reduce_name(plan)}).second) continue;
        const Workspace ws({nullptr, plan.partial_elems, nullptr, plan.counter_elems});
        check_and_time(
            name, kq::describe(plan), plan.splits, reduce_name(plan),
            [&] { return kq::detail::launch_qgemm_sm90_cfg<bf16, C>(x, L.tiles.p, L.scales.p, L.zeros.p, y, s, plan, ws.ws, nullptr); }, y, ny, ref,
            reps, out);
        // --taper: a plan through global memory of more than one wave, its last K ranges shorter (sm90_taper_ratio),
        // the lead ones those the first wave holds whole, or one more
        const kq::Sm90Capacity cap = kq::detail::sm90_capacity<C>(sm);
        const int wave_ranges = kq::sm90_first_wave_ranges(plan, cap);
        if (plan.cluster || plan.spread || plan.blocks() <= cap.spread_slots) continue;
        for (const double ratio : tapers)
          for (const int lead : {wave_ranges, wave_ranges + 1}) {
            kq::Sm90Plan tapered = plan;
            if (!kq::sm90_taper_ratio(tapered, s, lead, ratio).empty()) continue;
            const std::string how = reduce_name(tapered) + " taper " + std::to_string(lead) + "+" + std::to_string(tapered.cps_tail);
            if (!seen.insert({tapered.splits, how}).second) continue;
            check_and_time(
                name, kq::describe(tapered), tapered.splits, how,
                [&] { return kq::detail::launch_qgemm_sm90_cfg<bf16, C>(x, L.tiles.p, L.scales.p, L.zeros.p, y, s, tapered, ws.ws, nullptr); }, y, ny,
                ref, reps, out);
          }
      }
  };
  (one(Cs{}), ...);
}


// A number for JSON: null when not finite (a probe's garbage result can make the error inf or nan).
std::string json_num(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream o;
  o << v;
  return o.str();
}

// Each measuring variant (Sm90ProbeCfgs: wrong results by design, so timed without the check) at its
// base configuration's own plan.
template <class... Cs>
void time_probe_cfgs(bg::CfgList<Cs...>, const Layer& L, const kq::QGemmShape& s, const bf16* x, bf16* y, std::size_t ny,
                     const std::vector<bf16>& ref, int sm, int reps, std::vector<Timed>& out) {
  auto one = [&](auto c) {
    using C = decltype(c);
    const auto plan = kq::plan_qgemm_sm90<C>(s, kq::detail::sm90_capacity<C>(sm), 0, kq::Sm90Reduce::Auto);
    const Workspace ws({nullptr, plan.partial_elems, nullptr, plan.counter_elems});
    check_and_time(
        kq::detail::sm90_cfg_name<C>(), kq::describe(plan), plan.splits, reduce_name(plan),
        [&] { return kq::detail::launch_qgemm_sm90_cfg<bf16, C>(x, L.tiles.p, L.scales.p, L.zeros.p, y, s, plan, ws.ws, nullptr); }, y, ny, ref, reps,
        out, /*check=*/false);
  };
  (one(Cs{}), ...);
}

// Every streaming configuration at each distinct K part count {its plan, 1, 2, 4, 8}.
template <class... Cs>
void time_qgemv_cfgs(kq::detail::QGemvCfgList<Cs...>, const Layer& L, const kq::QGemmShape& s, const bf16* x, bf16* y, std::size_t ny,
                     const std::vector<bf16>& ref, int sm, int reps, std::vector<Timed>& out) {
  auto one = [&](auto c) {
    using C = decltype(c);
    int seen[64] = {};
    for (int parts : {0, 1, 2, 4, 8}) {
      const auto plan = kq::plan_qgemv(s, C::NT, sm, kq::detail::qgemv_warps_per_sm<bf16, C>(s.M <= 8 ? 1 : 2), parts);
      if (plan.parts < 64 && seen[plan.parts]++) continue;
      const Workspace ws({nullptr, plan.partial_elems, nullptr, plan.counter_elems});
      check_and_time(
          kq::detail::qgemv_cfg_name<C>(), kq::describe(plan), plan.parts, "",
          [&] { return kq::detail::launch_qgemv_cfg<bf16, C>(x, L.tiles.p, L.scales.p, L.zeros.p, y, s, plan, ws.ws, nullptr); }, y, ny, ref,
          reps, out);
    }
  };
  (one(Cs{}), ...);
}

// --timeline: where the dispatched wgmma configuration's time goes. Its Sm90Probe<C, 3> twin (the same work, plus per
// block the clocks of bg::kSm90TraceSlots points) runs `reps` times, each after an L2 flush and a one-thread
// kernel that notes the global timer; the repetition with the median span is reported: the wait from that note to
// the first block's start (launch), the spread of block starts (skew), first start to last end (span), and per block
// (median over blocks, the SM clock converted by each block's own global-timer span) set-up, the wait for the first
// chunk, the main loop and the epilogue.
__global__ void note_global_ns(std::uint64_t* out) { *out = bg::global_ns(); }
struct Timeline {
  std::string cfg;
  int blocks = 0, max_per_sm = 0, tick_ns = 0;
  double launch = 0, skew = 0, span = 0, setup = 0, first = 0, loop = 0, epilogue = 0, block = 0, block_max = 0, queued_first = 0,
         queued_last = 0, ghz = 0;  // microseconds, and the SM clock
  // the epilogue's parts (blocks that reach the stores): the wait for the other warpgroups (global, last block: + the
  // partials' writes), the staging (cluster: + the wait for the cluster's blocks; spread: + the partials' writes and
  // the wait for the tile's blocks; global, last block: the counter), the stores (spread: + the share's loads), the rest
  double epi_wait = 0, epi_stage = 0, epi_store = 0, epi_tail = 0;
  // the producer's first chunk: from entry to its first copy, its x (TMA), its bulk copies
  double issue_start = 0, issue_bulk = 0, issue_x = 0;
};
template <class C>
Timeline trace_cfg(const Layer& L, const kq::QGemmShape& s, const bf16* x, bf16* y, int sm, int reps) {
  using P = bg::Sm90Probe<C, 3>;
  constexpr int S = bg::kSm90TraceSlots;
  namespace T = bg::sm90_trace_slot;
  const auto plan = kq::plan_qgemm_sm90<C>(s, kq::detail::sm90_capacity<C>(sm));
  const Workspace ws({nullptr, plan.partial_elems, nullptr, plan.counter_elems});
  const std::size_t blocks = std::size_t(plan.blocks());
  DevBuf<std::uint64_t> trace(blocks * S), note(1);
  auto launch = [&] { SQUEEZE_CUDA_CHECK((bg::launch_sm90_timeline<bf16, P>(x, L.tiles.p, L.scales.p, L.zeros.p, y, s, plan, ws.ws, nullptr, trace.p))); };
  launch();
  launch();
  std::vector<Timeline> runs;
  for (int r = 0; r < reps; ++r) {
    SQUEEZE_CUDA_CHECK(cudaMemsetAsync(trace.p, 0, trace.n * sizeof(std::uint64_t), nullptr));
    squeeze::bench::flush_l2(r);
    note_global_ns<<<1, 1>>>(note.p);
    launch();
    SQUEEZE_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<std::uint64_t> t = trace.get(), n = note.get();
    Timeline tl;
    tl.cfg = kq::detail::sm90_cfg_name<C>() + " " + kq::describe(plan);
    tl.blocks = int(blocks);
    std::uint64_t first_in = ~0ull, last_in = 0, last_out = 0;
    std::vector<std::uint64_t> starts;
    std::vector<double> ghz, setup, first, loop, epi, all, qf, ql, e_wait, e_stage, e_store, e_tail, i_start, i_bulk, i_x;
    std::vector<int> per_sm(1024, 0);
    for (std::size_t b = 0; b < blocks; ++b) {
      const std::uint64_t* v = t.data() + b * S;
      first_in = std::min(first_in, v[T::EntryNs]);
      last_in = std::max(last_in, v[T::EntryNs]);
      last_out = std::max(last_out, v[T::EndNs]);
      starts.push_back(v[T::EntryNs]);
      if (v[T::Sm] < per_sm.size()) tl.max_per_sm = std::max(tl.max_per_sm, ++per_sm[v[T::Sm]]);
      if (v[T::EndNs] > v[T::EntryNs]) ghz.push_back(double(v[T::End] - v[T::Entry]) / double(v[T::EndNs] - v[T::EntryNs]));
      setup.push_back(double(v[T::SetUp] - v[T::Entry]));
      first.push_back(double(v[T::FirstChunk] - v[T::SetUp]));
      loop.push_back(double(v[T::LoopEnd] - v[T::FirstChunk]));
      epi.push_back(double(v[T::End] - v[T::LoopEnd]));
      all.push_back(double(v[T::End] - v[T::Entry]));
      qf.push_back(double(v[T::QueuedFirst] - v[T::Entry]));
      ql.push_back(double(v[T::QueuedLast] - v[T::Entry]));
      i_start.push_back(double(v[T::ProducerStart] - v[T::Entry]));
      i_x.push_back(double(v[T::ProducerX] - v[T::ProducerStart]));
      i_bulk.push_back(double(v[T::QueuedFirst] - v[T::ProducerX]));
      if (v[T::EpilogueStored] != 0) {
        e_wait.push_back(double(v[T::EpilogueWaited] - v[T::LoopEnd]));
        e_stage.push_back(double(v[T::EpilogueStaged] - v[T::EpilogueWaited]));
        e_store.push_back(double(v[T::EpilogueStored] - v[T::EpilogueStaged]));
        e_tail.push_back(double(v[T::End] - v[T::EpilogueStored]));
      }
    }
    auto median = [](std::vector<double> a) {
      if (a.empty()) return 0.0;
      std::nth_element(a.begin(), a.begin() + a.size() / 2, a.end());
      return a[a.size() / 2];
    };
    tl.ghz = median(ghz);
    const double us_per_cycle = tl.ghz > 0 ? 1e-3 / tl.ghz : 0.0;
    tl.launch = first_in >= n[0] ? double(first_in - n[0]) * 1e-3 : -double(n[0] - first_in) * 1e-3;
    tl.skew = double(last_in - first_in) * 1e-3;
    tl.span = double(last_out - first_in) * 1e-3;
    tl.setup = median(setup) * us_per_cycle;
    tl.first = median(first) * us_per_cycle;
    tl.loop = median(loop) * us_per_cycle;
    tl.epilogue = median(epi) * us_per_cycle;
    tl.block = median(all) * us_per_cycle;
    tl.block_max = *std::max_element(all.begin(), all.end()) * us_per_cycle;
    tl.queued_first = median(qf) * us_per_cycle;
    tl.queued_last = median(ql) * us_per_cycle;
    tl.epi_wait = median(e_wait) * us_per_cycle;
    tl.epi_stage = median(e_stage) * us_per_cycle;
    tl.epi_store = median(e_store) * us_per_cycle;
    tl.epi_tail = median(e_tail) * us_per_cycle;
    tl.issue_start = median(i_start) * us_per_cycle;
    tl.issue_bulk = median(i_bulk) * us_per_cycle;
    tl.issue_x = median(i_x) * us_per_cycle;
    std::sort(starts.begin(), starts.end());
    std::uint64_t tick = 0;
    for (std::size_t i = 1; i < starts.size(); ++i)
      if (starts[i] > starts[i - 1] && (tick == 0 || starts[i] - starts[i - 1] < tick)) tick = starts[i] - starts[i - 1];
    tl.tick_ns = int(tick);
    runs.push_back(tl);
  }
  std::sort(runs.begin(), runs.end(), [](const Timeline& a, const Timeline& b) { return a.span < b.span; });
  return runs[runs.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path, only;
  std::vector<std::string> only_cfgs;  // --cfg: name substrings
  bool probes = false, streaming = false, extra = false, timeline = false;
  std::vector<std::int64_t> batches = {1, 16, 33, 64, 128};
  std::vector<int> split_counts = {0, 1, 2, 3, 4, 6, 8, 12, 16};  // 0: the plan's own; 3 and 6: clusters that fill a GPC less evenly
  std::vector<double> tapers;  // --taper: tail-to-lead K range length ratios (sm90_taper_ratio)
  // the LLaMA-7B / 70B (K, N); --shapes replaces them (e.g. 8192x33792: 132 strips of 256 features, one per SM)
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes = {{4096, 4096}, {4096, 11008}, {11008, 4096}, {8192, 28672}};
  int reps = 30;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--reps" && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--only" && i + 1 < argc) only = argv[++i];
    else if (a == "--cfg" && i + 1 < argc) {
      only_cfgs.clear();
      for (const std::string& part : comma_list(argv[++i]))
        if (!part.empty()) only_cfgs.push_back(part);
    }
    else if (a == "--taper" && i + 1 < argc) {  // ratios in (0, 1]
      for (const std::string& item : comma_list(argv[++i])) {
        char* end = nullptr;
        const double r = std::strtod(item.c_str(), &end);
        if (item.empty() || *end != '\0' || !(r > 0 && r <= 1)) {
          std::fprintf(stderr, "%s: --taper: expected a comma-separated list of ratios in (0, 1], got '%s'\n", argv[0], item.c_str());
          return 2;
        }
        tapers.push_back(r);
      }
    } else if (a == "--probes") probes = true;
    else if (a == "--extra") extra = true;
    else if (a == "--timeline") timeline = true;
    else if (a == "--streaming") streaming = true;
    else if (a == "--l2-flush" && i + 1 < argc) {
      if (!squeeze::bench::set_l2_flush(argv[0], argv[++i])) return 2;
    }
    else if ((a == "--m" || a == "--splits") && i + 1 < argc) {  // positive integers; split counts past 16 are clamped
      if (a == "--m") batches.clear();
      else split_counts = {0};
      for (const std::string& item : comma_list(argv[++i])) {
        const long long v = positive(item);
        if (v == 0 || (a == "--splits" && v > 1000)) {
          std::fprintf(stderr, "%s: %s: expected a comma-separated list of positive integers, got '%s'\n", argv[0], a.c_str(), item.c_str());
          return 2;
        }
        if (a == "--m") batches.push_back(v);
        else split_counts.push_back(int(v));
      }
    } else if (a == "--shapes" && i + 1 < argc) {
      if (const std::string bad = squeeze::bench::parse_shapes(argv[++i], shapes); !bad.empty()) {
        std::fprintf(stderr, "%s: --shapes: expected KxN pairs with K a multiple of 8 and K, N >= 16, got '%s'\n", argv[0], bad.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--out FILE] [--reps N] [--only CASE-SUBSTRING] [--m 1,16,...] [--shapes KxN,...] [--splits 1,2,...] [--taper 0.5,...] [--cfg NAME-SUBSTRING] [--l2-flush clean|dirty] [--probes] [--streaming] [--extra] [--timeline]\n", argv[0]);
      return 2;
    }
  }
  if (timeline && !only_cfgs.empty()) {
    std::fprintf(stderr, "%s: --timeline traces the dispatched configuration, which --cfg leaves out: give one of them\n", argv[0]);
    return 2;
  }
  cudaDeviceProp prop{};
  if (!squeeze::bench::first_device("bench_qgemm_sm90", prop)) return 1;
  const int sm = prop.multiProcessorCount;
  squeeze::bench::start_watchdog("bench_qgemm_sm90", 60);
  std::ofstream out;
  if (!out_path.empty()) out.open(out_path);
  const char* commit = std::getenv("SQUEEZE_COMMIT");

  const double copy_gbs = squeeze::bench::copy_bandwidth_gbs();  // the roofline
  cublasHandle_t handle;
  cublas_check(cublasCreate(&handle), "create");
  // dense bf16 tensor-core rate: cuBLAS on 8192^3 (the compute roofline)
  double tensor_tflops = 0;
  try {  // a failure here costs only this column
    constexpr int D = 8192;
    const DevBuf<bf16> a(std::vector<bf16>(std::size_t(D) * D, __float2bfloat16(0.01f))), b(std::vector<bf16>(std::size_t(D) * D, __float2bfloat16(0.02f)));
    DevBuf<bf16> c(std::size_t(D) * D);
    const float one = 1.f, zero = 0.f;
    const double ms = time_ms(
        [&] {
          cublas_check(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, D, D, D, &one, a.p, CUDA_R_16BF, D, b.p, CUDA_R_16BF, D, &zero, c.p, CUDA_R_16BF, D,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                       "GemmEx 8192^3");
        },
        5);
    tensor_tflops = 2.0 * D * double(D) * D / (ms * 1e9);
  } catch (const std::exception& e) {
    std::printf("dense bf16 rate not measured: %s\n", e.what());
    cudaGetLastError();
  }
  std::printf("device %s, %d SMs, copy %.0f GB/s, dense bf16 %.0f TFLOP/s (cuBLAS 8192^3), L2 flush %s, wgmma kernel %s\n", prop.name, sm, copy_gbs,
              tensor_tflops, squeeze::bench::l2_flush_name(), kq::qgemm_sm90_supported() ? "available" : "NOT available (needs sm_90a device code)");
  // what the GPU holds of each wgmma configuration at once (the K-split plan counts its waves in clusters)
  print_capacities(bg::Sm90TuningCfgs{}, sm);
  if (extra) print_capacities(bg::Sm90ExtraCfgs{}, sm);
  std::printf("%-18s %8s %8s %6s %5s %5s | %8s %6s | %-16s %2s %8s %6s %5s | %s\n", "case", "ours ms", "cublas", "x cub", "roof", "bound", "mma ms",
              "x cub", "best wgmma", "sp", "best ms", "x cub", "roof", "dispatch");
  std::mt19937 rng(2026);
  for (const auto& [K, N] : shapes) {
    const Layer L(K, N, rng);
    const squeeze::bench::ReadBound read4 = squeeze::bench::read_bound(L.tiles.p, L.tiles.n * 4, sm, prop.major, reps),
                                    read_bf16 = squeeze::bench::read_bound(L.w_bf16.p, L.w_bf16.n * 2, sm, prop.major, reps);
    const double read4_ms = read4.ms, read_bf16_ms = read_bf16.ms;
    std::printf("K%lld_N%lld: read bound of the 4-bit tiles %.4f ms (%s), of the bf16 weights %.4f ms (%s), ratio bound %.2f\n", (long long)K,
                (long long)N, read4_ms, read4.how.c_str(), read_bf16_ms, read_bf16.how.c_str(), read_bf16_ms / read4_ms);
    std::printf("  reads of the 4-bit tiles (ms): %s\n  reads of the bf16 weights (ms): %s\n", describe(read4).c_str(), describe(read_bf16).c_str());
    for (const std::int64_t M : batches) {
      const std::string cs = "K" + std::to_string(K) + "_N" + std::to_string(N) + "_M" + std::to_string(M);
      if (!only.empty() && cs.find(only) == std::string::npos) continue;
      watchdog_note(cs);
      const kq::QGemmShape s = L.shape(M);
      const DevBuf<bf16> x(Layer::random_bf16(std::size_t(M * K), 1.f, rng));
      DevBuf<bf16> y(std::size_t(M * N)), y_cub(std::size_t(M * N));
      // the mma.sync kernel: the reference for the wgmma results
      const Workspace mws(kq::qgemm_workspace_size(s, sm));
      auto run_mma = [&] { SQUEEZE_CUDA_CHECK(kq::qgemm_cuda<bf16>(x.p, L.tiles.p, L.scales.p, L.zeros.p, y.p, s, mws.ws, sm, nullptr)); };
      run_mma();
      const std::vector<bf16> ref = y.get();
      const double t_mma = time_ms(run_mma, reps);
      // the library's dispatch
      const Workspace ws(kq::quant_gemm_workspace_size(s, sm));
      auto run_ours = [&] { SQUEEZE_CUDA_CHECK(kq::quant_gemm_cuda<bf16>(x.p, L.tiles.p, L.scales.p, L.zeros.p, y.p, s, ws.ws, sm, nullptr)); };
      // with --cfg (a profiler run) the dispatch is not run: only that configuration's launches reach the profiler
      const bool dispatch_run = only_cfgs.empty();
      if (dispatch_run) run_ours();
      const double err_ours = dispatch_run ? max_rel(y.get(), ref) : 0.0;
      const double t_ours = dispatch_run ? time_ms(run_ours, reps) : 0.0;
      // cuBLAS: column-major Y^T [N, M] = W^T' ... i.e. op(W) = T on the row-major [N, K] weights
      const float one = 1.f, zero = 0.f;
      auto run_cub = [&] {
        cublas_check(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M), int(K), &one, L.w_bf16.p, CUDA_R_16BF, int(K), x.p, CUDA_R_16BF,
                                  int(K), &zero, y_cub.p, CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                     "GemmEx");
      };
      const double t_cub = time_ms(run_cub, reps);
      std::vector<Timed> wg;
      // (M 1..8 too: the dispatch sends them to the sm90 kernel)
      if (kq::qgemm_sm90_supported())
        time_cfgs(bg::Sm90TuningCfgs{}, L, s, x.p, y.p, y.n, ref, sm, std::max(5, reps / 2), only_cfgs, split_counts, tapers, wg);
      if (kq::qgemm_sm90_supported() && extra)
        time_cfgs(bg::Sm90ExtraCfgs{}, L, s, x.p, y.p, y.n, ref, sm, std::max(5, reps / 2), only_cfgs, split_counts, tapers, wg);
      std::vector<Timed> pr;
      if (kq::qgemm_sm90_supported() && probes) {
        time_probe_cfgs(bg::Sm90ProbeCfgs{}, L, s, x.p, y.p, y.n, ref, sm, std::max(5, reps / 2), pr);
        std::printf("  probes:");
        for (const auto& t : pr) std::printf("  %s/%d %.4f", t.name.c_str(), t.splits, t.ms);
        std::printf("  (ms; read of the 4-bit tiles %.4f)\n", read4_ms);
      }
      Timeline tl;
      if (timeline && dispatch_run && kq::quant_gemm_uses_sm90(s)) {
        watchdog_note(cs + " timeline");
        tl = kq::with_sm90_cfg(s, [&](auto c) { return trace_cfg<decltype(c)>(L, s, x.p, y.p, sm, 7); });
        std::printf("  timeline %s: launch %.2f skew %.2f span %.2f us | per block (median) set-up %.2f, first chunk %.2f, loop %.2f, epilogue %.2f "
                    "(wait %.2f, stage %.2f, store %.2f, rest %.2f), all %.2f (max %.2f) us; producer queued chunk 1 at %.2f (starts %.2f, x %.2f, bulk %.2f), "
                    "the last at %.2f us | %.2f GHz, %d blocks, <= %d per SM, timer tick %d ns\n",
                    tl.cfg.c_str(), tl.launch, tl.skew, tl.span, tl.setup, tl.first, tl.loop, tl.epilogue, tl.epi_wait, tl.epi_stage, tl.epi_store, tl.epi_tail,
                    tl.block, tl.block_max, tl.queued_first, tl.issue_start, tl.issue_x, tl.issue_bulk, tl.queued_last, tl.ghz, tl.blocks, tl.max_per_sm, tl.tick_ns);
      }
      std::vector<Timed> sv;
      if (streaming && kq::qgemv_reason(s).empty()) time_qgemv_cfgs(kq::detail::QGemvTuningCfgs{}, L, s, x.p, y.p, y.n, ref, sm, reps, sv);
      const Timed* best_sv = nullptr;
      for (const auto& t : sv)
        if (t.ms > 0 && (!best_sv || t.ms < best_sv->ms)) best_sv = &t;
      if (best_sv)
        std::printf("  streaming: best %s parts %d %.4f ms = %.2fx cuBLAS (cfg/parts ms: %s)\n", best_sv->name.c_str(), best_sv->splits, best_sv->ms, t_cub / best_sv->ms, [&] {
          std::string all;
          for (const auto& t : sv)
            all += t.name + "/" + std::to_string(t.splits) + " " + (t.ms > 0 ? std::to_string(t.ms).substr(0, 7) : std::string("BAD")) + "  ";
          return all;
        }().c_str());
      for (const auto& t : sv)
        if (!(t.err < 2e-2)) std::printf("  %s: rel err %.2e vs mma.sync: BAD\n", t.name.c_str(), t.err);
      const Timed* best = nullptr;
      for (const auto& t : wg)
        if (t.ms > 0 && (!best || t.ms < best->ms)) best = &t;
      const double bytes = L.weight_bytes() + double(M) * K * 2 + double(M) * N * 2;
      auto roof = [&](double ms) { return ms > 0 ? bytes / (ms * 1e6) / copy_gbs : 0.0; };
      auto tensor_fraction = [&](double ms) {
        return ms > 0 && tensor_tflops > 0 ? 2.0 * double(M) * double(N) * double(K) / (ms * 1e9) / tensor_tflops : 0.0;
      };
      const std::string dispatch = kq::quant_gemm_describe(s, sm);
      std::printf("%-18s %8.4f %8.4f %6.2f %5.2f %5.2f | %8.4f %6.2f | %-16s %2d %8.4f %6.2f %5.2f | %s%s\n", cs.c_str(), t_ours, t_cub, t_ours > 0 ? t_cub / t_ours : 0.0,
                  roof(t_ours), t_cub / read4_ms, t_mma, t_cub / t_mma, best ? best->name.c_str() : "-", best ? best->splits : 0, best ? best->ms : 0.0,
                  best ? t_cub / best->ms : 0.0, best ? roof(best->ms) : 0.0, dispatch.c_str(), err_ours < 2e-2 ? "" : "  BAD (ours vs mma.sync)");
      for (const auto& t : wg)
        if (!(t.err < 2e-2)) std::printf("  %s splits %d: rel err %.2e vs mma.sync: BAD\n", t.name.c_str(), t.splits, t.err);
      std::fflush(stdout);
      if (out) {
        std::ostringstream j;
        j << "{\"bench\": \"gemm4_probe\", \"case\": \"" << cs << "\", \"time_ms\": " << t_ours << ", \"peer\": \"cublas_bf16\", \"peer_time_ms\": " << t_cub
          << ", \"ratio_vs_peer\": " << (t_ours > 0 ? t_cub / t_ours : 0.0) << ", \"roofline_fraction\": " << roof(t_ours) << ", \"tensor_fraction\": " << tensor_fraction(t_ours)
          << ", \"tensor_tflops\": " << tensor_tflops << ", \"mma_time_ms\": " << t_mma << ", \"read4_ms\": " << read4_ms << ", \"read4_how\": \"" << read4.how << "\", \"read_bf16_ms\": " << read_bf16_ms
          << ", \"ratio_bound_vs_peer\": " << t_cub / read4_ms
          << ", \"dispatch\": \"" << dispatch << "\", \"ours_rel_err_vs_mma\": " << json_num(err_ours) << ", \"copy_gbs\": " << copy_gbs << ", \"l2_flush\": \"" << squeeze::bench::l2_flush_name() << "\", \"device\": \""
          << prop.name << "\", \"commit\": \"" << (commit ? commit : "unknown") << "\", \"wgmma\": [";
        for (std::size_t i = 0; i < wg.size(); ++i)
          j << (i ? ", " : "") << "{\"cfg\": \"" << wg[i].name << "\", \"splits\": " << wg[i].splits << ", \"reduce\": \"" << wg[i].reduce
            << "\", \"ms\": " << wg[i].ms
            << ", \"rel_err\": " << json_num(wg[i].err) << "}";
        j << "], \"probes\": [";
        for (std::size_t i = 0; i < pr.size(); ++i)
          j << (i ? ", " : "") << "{\"cfg\": \"" << pr[i].name << "\", \"splits\": " << pr[i].splits << ", \"reduce\": \"" << pr[i].reduce
            << "\", \"ms\": " << pr[i].ms << ", \"rel_err\": " << json_num(pr[i].err) << "}";
        j << "], \"streaming\": [";
        for (std::size_t i = 0; i < sv.size(); ++i)
          j << (i ? ", " : "") << "{\"cfg\": \"" << sv[i].name << "\", \"parts\": " << sv[i].splits << ", \"ms\": " << sv[i].ms
            << ", \"rel_err\": " << json_num(sv[i].err) << "}";
        j << "]";
        if (!tl.cfg.empty())
          j << ", \"timeline_us\": {\"cfg\": \"" << tl.cfg << "\", \"launch\": " << tl.launch << ", \"skew\": " << tl.skew << ", \"span\": " << tl.span
            << ", \"setup\": " << tl.setup << ", \"first_chunk\": " << tl.first << ", \"loop\": " << tl.loop << ", \"epilogue\": " << tl.epilogue
            << ", \"epilogue_wait\": " << tl.epi_wait << ", \"epilogue_stage\": " << tl.epi_stage << ", \"epilogue_store\": " << tl.epi_store
            << ", \"epilogue_rest\": " << tl.epi_tail << ", \"issue_start\": " << tl.issue_start << ", \"issue_bulk\": " << tl.issue_bulk
            << ", \"issue_x\": " << tl.issue_x
            << ", \"block\": " << tl.block << ", \"block_max\": " << tl.block_max << ", \"queued_first\": " << tl.queued_first
            << ", \"queued_last\": " << tl.queued_last << ", \"ghz\": " << tl.ghz << ", \"blocks\": " << tl.blocks << ", \"max_per_sm\": " << tl.max_per_sm
            << ", \"timer_tick_ns\": " << tl.tick_ns << "}";
        j << "}";
        out << j.str() << "\n";
        out.flush();
      }
    }
  }
  cublasDestroy(handle);
  return 0;
}
