// The GPTQ-layout dequantize kernel (kernels/.../dequant.cuh) against its CPU twin (label cuda; skips without a device):
// bit-identical, since both apply the same element function. A binary of its own: it builds in seconds on the GPU
// machine.
#include "quant_cuda_common.cuh"

// The tiled dequantize against the twin, exactly, in every output type: tiles cut by out and in (67 / 130 outs; 300 in,
// whose bf16 rows are not a whole number of 16-byte stores, 200 whose are, with a 64-tile cut at 8), 3-bit codes
// straddling words, groups of 32 / 128 / per channel, act-order g_idx; each case with every kernel (GptqView::act_order
// false; true with the group count, the shared-memory table, 128 groups its largest; true without it, or with 129 groups,
// the four-at-a-time lookups): the flag only picks the kernel, each is exact for any g_idx; and each with its own count of
// 64-in tiles a block and with 3 (blocks whose last tile is cut, or past in).
template <class T>
void expect_dequantize_matches_twin() {
  struct Case {
    std::int64_t out, in;
    int group;
    bool act_order;
  };
  for (int bits : {2, 3, 4, 8})
    for (const Case c : {Case{67, 300, 32, true}, Case{130, 200, 128, false}, Case{64, 448, 0, false}, Case{19, 136, 32, false},
                         Case{40, 4096, 32, true}, Case{40, 4100, 32, true}}) {
      const auto p = random_layer(c.out, c.in, bits, c.group, c.act_order, 3 + bits);
      DevLayer d(p);
      const kq::GptqView hv{p.qweight.data(), p.qzeros.data(), p.scales.data(), p.g_idx.data(), p.in, p.out, p.bits};
      std::vector<T> ref(p.in * p.out);
      kq::dequantize_cpu(hv, ref.data());
      for (const int kernel : {0, 1, 2})  // in order; act-order lookups; act-order table (lookups past 128 groups)
        for (const int tiles : {0, 3}) {  // 0: the kernel's own count
          Dev<T> w(ref.size());
          kq::GptqView dv = d.view(p);
          dv.act_order = kernel > 0;
          dv.groups = kernel == 2 ? p.groups() : 0;
          SQUEEZE_CUDA_CHECK(kq::detail::launch_dequantize(dv, w.p, nullptr, tiles));
          const auto got = w.get();
          for (std::size_t k = 0; k < ref.size(); ++k)
            ASSERT_EQ(to_float(got[k]), to_float(ref[k])) << bits << " bits, " << c.out << " x " << c.in << ", kernel " << kernel
                                                          << ", tiles " << tiles << ", W[" << k / c.in << ", " << k % c.in << "]";
        }
    }
}
TEST(QuantCuda, DequantizeIsBitIdenticalToCpuTwinBf16) {
  REQUIRE_DEVICE();
  expect_dequantize_matches_twin<bf16>();
}
TEST(QuantCuda, DequantizeIsBitIdenticalToCpuTwinHalf) {
  REQUIRE_DEVICE();
  expect_dequantize_matches_twin<half>();
}
TEST(QuantCuda, DequantizeIsBitIdenticalToCpuTwinFloat) {
  REQUIRE_DEVICE();
  expect_dequantize_matches_twin<float>();
}
// Widths other than 2/3/4/8, layers wider than the grid allows and bad tile counts are refused before any launch.
TEST(QuantCuda, DequantizeRejectsBadWidthAndShape) {
  REQUIRE_DEVICE();
  const kq::GptqView five{nullptr, nullptr, nullptr, nullptr, 64, 64, 5};
  EXPECT_EQ(kq::dequantize_cuda(five, static_cast<bf16*>(nullptr), nullptr), cudaErrorInvalidValue);
  const kq::GptqView wide{nullptr, nullptr, nullptr, nullptr, std::int64_t(256) * 65536, 64, 4};
  EXPECT_EQ(kq::dequantize_cuda(wide, static_cast<bf16*>(nullptr), nullptr), cudaErrorInvalidValue);
  const kq::GptqView empty{nullptr, nullptr, nullptr, nullptr, 0, 64, 4};
  EXPECT_EQ(kq::dequantize_cuda(empty, static_cast<bf16*>(nullptr), nullptr), cudaErrorInvalidValue);
  // an explicit count of tiles a block: negative, or so few that the grid passes its y limit (in within the rule above)
  const kq::GptqView deep{nullptr, nullptr, nullptr, nullptr, std::int64_t(64) * 65536 + 64, 64, 4};
  EXPECT_EQ(kq::detail::launch_dequantize(deep, static_cast<bf16*>(nullptr), nullptr, -1), cudaErrorInvalidValue);
  EXPECT_EQ(kq::detail::launch_dequantize(deep, static_cast<bf16*>(nullptr), nullptr, 1), cudaErrorInvalidValue);
}
