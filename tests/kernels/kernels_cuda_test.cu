// GPU kernels against their CPU twins (ctest label `cuda`). Every test that needs a device skips when
// cudaGetDeviceCount fails or finds none; argument checks run everywhere (they fail before any launch).
// Tolerances, GPU vs CPU twin (same element functor; nvcc contracts a*b+c into FMA, g++ may not):
//   AdamW fp32 weights: |diff| <= 1e-6 * max(1, |w|); m: rel 1e-6 + abs 2e-8 (m cancels terms ~0.06, so its
//   rounding error is absolute); v: rel 1e-6 + abs 1e-14;
//   low-precision params: equal, or one rounding unit of P apart (a master 1 ulp apart can round differently);
//   unscale: bitwise (one multiply, one rounding); accumulate: rel 1e-6; L2 norm rel 1e-6, inf norm exact.
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>
#include <memory>

#include "squeeze/kernels/accumulate.cuh"
#include "squeeze/kernels/adamw.cuh"
#include "squeeze/kernels/grad_norm.cuh"
#include "squeeze/kernels/loss_scale.cuh"
#include "squeeze/optim/adamw.hpp"
#include "test_util.hpp"

namespace sk = squeeze::kernels;
using namespace squeeze;
using squeeze::test::for_each_type;
using squeeze::test::for_each_type_pair;
using squeeze::test::kSizes;

namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device"

// A device allocation of T[n] (+ `pad` spare elements so views can start unaligned).
template <class T>
struct DeviceVec {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit DeviceVec(std::size_t count, std::size_t pad = 0) : n(count) {
    SQUEEZE_CUDA_CHECK(cudaMalloc(&ptr, std::max<std::size_t>(1, count + pad) * sizeof(T)));
  }
  explicit DeviceVec(const std::vector<T>& h) : DeviceVec(h.size()) { upload(h); }
  DeviceVec(const DeviceVec&) = delete;
  ~DeviceVec() { cudaFree(ptr); }
  void upload(const std::vector<T>& h, std::size_t offset = 0) {
    if (!h.empty()) SQUEEZE_CUDA_CHECK(cudaMemcpy(ptr + offset, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download(std::size_t count, std::size_t offset = 0) const {
    std::vector<T> h(count);
    if (count) SQUEEZE_CUDA_CHECK(cudaMemcpy(h.data(), ptr + offset, count * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  std::vector<T> download() const { return download(n); }
};

template <class T>
T scalar_from_device(const T* p) {
  T h;
  SQUEEZE_CUDA_CHECK(cudaMemcpy(&h, p, sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// ---- AdamW -----------------------------------------------------------------------------------------------

// Host buffers of one AdamW tensor (the CPU twin's copy) and their device mirror at element `offset`
// (offset 1 makes every pointer unaligned: the scalar path).
template <class P, class G>
struct AdamWPair {
  std::int64_t n;
  std::size_t offset;
  std::vector<P> param;
  std::vector<float> master, m, v;
  std::vector<G> grad;
  DeviceVec<P> d_param;
  DeviceVec<float> d_master, d_m, d_v;
  DeviceVec<G> d_grad;

  AdamWPair(std::int64_t n_, std::mt19937& rng, std::size_t off = 0)
      : n(n_),
        offset(off),
        d_param(std::size_t(n_), off),
        d_master(std::size_t(n_), off),
        d_m(std::size_t(n_), off),
        d_v(std::size_t(n_), off),
        d_grad(std::size_t(n_), off) {
    const auto w0 = test::random_vec<float>(n, rng, -1.f, 1.f);
    for (float w : w0) param.push_back(from_float<P>(w));
    if constexpr (!std::is_same_v<P, float>) master = w0;
    m = test::random_vec<float>(n, rng, -0.05f, 0.05f);
    v = test::random_vec<float>(n, rng, 1e-6f, 1e-2f);
    grad = test::random_vec<G>(n, rng, -100.f, 100.f);
    d_param.upload(param, off);
    d_master.upload(master, off);
    d_m.upload(m, off);
    d_v.upload(v, off);
    d_grad.upload(grad, off);
  }
  sk::AdamWTensor<P, G> host() { return {param.data(), master.empty() ? nullptr : master.data(), grad.data(), m.data(), v.data(), n}; }
  sk::AdamWTensor<P, G> device() {
    return {d_param.ptr + offset, std::is_same_v<P, float> ? nullptr : d_master.ptr + offset,
            d_grad.ptr + offset,  d_m.ptr + offset,
            d_v.ptr + offset,     n};
  }
  // Compares the device result with the host (CPU twin) result.
  void expect_match(const std::string& label) {
    const auto gp = d_param.download(std::size_t(n), offset);
    const auto gm = d_m.download(std::size_t(n), offset), gv = d_v.download(std::size_t(n), offset);
    std::vector<float> gw;
    if constexpr (std::is_same_v<P, float>)
      gw = gp;
    else
      gw = d_master.download(std::size_t(n), offset);
    const std::vector<float>& hw = [&]() -> const std::vector<float>& {
      if constexpr (std::is_same_v<P, float>)
        return param;
      else
        return master;
    }();
    int bad = 0;
    for (std::int64_t i = 0; i < n && bad < 5; ++i) {
      const float pg = to_float(gp[i]), ph = to_float(param[i]);
      const bool ok = std::abs(gw[i] - hw[i]) <= 1e-6 * std::max(1.f, std::abs(hw[i])) &&
                      std::abs(gm[i] - m[i]) <= 1e-6 * std::abs(m[i]) + 2e-8 && std::abs(gv[i] - v[i]) <= 1e-6 * std::abs(v[i]) + 1e-14 &&
                      (std::is_same_v<P, float> || std::abs(pg - ph) <= test::unit_roundoff<P>() * 2 * std::abs(ph) + 1e-30);
      if (!ok) {
        ++bad;
        ADD_FAILURE() << label << " i=" << i << " w gpu " << gw[i] << " cpu " << hw[i] << " m " << gm[i] << " / " << m[i] << " v " << gv[i]
                      << " / " << v[i] << " param " << pg << " / " << ph;
      }
    }
  }
};

// Device copies of {inv_scale, found_inf, clip_coef} and an applied-steps counter.
struct DeviceDynamic {
  DeviceVec<float> f{3};
  DeviceVec<std::int64_t> step{1};
  DeviceDynamic(float inv_scale, float found_inf, float clip, std::int64_t applied) {
    f.upload({inv_scale, found_inf, clip});
    step.upload({applied});
  }
  sk::AdamWDynamic get() { return {f.ptr, f.ptr + 1, f.ptr + 2, step.ptr}; }
};

TEST(AdamWCuda, FlatMatchesCpuTwinForEveryTypePairAndSize) {
  REQUIRE_GPU();
  std::mt19937 rng(101);
  const auto c = sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1);
  for_each_type_pair([&]<class P, class G>() {
    for (std::int64_t n : kSizes) {
      for (std::size_t offset : {0, 1}) {  // aligned: vector path + tail; offset 1: scalar path
        AdamWPair<P, G> t(n, rng, offset);
        const float inv = 1.f / 128, clip = 0.75f, no_inf = 0.f;
        const std::int64_t applied = 4;  // step 5
        DeviceDynamic dd(inv, no_inf, clip, applied);
        ASSERT_EQ(sk::adamw_cuda(t.device(), c, dd.get()), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        sk::adamw_cpu(t.host(), c, {&inv, &no_inf, &clip, &applied});
        t.expect_match(std::string(dtype_name<P>()) + "/" + std::string(dtype_name<G>()) + " n=" + std::to_string(n) +
                       " offset=" + std::to_string(offset));
      }
    }
  });
}

TEST(AdamWCuda, TensorTableInOneLaunchMatchesCpuTwin) {
  REQUIRE_GPU();
  std::mt19937 rng(202);
  auto run = [&]<class P, class G>() {
    // 64 tensors with ragged sizes (some empty, some > one chunk, some unaligned).
    std::vector<std::unique_ptr<AdamWPair<P, G>>> ts;
    for (int i = 0; i < 64; ++i) {
      const std::int64_t n = i % 9 == 0 ? 0 : (i * 7919) % 40000 + (i % 5 == 0 ? sk::kChunkElems : 1);
      ts.push_back(std::make_unique<AdamWPair<P, G>>(n, rng, std::size_t(i % 3 == 0 ? 1 : 0)));
    }
    std::vector<sk::AdamWTensor<P, G>> dev, host;
    for (auto& t : ts) dev.push_back(t->device()), host.push_back(t->host());
    sk::DeviceTensorTable<sk::AdamWTensor<P, G>> table(dev);
    const auto c = sk::adamw_coeffs(3e-3f, 0.8f, 0.95f, 1e-6f, 0.05f, 2);
    ASSERT_EQ(sk::adamw_cuda(table.view(), c), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    sk::adamw_cpu(std::span<const sk::AdamWTensor<P, G>>(host), c);
    for (std::size_t i = 0; i < ts.size(); ++i) ts[i]->expect_match("table entry " + std::to_string(i));
  };
  run.template operator()<float, float>();
  run.template operator()<bf16, bf16>();
  run.template operator()<half, float>();
}

TEST(AdamWCuda, SkippedStepLeavesEverythingBitwiseUnchanged) {
  REQUIRE_GPU();
  std::mt19937 rng(303);
  for_each_type_pair([&]<class P, class G>() {
    AdamWPair<P, G> t((std::int64_t(1) << 20) + 3, rng);
    DeviceDynamic dd(0.5f, 1.f, 1.f, 0);
    const auto p0 = t.d_param.download();
    const auto mst0 = t.d_master.download(), m0 = t.d_m.download(), v0 = t.d_v.download();
    ASSERT_EQ(sk::adamw_cuda(t.device(), sk::adamw_coeffs(1e-2f, 0.9f, 0.999f, 1e-8f, 0.1f, 1), dd.get()), cudaSuccess);
    ASSERT_EQ(sk::adamw_commit_step_cuda(dd.step.ptr, dd.f.ptr + 1), cudaSuccess);
    EXPECT_TRUE(test::bits_equal(t.d_param.download(), p0));
    if constexpr (!std::is_same_v<P, float>) {
      EXPECT_TRUE(test::bits_equal(t.d_master.download(), mst0));
    }
    EXPECT_TRUE(test::bits_equal(t.d_m.download(), m0));
    EXPECT_TRUE(test::bits_equal(t.d_v.download(), v0));
    EXPECT_EQ(scalar_from_device(dd.step.ptr), 0) << "a skipped step does not count";
  });
}

TEST(AdamWCuda, CommitStepCountsAppliedSteps) {
  REQUIRE_GPU();
  DeviceDynamic dd(1.f, 0.f, 1.f, 41);
  ASSERT_EQ(sk::adamw_commit_step_cuda(dd.step.ptr, dd.f.ptr + 1), cudaSuccess);
  ASSERT_EQ(sk::adamw_commit_step_cuda(dd.step.ptr, nullptr), cudaSuccess);
  EXPECT_EQ(scalar_from_device(dd.step.ptr), 43);
}

// ---- loss scaling ----------------------------------------------------------------------------------------

TEST(LossScaleCuda, DeviceScalerFollowsTheCpuScalerExactly) {
  REQUIRE_GPU();
  sk::LossScaleOptions o;
  o.hysteresis = 2;
  o.min_scale = 1.f;
  sk::DeviceLossScaler d(o);
  sk::LossScaler h(o);
  std::vector<int> seq = {1, 1, 1};
  seq.resize(seq.size() + 2000, 0);
  seq.push_back(1);
  for (std::size_t i = 0; i < seq.size(); ++i) {
    if (seq[i]) {
      const float one = 1.f;
      SQUEEZE_CUDA_CHECK(cudaMemcpy(d.found_inf(), &one, sizeof one, cudaMemcpyHostToDevice));
      *h.found_inf() = 1.f;
    }
    ASSERT_EQ(d.update(), cudaSuccess);
    h.update();
  }
  const auto s = d.state();
  EXPECT_EQ(s.scale, h.scale());
  EXPECT_EQ(s.inv_scale, h.inv_scale());
  EXPECT_EQ(s.growth_tracker, h.state().growth_tracker);
  EXPECT_EQ(s.hysteresis_left, h.state().hysteresis_left);
  EXPECT_EQ(s.found_inf, 0.f);
  EXPECT_EQ(s.scale, 32768.f);  // 2^16: tolerated, /2, /2, x2 after 2000, tolerated
}

TEST(LossScaleCuda, ErrorAtMinimumSurfacesOnRead) {
  REQUIRE_GPU();
  sk::LossScaleOptions o;
  o.init_scale = 2.f;
  o.min_scale = 2.f;
  o.raise_at_min_scale = true;
  sk::DeviceLossScaler d(o);
  const float one = 1.f;
  SQUEEZE_CUDA_CHECK(cudaMemcpy(d.found_inf(), &one, sizeof one, cudaMemcpyHostToDevice));
  ASSERT_EQ(d.update(), cudaSuccess);
  test::expect_error([&] { d.state(); }, "sat at its minimum");
}

TEST(LossScaleCuda, CheckAndUnscaleMatchesCpuTwinBitwise) {
  REQUIRE_GPU();
  std::mt19937 rng(404);
  for_each_type([&]<class G>() {
    for (std::int64_t n : kSizes) {
      auto h = test::random_vec<G>(n, rng, -1000.f, 1000.f);
      DeviceVec<G> d(h);
      sk::DeviceLossScaler scaler({.init_scale = 1024.f});
      ASSERT_EQ(sk::check_and_unscale_cuda(sk::Buffer<G>{d.ptr, n}, scaler.found_inf(), scaler.inv_scale()), cudaSuccess);
      float found = 0;
      const sk::Buffer<G> hb{h.data(), n};
      sk::check_and_unscale_cpu(std::span(&hb, 1), &found, 1.f / 1024);
      EXPECT_TRUE(test::bits_equal(d.download(), h)) << dtype_name<G>() << " n=" << n;
      EXPECT_EQ(scaler.state().found_inf, 0.f);
      // One inf in a list of two buffers: the flag goes up.
      auto h2 = test::random_vec<G>(n, rng, -1.f, 1.f);
      h2[std::size_t(n / 2)] = from_float<G>(std::numeric_limits<float>::infinity());
      DeviceVec<G> d2(h2);
      const std::vector<sk::Buffer<G>> list = {{d.ptr, n}, {d2.ptr, n}};
      sk::DeviceTensorTable<sk::Buffer<G>> table(list);
      ASSERT_EQ(sk::check_and_unscale_cuda(table.view(), scaler.found_inf(), scaler.inv_scale()), cudaSuccess);
      EXPECT_EQ(scaler.state().found_inf, 1.f) << dtype_name<G>() << " n=" << n;
    }
  });
}

// ---- accumulation ----------------------------------------------------------------------------------------

TEST(AccumulateCuda, MatchesCpuTwin) {
  REQUIRE_GPU();
  std::mt19937 rng(505);
  for_each_type([&]<class G>() {
    for (std::int64_t n : kSizes) {
      std::vector<float> acc(std::size_t(n), 0.f);
      DeviceVec<float> dacc(acc);
      for (int k = 0; k < 3; ++k) {
        const auto g = test::random_vec<G>(n, rng, -5.f, 5.f);
        DeviceVec<G> dg(g);
        const float w = 0.2f + 0.1f * k;
        ASSERT_EQ(sk::accumulate_cuda(sk::AccumTensor<G>{dacc.ptr, dg.ptr, n}, w, k == 0), cudaSuccess);
        sk::accumulate_cpu(sk::AccumTensor<G>{acc.data(), g.data(), n}, w, k == 0);
      }
      const auto got = dacc.download();
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_LE(std::abs(got[i] - acc[i]), 1e-6 * (std::abs(acc[i]) + 1.f)) << dtype_name<G>() << " n=" << n << " i=" << i;
    }
  });
}

// ---- gradient norm ---------------------------------------------------------------------------------------

TEST(GradNormCuda, MatchesCpuTwinFlatAndTable) {
  REQUIRE_GPU();
  std::mt19937 rng(606);
  sk::GradNormWorkspace ws;
  DeviceVec<float> out(4);  // norm, clip, found_inf, inv_scale
  for_each_type([&]<class G>() {
    std::vector<std::vector<G>> h;
    std::vector<std::unique_ptr<DeviceVec<G>>> d;
    std::vector<sk::Buffer<const G>> hl, dl;
    for (std::int64_t n : kSizes) {
      h.push_back(test::random_vec<G>(n, rng, -2.f, 2.f));
      d.push_back(std::make_unique<DeviceVec<G>>(h.back()));
      hl.push_back({h.back().data(), n});
      dl.push_back({d.back()->ptr, n});
    }
    sk::DeviceTensorTable<sk::Buffer<const G>> table(dl);
    for (auto type : {sk::NormType::L2, sk::NormType::Inf}) {
      const float inv = 0.5f;
      out.upload({0.f, 0.f, 0.f, inv});
      ASSERT_EQ(sk::grad_norm_cuda<G>(table.view(), type, 1.f, out.ptr + 3, {out.ptr, out.ptr + 1, out.ptr + 2}, ws.get()), cudaSuccess);
      float norm = 0, clip = 0, found = 0;
      sk::grad_norm_cpu<G>(hl, type, 1.f, &inv, {&norm, &clip, &found});
      const auto got = out.download();
      if (type == sk::NormType::L2)
        EXPECT_NEAR(got[0], norm, 1e-6 * norm) << dtype_name<G>();
      else
        EXPECT_EQ(got[0], norm) << dtype_name<G>();
      EXPECT_NEAR(got[1], clip, 1e-6f);
      EXPECT_EQ(got[2], 0.f);
      // Flat: the largest buffer alone.
      ASSERT_EQ(sk::grad_norm_cuda<G>(dl.back(), type, 0.f, nullptr, {out.ptr, out.ptr + 1, nullptr}, ws.get()), cudaSuccess);
      const float flat = sk::grad_norm_cpu<G>(std::span(&hl.back(), 1), type);
      EXPECT_NEAR(out.download()[0], flat, 1e-6 * flat);
    }
    // A NaN in one buffer: found_inf.
    const G nan = from_float<G>(std::numeric_limits<float>::quiet_NaN());
    SQUEEZE_CUDA_CHECK(cudaMemcpy(d[1]->ptr + 3, &nan, sizeof nan, cudaMemcpyHostToDevice));
    out.upload({0.f, 0.f, 0.f, 1.f});
    ASSERT_EQ(sk::grad_norm_cuda<G>(table.view(), sk::NormType::L2, 1.f, nullptr, {out.ptr, out.ptr + 1, out.ptr + 2}, ws.get()),
              cudaSuccess);
    EXPECT_EQ(out.download()[2], 1.f) << dtype_name<G>();
  });
}

// The whole fused fp16 step on the device, no host sync in between: norm (+ overflow check) -> AdamW with
// inv_scale, clip and found_inf -> commit step -> scaler update. Compared with the CPU twins doing the same.
TEST(TrainingStepCuda, NormClipAdamWScalerPipelineMatchesCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(707);
  const std::int64_t n = 300001;
  AdamWPair<half, half> t(n, rng);
  sk::DeviceLossScaler ds({.init_scale = 256.f});
  sk::LossScaler hs({.init_scale = 256.f});
  sk::GradNormWorkspace ws;
  DeviceVec<float> clip(1);
  DeviceVec<std::int64_t> step(std::vector<std::int64_t>{0});
  float hclip = 0;
  std::int64_t hstep = 0;
  const auto c = sk::adamw_coeffs(1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1);
  for (int it = 0; it < 3; ++it) {
    if (it == 1) {  // an overflow on step 2: skipped on both sides
      t.grad[7] = from_float<half>(std::numeric_limits<float>::infinity());
      t.d_grad.upload(t.grad);
    }
    if (it == 2) {
      t.grad[7] = from_float<half>(1.f);
      t.d_grad.upload(t.grad);
    }
    ASSERT_EQ(sk::grad_norm_cuda<half>(sk::Buffer<const half>{t.d_grad.ptr, n}, sk::NormType::L2, 1.f, ds.inv_scale(),
                                       {nullptr, clip.ptr, ds.found_inf()}, ws.get()),
              cudaSuccess);
    ASSERT_EQ(sk::adamw_cuda(t.device(), c, {ds.inv_scale(), ds.found_inf(), clip.ptr, step.ptr}), cudaSuccess);
    ASSERT_EQ(sk::adamw_commit_step_cuda(step.ptr, ds.found_inf()), cudaSuccess);
    ASSERT_EQ(ds.update(), cudaSuccess);

    const sk::Buffer<const half> hb{t.grad.data(), n};
    sk::grad_norm_cpu<half>(std::span(&hb, 1), sk::NormType::L2, 1.f, hs.inv_scale_ptr(), {nullptr, &hclip, hs.found_inf()});
    sk::adamw_cpu(t.host(), c, {hs.inv_scale_ptr(), hs.found_inf(), &hclip, &hstep});
    sk::adamw_commit_step(&hstep, hs.found_inf());
    hs.update();
  }
  EXPECT_EQ(scalar_from_device(step.ptr), 2);
  EXPECT_EQ(hstep, 2);
  EXPECT_EQ(ds.scale(), hs.scale());
  t.expect_match("pipeline");
}

// ---- the optimizer facade: CUDA backend vs host backend --------------------------------------------------

// fp16 + dynamic loss scaling + Accumulate<2> + clipping, with an overflow on the second step.
TEST(KernelsCudaArgs, BadInputGivesClearErrors) {
  float* fake = reinterpret_cast<float*>(std::uintptr_t(256));  // never dereferenced: validation fails first
  const auto c = sk::adamw_coeffs(1e-3f, 0.9f, 0.999f, 1e-8f, 0.f, 1);
  test::expect_error(
      [&] {
        (void)sk::adamw_cuda(sk::AdamWTensor<float, float>{fake, nullptr, nullptr, fake, fake, 10}, c);
      },
      "grad pointer is null");
  test::expect_error(
      [&] {
        (void)sk::adamw_cuda(sk::AdamWTensor<half, float>{reinterpret_cast<half*>(fake), nullptr, fake, fake, fake, 10}, c);
      },
      "half params need fp32 master weights");
  test::expect_error(
      [&] {
        (void)sk::adamw_cuda(sk::TensorTable<sk::AdamWTensor<float, float>>{nullptr, nullptr, 3, 5}, c);
      },
      "tensor table has null entries");
  test::expect_error([&] { (void)sk::accumulate_cuda(sk::AccumTensor<float>{fake, nullptr, 4}, 1.f, true); }, "gradient pointer is null");
  test::expect_error([&] { (void)sk::check_and_unscale_cuda(sk::Buffer<float>{fake, 4}, nullptr, fake); }, "found_inf / inv_scale");
  test::expect_error(
      [&] {
        (void)sk::grad_norm_cuda<float>(sk::Buffer<const float>{fake, 4}, sk::NormType::L2, 0.f, nullptr, {}, nullptr);
      },
      "workspace is null");
  test::expect_error([&] { (void)sk::adamw_commit_step_cuda(nullptr, nullptr); }, "step pointer is null");
}

}  // namespace
