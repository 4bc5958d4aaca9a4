// bitsandbytes NF4: the dynamic map, nested absmax, the quant_state JSON and the Linear4bit state-dict keys.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include <squeeze/io/bnb_nf4.hpp>
#include <squeeze/io/safetensors.hpp>

#include "io_test_util.hpp"

namespace io = squeeze::io;
namespace q = squeeze::quant;

namespace {
std::vector<float> random_weights(std::int64_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 0.02f);
  std::vector<float> w(static_cast<std::size_t>(n));
  for (auto& v : w) v = d(rng);
  for (std::int64_t i = 0; i < n; i += 997) w[i] *= 8.f;  // outliers: absmax varies between blocks
  return w;
}

// Writes the module's keys to one safetensors file and opens it as a checkpoint.
io::SafetensorsCheckpoint write_and_open(const io_test::TempDir& dir, const io::NamedTensors& t) {
  std::map<std::string, io::TensorRef> refs;
  for (const auto& [name, o] : t) refs[name] = o.ref();
  io::save_safetensors(dir.path / "model.safetensors", refs, {{"format", "pt"}});
  return io::SafetensorsCheckpoint::open(dir.path);
}
const std::string kModule = "model.layers.0.mlp.down_proj";
}  // namespace

// Entries derived by hand from bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8).
TEST(BnbDynamicMap, MatchesThePublishedConstruction) {
  const auto& m = q::bnb_dynamic_map();
  EXPECT_TRUE(std::is_sorted(m.begin(), m.end()));
  EXPECT_EQ(m[127], 0.f);
  EXPECT_EQ(m[255], 1.f);
  const auto near = [](float got, double want) { EXPECT_NEAR(got, want, std::fabs(want) * 1e-6) << want; };
  near(m[254], (0.9859375 + 1.0) / 2);  // the last midpoint of linspace(0.1, 1, 65), times 10^0
  near(m[0], -(0.9859375 + 1.0) / 2);
  near(m[128], 0.55e-6);  // e = 0: linspace(0.1, 1, 2) -> one midpoint, times 10^-6
  near(m[126], -0.55e-6);
  near(m[129], 0.325e-5);  // e = 1: linspace(0.1, 1, 3) = 0.1, 0.55, 1
  near(m[130], 0.775e-5);
  for (int k = 0; k < 4; ++k) near(m[131 + k], (0.2125 + 0.225 * k) * 1e-4);  // e = 2: step 0.225
  near(m[135], (0.1 + 0.1125 / 2) * 1e-3);                                    // e = 3: step 0.1125
  int negative = 0;
  for (int i = 0; i < 127; ++i) {
    EXPECT_EQ(m[i], -m[254 - i]) << i;
    negative += m[i] < 0;
  }
  EXPECT_EQ(negative, 127);
}

// The nested statistics of a 3-group absmax vector (the last short): each absmax' within half the map's largest gap
// (0.9 / 64) times its group's nested absmax of the exact value.
TEST(BnbDynamicMap, NestedRoundTripIsWithinHalfAGap) {
  auto x = random_weights(700, 3);
  for (auto& v : x) v = std::fabs(v);
  std::vector<std::uint8_t> code(700);
  std::vector<float> nested(3);
  float offset = 0.f;
  squeeze::kernels::quant::nf4_double_quantize_cpu(x.data(), 700, q::bnb_dynamic_map().data(), code.data(), nested.data(), &offset);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float back = squeeze::kernels::quant::nf4_nested_absmax(q::bnb_dynamic_map().data(), code[i], nested[i / 256], offset);
    EXPECT_LE(std::fabs(back - x[i]), 0.5f * 0.9f / 64 * nested[i / 256] + 1e-7f) << i;
  }
}

TEST(BnbQuantState, JsonRoundTripAndPythonsSpelling) {
  io::BnbQuantStateInfo s{.blocksize = 64, .dtype = "float16", .shape = {32, 48}, .nested = true, .nested_offset = 0.012345678f};
  EXPECT_EQ(io::decode_quant_state(io::encode_quant_state(s), "k"), s);
  s.nested = false;
  s.nested_offset = 0.f;
  EXPECT_EQ(io::decode_quant_state(io::encode_quant_state(s), "k"), s);
  // json.dumps' separators, as pack_dict_to_tensor writes them
  const auto p = io::decode_quant_state(R"({"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [11, 13], )"
                                        R"("nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.0123})",
                                        "k");
  EXPECT_TRUE(p.nested);
  EXPECT_EQ(p.shape, (std::vector<std::int64_t>{11, 13}));
  EXPECT_EQ(p.nested_offset, 0.0123f);
  io_test::expect_error([] { io::decode_quant_state(R"({"quant_type": "fp4", "blocksize": 64, "dtype": "x", "shape": [2]})", "w.qs"); },
                        {"w.qs", "fp4"});
  io_test::expect_error([] { io::decode_quant_state("{oops", "w.qs"); }, {"w.qs", "JSON"});
  io_test::expect_error([] { io::decode_quant_state(R"({"quant_type": "nf4", "blocksize": 64, "dtype": "x"})", "w.qs"); }, {"'shape'"});
}

// squeeze's NF4 tensors (plain and DoubleQuant) written as bitsandbytes keys: the same numbers, nested when DoubleQuant.
TEST(BnbNf4, WrittenSqueezeTensorsDequantizeLikeSqueeze) {
  const std::int64_t out = 41, in = 75;  // odd n, a short last block
  const auto w = random_weights(out * in, 1);
  for (bool dq : {false, true}) {
    io_test::TempDir dir(std::string("bnb_from_squeeze_") + (dq ? "dq" : "plain"));
    const auto p = q::nf4_quantize(w.data(), out * in, q::Nf4Options{64, dq});
    const auto ck = write_and_open(dir, io::bnb_nf4_tensors(kModule, io::from_nf4_packed(p, {out, in})));
    const auto b = io::read_bnb_nf4(ck, kModule);
    EXPECT_EQ(b.info.nested, dq);
    const auto back = io::to_nf4_packed(b);
    EXPECT_EQ(back.codes, p.codes);
    EXPECT_EQ(back.absmax, p.absmax);
    EXPECT_EQ(back.absmax_code, p.absmax_code);
    EXPECT_EQ(back.nested_absmax, p.nested_absmax);
    EXPECT_EQ(back.absmax_offset, p.absmax_offset);
    std::vector<float> ref(static_cast<std::size_t>(out * in));
    q::nf4_dequantize(p, ref.data());
    EXPECT_EQ(io::bnb_nf4_dequantize(b), ref);
    EXPECT_EQ(ck.info(kModule + ".weight").shape, (std::vector<std::int64_t>{(out * in + 1) / 2, 1}));
  }
}

// bitsandbytes' own nested DoubleQuant: keys, dtypes, shapes; read back into squeeze's NF4 tensors.
TEST(BnbNf4, NestedStateKeysAndSqueezeDequantization) {
  io_test::TempDir dir("bnb_nested");
  const std::int64_t out = 96, in = 400;  // 600 blocks: 3 nested groups, the last short
  const auto w = random_weights(out * in, 2);
  const auto b = io::bnb_nf4_quantize(w, {out, in}, /*nested=*/true);
  const auto ck = write_and_open(dir, io::bnb_nf4_tensors(kModule, b));
  const std::string k = kModule + ".weight";
  const auto expect = [&](const std::string& name, io::DType d, std::vector<std::int64_t> shape) {
    ASSERT_TRUE(ck.contains(name)) << name;
    EXPECT_EQ(ck.info(name).dtype, d) << name;
    EXPECT_EQ(ck.info(name).shape, shape) << name;
  };
  expect(k, io::DType::U8, {out * in / 2, 1});
  expect(k + ".absmax", io::DType::U8, {600});
  expect(k + ".quant_map", io::DType::F32, {16});
  expect(k + ".nested_absmax", io::DType::F32, {3});
  expect(k + ".nested_quant_map", io::DType::F32, {256});
  ASSERT_TRUE(ck.contains(k + ".quant_state.bitsandbytes__nf4"));
  const auto blob = ck.read<std::uint8_t>(k + ".quant_state.bitsandbytes__nf4", io::DType::U8);
  const auto j = nlohmann::json::parse(std::string(blob.begin(), blob.end()));
  for (const char* key : {"quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["shape"], nlohmann::json::array({out, in}));

  const auto r = io::read_bnb_nf4(ck, kModule);
  EXPECT_EQ(r.info, b.info);
  EXPECT_EQ(r.absmax_codes, b.absmax_codes);
  const auto values = io::bnb_nf4_dequantize(r);
  EXPECT_EQ(values, io::bnb_nf4_dequantize(b));
  std::vector<float> sq(values.size());
  q::nf4_dequantize(io::to_nf4_packed(r), sq.data());
  for (std::size_t i = 0; i < sq.size(); ++i) ASSERT_NEAR(sq[i], values[i], std::fabs(values[i]) * 1.2e-7f) << i;

  // the nested absmax' stays near the exact absmax (8-bit dynamic codes of absmax - mean)
  std::vector<float> exact(600);
  squeeze::kernels::quant::nf4_absmax_cpu(w.data(), out * in, 64, exact.data());
  const auto packed = io::to_nf4_packed(r);
  for (int i = 0; i < 600; ++i)
    EXPECT_NEAR(squeeze::kernels::quant::nf4_block_absmax(packed.view(), i), exact[i], 0.5f * 0.9f / 64 * r.nested_absmax[i / 256] + 1e-6f)
        << i;
}

TEST(BnbNf4, BadStateDictsNameTheKey) {
  const auto b = io::bnb_nf4_quantize(random_weights(64 * 300, 4), {64, 300}, true);
  const std::string k = kModule + ".weight";
  const auto with = [&](const std::function<void(std::map<std::string, io::OwnedTensor>&)>& edit) {
    const auto list = io::bnb_nf4_tensors(kModule, b);
    std::map<std::string, io::OwnedTensor> t(list.begin(), list.end());
    edit(t);
    io_test::TempDir dir("bnb_bad");
    const auto ck = write_and_open(dir, io::NamedTensors(t.begin(), t.end()));
    return io_test::error_of([&] { io::read_bnb_nf4(ck, kModule); });
  };
  EXPECT_NE(with([&](auto& t) { t.erase(k + ".nested_absmax"); }).find(k + ".nested_absmax' is missing"), std::string::npos);
  EXPECT_NE(with([&](auto& t) { t.erase(k + ".quant_state.bitsandbytes__nf4"); }).find("quant_state.bitsandbytes__nf4"), std::string::npos);
  EXPECT_NE(with([&](auto& t) { t[k + ".absmax"].shape = {150, 2}; }).find(k + ".absmax' is [150, 2], expected [300]"), std::string::npos);
  EXPECT_NE(with([&](auto& t) {
              auto& m = t[k + ".quant_map"];
              reinterpret_cast<float*>(m.bytes.data())[3] = 0.5f;
            }).find("quant_map' is not the NF4 table"),
            std::string::npos);
  EXPECT_NE(with([&](auto& t) { t[k].dtype = io::DType::I8; }).find("dtype I8"), std::string::npos);
  // nested statistics in groups other than 256 have no squeeze form: refused by name, not misread
  auto other = b;
  other.info.nested_blocksize = 128;
  EXPECT_NE(io_test::error_of([&] { io::to_nf4_packed(other); }).find("nested_blocksize 128"), std::string::npos);
}

TEST(BnbConfig, QuantizationConfigRoundTripAndRefusals) {
  const io::BnbConfig c{.double_quant = true, .compute_dtype = "float16"};
  const auto j = io::bnb_quantization_config_json(c);
  EXPECT_EQ(j.at("quant_method"), "bitsandbytes");
  EXPECT_EQ(j.at("bnb_4bit_quant_type"), "nf4");
  EXPECT_EQ(io::parse_bnb_quantization_config(j), c);
  auto bad = j;
  bad["bnb_4bit_quant_type"] = "fp4";
  io_test::expect_error([&] { io::parse_bnb_quantization_config(bad); }, {"bnb_4bit_quant_type 'fp4'"});
  bad = j;
  bad["load_in_4bit"] = false;
  io_test::expect_error([&] { io::parse_bnb_quantization_config(bad); }, {"load_in_4bit"});
  bad = j;
  bad["quant_method"] = "gptq";
  io_test::expect_error([&] { io::parse_bnb_quantization_config(bad); }, {"quant_method 'gptq'"});
}
