// v1 zero points: GPTQModel's whole-word "minus 0x11111111" and the per-field reading.
#include <gtest/gtest.h>

#include <random>

#include <squeeze/io/gptq_file.hpp>
#include <squeeze/quant/v1_zeros.hpp>

#include "io_test_util.hpp"

namespace q = squeeze::quant;

namespace {
std::vector<std::uint8_t> random_zeros(std::int64_t n, int bits, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(0, (1 << bits) - 1);
  std::vector<std::uint8_t> z(static_cast<std::size_t>(n));
  for (auto& v : z) v = std::uint8_t(d(rng));
  z[0] = 0;                                  // the borrowing case
  z[n - 1] = std::uint8_t((1 << bits) - 1);  // the largest
  return z;
}
}  // namespace

TEST(V1Zeros, WordConstantsAreGptqModels) {
  EXPECT_EQ(q::v1_word_constant(0, 32, 2), 0x55555555u);
  EXPECT_EQ(q::v1_word_constant(0, 32, 4), 0x11111111u);
  EXPECT_EQ(q::v1_word_constant(3, 32, 8), 0x01010101u);
  // 3 bits: the lowest bit of fields 0..10, 11..21 (10 starts at bit 30, 21 at bit 63), 22..31
  EXPECT_EQ(q::v1_word_constant(0, 32, 3), 0x49249249u);
  EXPECT_EQ(q::v1_word_constant(1, 32, 3), 0x92492492u);
  EXPECT_EQ(q::v1_word_constant(2, 32, 3), 0x24924924u);
  EXPECT_EQ(q::v1_word_constant(0, 3, 4), 0x111u);  // padding fields get no constant
}

TEST(V1Zeros, RoundTripEveryWidthOddShapes) {
  for (int bits : {2, 3, 4, 8})
    for (std::int64_t out : {1, 7, 11, 32, 45, 96, 100})
      for (auto how : {q::ZeroArithmetic::word, q::ZeroArithmetic::field}) {
        const std::int64_t groups = 3;
        const auto z = random_zeros(groups * out, bits, std::uint32_t(bits * 1000 + out));
        const auto words = q::encode_v1_qzeros(z, groups, out, bits, how);
        ASSERT_EQ(std::int64_t(words.size()), groups * q::packed_words(out, bits));
        EXPECT_EQ(q::decode_v1_qzeros(words, groups, out, bits, how), z) << "bits " << bits << " out " << out;
      }
}

TEST(V1Zeros, WordAndFieldAgreeWithoutZeroPointZeroAndAlwaysAtThreeBits) {
  for (int bits : {2, 3, 4, 8}) {
    auto z = random_zeros(2 * 64, bits, 7u + bits);
    for (auto& v : z) v = v == 0 ? 1 : v;
    EXPECT_EQ(q::encode_v1_qzeros(z, 2, 64, bits, q::ZeroArithmetic::word), q::encode_v1_qzeros(z, 2, 64, bits, q::ZeroArithmetic::field));
  }
  const auto z3 = random_zeros(2 * 45, 3, 11u);  // zero points of 0 included
  EXPECT_EQ(q::encode_v1_qzeros(z3, 2, 45, 3, q::ZeroArithmetic::word), q::encode_v1_qzeros(z3, 2, 45, 3, q::ZeroArithmetic::field));
}

// Regression: reading GPTQModel's word-wise v1 per field (+1 each) gets the field above a zero point of 0 wrong.
TEST(V1Zeros, PerFieldReadingMisreadsTheBorrow) {
  const std::vector<std::uint8_t> z = {0, 5, 9, 15, 1, 2, 3, 4};  // one 4-bit word
  const auto words = q::encode_v1_qzeros(z, 1, 8, 4, q::ZeroArithmetic::word);
  EXPECT_EQ(std::uint32_t(words[0]), 0x4321F950u - 0x11111111u);  // 0x3210E83F: field 0 is F, field 1 is 3
  EXPECT_EQ(q::decode_v1_qzeros(words, 1, 8, 4), z);
  const auto per_field = q::decode_v1_qzeros(words, 1, 8, 4, q::ZeroArithmetic::field);
  EXPECT_EQ(per_field[0], 0);
  EXPECT_EQ(per_field[1], 4);  // the borrow: 5 - 1 - 1 stored, +1 reads 4
  EXPECT_NE(per_field, z);
  // PackedLinear's per-field form of the same file reads right after conversion.
  const auto packed = q::qzeros_to_packed(words, 1, 8, 4, q::ZeroArithmetic::word);
  EXPECT_EQ(q::decode_v1_qzeros(packed, 1, 8, 4, q::ZeroArithmetic::field), z);
}

TEST(V1Zeros, BadShapesAndValuesNameTheProblem) {
  io_test::expect_error([] { q::decode_v1_qzeros(std::vector<std::int32_t>(3), 2, 8, 4); }, {"qzeros", "expected 2"});
  io_test::expect_error([] { q::encode_v1_qzeros(std::vector<std::uint8_t>(8, 16), 1, 8, 4); }, {"zero point 16", "4 bits"});
  io_test::expect_error([] { q::encode_v1_qzeros(std::vector<std::uint8_t>(8), 1, 8, 5); }, {"5"});
}

// 3 bits: GPTQModel shifts each field on its own (fields 10 and 21 straddle two words), so a zero point of 0 is
// stored as 7 in its own field and its neighbours keep theirs; the symmetric zero 4 is 3 in every field.
TEST(V1Zeros, ThreeBitsShiftEachFieldAsGptqModelDoes) {
  std::vector<std::uint8_t> z(32, 4);
  const auto sym = q::encode_v1_qzeros(z, 1, 32, 3);
  for (std::int64_t j = 0; j < 32; ++j) EXPECT_EQ(q::stream_get(sym.data(), 1, j, 3), 3u) << "field " << j;
  z[0] = z[10] = z[21] = 0;  // the first field and both straddling ones
  const auto words = q::encode_v1_qzeros(z, 1, 32, 3);
  EXPECT_EQ(words, q::encode_v1_qzeros(z, 1, 32, 3, q::ZeroArithmetic::field));
  for (std::int64_t j = 0; j < 32; ++j) EXPECT_EQ(q::stream_get(words.data(), 1, j, 3), z[std::size_t(j)] == 0 ? 7u : 3u) << "field " << j;
  EXPECT_EQ(q::decode_v1_qzeros(words, 1, 32, 3), z);
}

// squeeze's own quantized file (io/gptq_file.hpp) stores and reads zero points the same word-wise way.
TEST(V1Zeros, GptqFileKeepsZeroPointZero) {
  io_test::TempDir dir("v1_gptq_file");
  const std::int64_t out = 24, in = 40;
  std::mt19937 rng(5);
  std::vector<std::uint8_t> codes(out * in);
  for (auto& c : codes) c = std::uint8_t(rng() & 15u);
  auto zeros = random_zeros(2 * out, 4, 9);
  const std::vector<float> scales(2 * out, 0.01f);
  const auto p = q::pack(codes, zeros, scales, q::default_g_idx(in, 32), out, in, 4, 32);
  squeeze::io::QuantizeConfig cfg;
  cfg.group_size = 32;
  squeeze::io::save_quantized(dir.path, {{"layer", p}}, cfg);
  const auto ck = squeeze::io::load_quantized(dir.path);
  EXPECT_EQ(ck.file.read<std::int32_t>("layer.qzeros", squeeze::io::DType::I32), q::encode_v1_qzeros(zeros, 2, out, 4));
  EXPECT_EQ(q::unpack_zeros(ck.layers.at("layer")), zeros);
  EXPECT_EQ(q::dequantize(ck.layers.at("layer")), q::dequantize(p));
}
