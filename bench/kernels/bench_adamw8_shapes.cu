// bench_adamw8_shapes: every shape of the 8-bit AdamW kernel (adamw8_shapes.cuh's Shapes) beside the copy bound of its
// bytes, without libtorch (builds in about a minute; bench_adamw has the same rows beside torch's fused AdamW).
//
//   bench_adamw8_shapes [--out FILE] [--n PARAMS] [--tensors 64] [--iters 20] [--check-n PARAMS] [--only SHAPE] [--no-check]
// (--only: one shape, e.g. under ncu; --tensors 1: the flat rows alone)
//
// bf16 params + fp32 master, bf16 grads, 8-bit m and v (16 B/param + 8 B of absmax per 256), 1 Gi parameters by
// default, as one flat buffer and as --tensors slices of whole state blocks in one launch. Each shape starts from the
// same state: warm-up 3 steps, then the median of --iters steps timed with CUDA events; the copy bound is a cudaMemcpy
// D2D of half the bytes (it reads and writes them all), median of 10, measured in the same run. Rows also give the
// kernel's registers and resident blocks per SM. First, every shape runs one step from the same state of --check-n
// parameters (ragged, as a table with a misaligned tensor) and must give the default shape's bytes exactly (the CPU
// twin's bits are tests/kernels/adamw8_cuda_test.cu's job).
// Output: JSON lines {"bench":"adamw8_shapes", "case", "variant", ...} to --out, a table on stdout.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "../cuda_timing.hpp"
#include "squeeze/kernels/adamw8.cuh"
#include "adamw8_shapes.cuh"

namespace {

namespace sk = squeeze::kernels;
using squeeze::bf16;
using Tensor8 = sk::AdamW8Tensor<bf16, bf16>;
using DefaultShape = sk::AdamW8DefaultPolicy<bf16, bf16>;  // what adamw8_cuda launches for these types

constexpr double kBytesPerParam = 16.0 + 16.0 / 256;

struct Options {
  std::string out;
  std::int64_t n = std::int64_t(1) << 30;
  int tensors = 64, iters = 20;
  std::int64_t check_n = (std::int64_t(1) << 22) + 3 * 256 + 77;
  std::string only;
  bool check = true;
};

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

// Deterministic pseudo-random fill on the device (splitmix64 of the index).
__device__ std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
__device__ float uniform(std::uint64_t seed, std::int64_t i) {  // in [-1, 1)
  return float(mix(seed * 0x100000001b3ull + std::uint64_t(i)) >> 40) * 0x1p-24f * 2.0f - 1.0f;
}
__global__ void fill_state(bf16* param, float* master, bf16* grad, std::uint8_t* m, std::uint8_t* v, std::int64_t n, std::uint64_t seed) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n; i += std::int64_t(gridDim.x) * blockDim.x) {
    const float w = 0.02f * uniform(seed, i);
    master[i] = w;
    param[i] = __float2bfloat16_rn(w);
    grad[i] = __float2bfloat16_rn(1e-3f * uniform(seed + 1, i));
    m[i] = sk::kZeroCodeSigned;
    v[i] = sk::kZeroCodeUnsigned;
  }
}
__global__ void fill_grad(bf16* grad, std::int64_t n, std::uint64_t seed) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n; i += std::int64_t(gridDim.x) * blockDim.x)
    grad[i] = __float2bfloat16_rn(1e-3f * uniform(seed, i));
}

#define CHECK_CUDA(x)                                                                                  \
  do {                                                                                                 \
    const cudaError_t e_ = (x);                                                                        \
    if (e_ != cudaSuccess) {                                                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));         \
      std::exit(1);                                                                                    \
    }                                                                                                  \
  } while (0)

// The buffers of n parameters in one allocation each; `off` elements of slack in front of every buffer so a tensor
// can start misaligned.
struct State {
  std::int64_t n = 0;
  bf16* param = nullptr;
  float* master = nullptr;
  bf16* grad = nullptr;
  std::uint8_t *m = nullptr, *v = nullptr;
  float *ma = nullptr, *va = nullptr;
  explicit State(std::int64_t n_) : n(n_) {
    const std::int64_t blocks = sk::state_blocks(n) + 64;
    CHECK_CUDA(cudaMalloc(&param, (n + 64) * sizeof(bf16)));
    CHECK_CUDA(cudaMalloc(&master, (n + 64) * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&grad, (n + 64) * sizeof(bf16)));
    CHECK_CUDA(cudaMalloc(&m, n + 64));
    CHECK_CUDA(cudaMalloc(&v, n + 64));
    CHECK_CUDA(cudaMalloc(&ma, blocks * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&va, blocks * sizeof(float)));
    reset();
  }
  // The starting state (fresh moments), so every timed shape walks the same values.
  void reset() {
    const std::int64_t blocks = sk::state_blocks(n) + 64;
    CHECK_CUDA(cudaMemset(ma, 0, blocks * sizeof(float)));
    CHECK_CUDA(cudaMemset(va, 0, blocks * sizeof(float)));
    fill_state<<<1024, 256>>>(param, master, grad, m, v, n + 64, 7);
    CHECK_CUDA(cudaGetLastError());
  }
  State(const State&) = delete;
  ~State() {
    cudaFree(param), cudaFree(master), cudaFree(grad), cudaFree(m), cudaFree(v), cudaFree(ma), cudaFree(va);
  }
  // `tensors` slices of whole state blocks (the last takes the rest); skew: the elements tensor i starts past its
  // block-aligned place (the check's misaligned tensor).
  std::vector<Tensor8> slices(std::int64_t count, int tensors, int skew_tensor = -1) const {
    std::vector<Tensor8> out;
    const std::int64_t per = count / tensors / sk::kStateBlock * sk::kStateBlock;
    for (int i = 0; i < tensors; ++i) {
      const std::int64_t off = i * per, len = i + 1 == tensors ? count - off : per, b = off / sk::kStateBlock + i;
      const std::int64_t s = i == skew_tensor ? 1 : 0;
      out.push_back({param + off + s, master + off + s, grad + off + s, m + off + s, ma + b, v + off + s, va + b, len - s});
    }
    return out;
  }
  std::vector<std::uint8_t> bytes() const {  // everything a step writes, for the cross-shape check
    const std::int64_t blocks = sk::state_blocks(n) + 64;
    std::vector<std::uint8_t> h((n + 64) * (sizeof(bf16) + sizeof(float) + 2) + 2 * blocks * sizeof(float));
    std::uint8_t* p = h.data();
    auto get = [&](const void* d, std::size_t b) {
      CHECK_CUDA(cudaMemcpy(p, d, b, cudaMemcpyDeviceToHost));
      p += b;
    };
    get(param, (n + 64) * sizeof(bf16)), get(master, (n + 64) * sizeof(float)), get(m, n + 64), get(v, n + 64);
    get(ma, blocks * sizeof(float)), get(va, blocks * sizeof(float));
    return h;
  }
};

template <class Policy>
struct Shape {
  static cudaError_t step(const std::vector<Tensor8>& list, const sk::DeviceTensorTable<Tensor8>& table, int t) {
    const auto c = sk::adamw_coeffs(1e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, t);
    return list.size() == 1 ? sk::adamw8_cuda<Policy>(list[0], c) : sk::adamw8_cuda<Policy>(table.view(), c);
  }
  static void kernel_figures(bool flat, int& regs, int& per_sm) {
    cudaFuncAttributes a{};
    if (flat) {
      auto* k = sk::detail::adamw8_kernel<Policy, bf16, bf16, sk::FlatSource<Tensor8>>;
      CHECK_CUDA(cudaFuncGetAttributes(&a, k));
      CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, Policy::threads, 0));
    } else {
      auto* k = sk::detail::adamw8_kernel<Policy, bf16, bf16, sk::TableSource<Tensor8>>;
      CHECK_CUDA(cudaFuncGetAttributes(&a, k));
      CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, Policy::threads, 0));
    }
    regs = a.numRegs;
  }
};

// f<Policy>() for every shape, or the one named `only`.
template <class F>
void for_each_shape(const std::string& only, F&& f) {
  [&]<class... Policies>(std::tuple<Policies...>*) {
    ((only.empty() || only == Policies::name ? f.template operator()<Policies>() : void()), ...);
  }(static_cast<squeeze::bench::adamw8::Shapes*>(nullptr));
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) std::fprintf(stderr, "%s needs a value\n", a.c_str()), std::exit(2);
      return argv[++i];
    };
    if (a == "--out") o.out = next();
    else if (a == "--n") o.n = std::stoll(next());
    else if (a == "--tensors") o.tensors = std::stoi(next());
    else if (a == "--iters") o.iters = std::stoi(next());
    else if (a == "--check-n") o.check_n = std::stoll(next());
    else if (a == "--only") o.only = next();
    else if (a == "--no-check") o.check = false;
    else std::fprintf(stderr, "unknown argument %s (--out --n --tensors --iters --check-n --only --no-check)\n", a.c_str()), std::exit(2);
  }
  if (o.tensors < 1 || o.n < o.tensors * sk::kStateBlock || o.iters < 1 || o.check_n < 4 * sk::kStateBlock)
    std::fprintf(stderr, "need --n >= 256 x --tensors, --iters >= 1, --check-n >= 1024\n"), std::exit(2);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: nothing measured\n");
    return 0;
  }
  std::ofstream file;
  if (!o.out.empty()) file.open(o.out, std::ios::app);
  const std::string device = env_or("SQUEEZE_DEVICE", "unknown"), date = env_or("SQUEEZE_DATE", "unknown"),
                    commit = env_or("SQUEEZE_COMMIT", "unknown");
  std::printf("bench_adamw8_shapes: %s, %s, commit %s\n", device.c_str(), date.c_str(), commit.c_str());

  // Same bytes from every shape: one step from one state, as a table of 3 tensors (the middle one misaligned).
  int mismatches = 0;
  if (o.check) {
    State st(o.check_n);
    fill_grad<<<1024, 256>>>(st.grad, o.check_n + 64, 11);
    const std::vector<Tensor8> list = st.slices(o.check_n, 3, 1);
    sk::DeviceTensorTable<Tensor8> table(list);
    CHECK_CUDA(Shape<DefaultShape>::step(list, table, 1));  // non-trivial moments first
    fill_grad<<<1024, 256>>>(st.grad, o.check_n + 64, 12);
    CHECK_CUDA(cudaDeviceSynchronize());
    const std::vector<std::uint8_t> start = st.bytes();
    std::vector<std::uint8_t> want;
    auto restore = [&] {
      const std::uint8_t* p = start.data();
      const std::int64_t n = o.check_n, blocks = sk::state_blocks(n) + 64;
      auto put = [&](void* d, std::size_t b) {
        CHECK_CUDA(cudaMemcpy(d, p, b, cudaMemcpyHostToDevice));
        p += b;
      };
      put(st.param, (n + 64) * sizeof(bf16)), put(st.master, (n + 64) * sizeof(float)), put(st.m, n + 64), put(st.v, n + 64);
      put(st.ma, blocks * sizeof(float)), put(st.va, blocks * sizeof(float));
    };
    restore();
    CHECK_CUDA(Shape<DefaultShape>::step(list, table, 2));
    CHECK_CUDA(cudaDeviceSynchronize());
    want = st.bytes();
    for_each_shape(o.only, [&]<class Policy>() {
      restore();
      CHECK_CUDA(Shape<Policy>::step(list, table, 2));
      CHECK_CUDA(cudaDeviceSynchronize());
      const bool same = st.bytes() == want;
      mismatches += !same;
      std::printf("check %-24s %s the default shape's bytes (%lld params)\n", Policy::name, same ? "==" : "DIFFERS FROM",
                  static_cast<long long>(o.check_n));
    });
  }

  State st(o.n);
  CHECK_CUDA(cudaDeviceSynchronize());
  const double copy = squeeze::bench::copy_GBps(std::int64_t(kBytesPerParam * double(o.n) / 2));
  std::printf("copy bound (cudaMemcpy D2D of the kernel's bytes): %.1f GB/s\n", copy);
  for (int k : {1, o.tensors}) {
    const std::vector<Tensor8> list = st.slices(o.n, k);
    sk::DeviceTensorTable<Tensor8> table;
    if (k > 1) table.upload(list);
    const std::string name = "gpu/bf16-mixed-adam8/" + (k == 1 ? std::string("flat") : std::to_string(k) + "-tensors") + "/" +
                             std::to_string(o.n >> 20) + "Mi";
    for_each_shape(o.only, [&]<class Policy>() {
      st.reset();
      squeeze::bench::Events ev;
      std::vector<double> ms;
      for (int i = 0; i < 3 + o.iters; ++i) {
        const double t = ev.time([&] { CHECK_CUDA(Shape<Policy>::step(list, table, i + 1)); });
        if (i >= 3) ms.push_back(t);
      }
      const double time_ms = squeeze::bench::median(ms), bw = kBytesPerParam * double(o.n) / (time_ms * 1e-3) / 1e9;
      int regs = 0, per_sm = 0;
      Shape<Policy>::kernel_figures(k == 1, regs, per_sm);
      std::printf("%-36s %-24s %8.3f ms %8.1f GB/s  fraction of copy %.3f  (%d regs, %d blocks of %d per SM)\n", name.c_str(), Policy::name,
                  time_ms, bw, bw / copy, regs, per_sm, Policy::threads);
      std::ostringstream j;
      j.precision(6);
      j << "{\"bench\":\"adamw8_shapes\",\"case\":\"" << name << "\",\"variant\":\"" << Policy::name
        << "\",\"default_variant\":" << (std::strcmp(Policy::name, DefaultShape::name) == 0 ? "true" : "false")
        << ",\"time_ms\":" << time_ms << ",\"bandwidth_GBps\":" << bw << ",\"copy_same_bytes_GBps\":" << copy
        << ",\"roofline_fraction_same_bytes\":" << bw / copy << ",\"registers\":" << regs << ",\"blocks_per_sm\":" << per_sm
        << ",\"threads\":" << Policy::threads << ",\"per_lane\":" << Policy::per_lane << ",\"blocks_in_flight\":" << Policy::blocks_in_flight
        << ",\"min_blocks_per_sm\":" << Policy::min_blocks_per_sm << ",\"branch_free\":" << (squeeze::bench::adamw8::branch_free<Policy>() ? "true" : "false")
        << ",\"params\":" << o.n << ",\"bytes_per_param\":" << kBytesPerParam << ",\"device\":\"" << device << "\",\"date\":\"" << date
        << "\",\"commit\":\"" << commit << "\"}";
      if (file) file << j.str() << "\n" << std::flush;
    });
    if (o.tensors == 1) break;  // the flat rows were all
  }
  return mismatches == 0 ? 0 : 1;
}
