// Strategy composition: defaults, order independence, traits. Rejections are in tests/compile_fail.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include <squeeze/squeeze.hpp>

using namespace squeeze;

// ---- concepts recognise their families -------------------------------------------------------------
static_assert(ShardingPolicy<Sharded<Stage2>> && !ShardingPolicy<Accumulate<2>>);
static_assert(AccumulationPolicy<Accumulate<4>> && !AccumulationPolicy<Sharded<Stage1>>);
static_assert(PrecisionPolicy<Precision<half, float>> && !PrecisionPolicy<Checkpointed>);
static_assert(WeightQuantizationPolicy<Quantized<3, GPTQ, Group<128>, ActOrder>>);
static_assert(!WeightQuantizationPolicy<QuantizedState<8>> && StateQuantizationPolicy<QuantizedState<8>>);
static_assert(LoraPolicy<LoRA<16, 32>> && CheckpointPolicy<CheckpointEvery<4>> && OffloadPolicy<Offload<Host>>);
static_assert(ModePolicy<Inference> && LossScalePolicy<StaticLossScale<12>>);
static_assert(!Policy<int> && !Policy<float>);

// ---- defaults ---------------------------------------------------------------------------------------
using Plain = Strategy<>;
static_assert(Plain::stage == 0 && !Plain::offload_to_host && Plain::accumulation_steps == 1);
static_assert(std::is_same_v<Plain::compute_type, float> && std::is_same_v<Plain::master_type, float>);
static_assert(!Plain::has_master_copy && !Plain::loss_scaling && Plain::training && Plain::base_trainable);
static_assert(Plain::weight_bits == 0 && Plain::state_bits == 32 && !Plain::has_lora && Plain::checkpoint_every == 0);

// ---- order independence -------------------------------------------------------------------------------
using Z3a = Strategy<Sharded<Stage3>, Offload<Host>, Accumulate<4>, Precision<bf16, float>, Checkpointed>;
using Z3b = Strategy<Checkpointed, Precision<bf16, float>, Accumulate<4>, Offload<Host>, Sharded<Stage3>>;
static_assert(same_strategy_v<Z3a, Z3b>);
static_assert(!same_strategy_v<Z3a, Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>>);
static_assert(std::is_same_v<Z3a::canonical, Z3a::canonical::canonical>, "canonical form is a fixed point");

// ---- traits -----------------------------------------------------------------------------------------------
static_assert(Z3a::stage == 3 && Z3a::offload_to_host && Z3a::accumulation_steps == 4 && Z3a::checkpoint_every == 1);
static_assert(std::is_same_v<Z3a::compute_type, bf16> && Z3a::has_master_copy);
// Offload<Host, Streamed>: trained stage-3 units, or a frozen NF4 base (its adapters and their state stay on the device).
using StreamedZ3 = Strategy<Sharded<Stage3>, Offload<Host, Streamed>, Precision<bf16, float>>;
static_assert(StreamedZ3::stream_params && !StreamedZ3::stream_frozen_base && StreamedZ3::offload_to_host);
using StreamedQLoRA = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<16, 32>, Precision<bf16, float>, Offload<Host, Streamed>>;
static_assert(StreamedQLoRA::stream_frozen_base && !StreamedQLoRA::stream_params && !StreamedQLoRA::offload_to_host &&
              StreamedQLoRA::stage == 0);
static_assert(!Z3a::loss_scaling, "bf16 keeps float's exponent range: no loss scaling");
using Fp16 = Strategy<Precision<half, float>>;
static_assert(Fp16::loss_scaling && Fp16::dynamic_loss_scaling, "fp16 compute scales the loss dynamically by default");
using Fp16Static = Strategy<Precision<half, float>, StaticLossScale<10>>;
static_assert(Fp16Static::loss_scaling && !Fp16Static::dynamic_loss_scaling);
using Fp16NoScale = Strategy<Precision<half, float>, NoLossScale>;
static_assert(!Fp16NoScale::loss_scaling, "an explicit NoLossScale turns it off");

using QLoRA = Strategy<Quantized<4, NF4, DoubleQuant>, LoRA<8, 32>, Precision<bf16, float>, Checkpointed>;
static_assert(QLoRA::quantized_weights && QLoRA::weight_bits == 4 && QLoRA::weight_quantization::double_quant);
static_assert(QLoRA::weight_quantization::group == 64, "NF4 blocks default to 64 values");
static_assert(QLoRA::has_lora && QLoRA::lora_rank == 8 && !QLoRA::base_trainable);
static_assert(QLoRA::lora::targets == (LoraTargets::q | LoraTargets::v));

using GPTQ4 = Strategy<Quantized<4, GPTQ, Group<128>>, Inference, Precision<half, half>>;
static_assert(!GPTQ4::training && !GPTQ4::base_trainable && GPTQ4::weight_quantization::group == 128);
static_assert(Quantized<4, GPTQ>::group == 0, "GPTQ defaults to one scale per output channel");
static_assert(Quantized<4, RTN, PerChannel>::group == 0 && QuantizedState<8>::group == 256);
static_assert(Quantized<4, GPTQ, ActOrder, Group<32>>::act_order && Quantized<4, GPTQ, ActOrder, Group<32>>::group == 32);

using Adam8 = Strategy<QuantizedState<8>, Precision<bf16, float>>;
static_assert(Adam8::state_bits == 8 && Adam8::base_trainable && !Adam8::quantized_weights,
              "8-bit optimizer state leaves the weights trainable");
using LoraOnly = Strategy<LoRA<4, 8>>;
static_assert(!LoraOnly::base_trainable && LoraOnly::lora::scaling == 2.0f);

TEST(Policy, StrategyTraitsAreUsableAtRunTime) {
  // The same traits drive run-time code (trainer, planner); read a few through a function template.
  auto describe = []<StrategyType S>(S*) { return std::pair{S::stage * 100 + S::accumulation_steps, S::loss_scaling}; };
  EXPECT_EQ(describe(static_cast<Z3a*>(nullptr)), std::pair(304, false));
  EXPECT_EQ(describe(static_cast<Fp16*>(nullptr)), std::pair(1, true));
  EXPECT_EQ(dtype_name<Z3a::compute_type>(), "bf16");
  EXPECT_EQ(dtype_name<Fp16::compute_type>(), "half");
}

TEST(Policy, ElementConversionsRoundToNearestEven) {
  // half: 1 + 2^-11 is a tie between 1 and 1 + 2^-10 -> even (1); 65520 rounds to inf; bf16 keeps 8 bits.
  EXPECT_EQ(to_float(from_float<half>(1.0f + 0x1p-11f)), 1.0f);
  EXPECT_EQ(to_float(from_float<half>(1.0f + 3 * 0x1p-11f)), 1.0f + 0x1p-9f);
  EXPECT_TRUE(std::isinf(to_float(from_float<half>(65520.0f))));
  EXPECT_EQ(to_float(from_float<half>(65504.0f)), 65504.0f);
  EXPECT_EQ(to_float(from_float<half>(0x1p-24f)), 0x1p-24f);  // smallest subnormal survives
  EXPECT_EQ(to_float(from_float<bf16>(1.0f + 0x1p-8f)), 1.0f);
  EXPECT_EQ(to_float(from_float<bf16>(3.140625f)), 3.140625f);
  EXPECT_TRUE(std::isnan(to_float(from_float<bf16>(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Policy, ErrorsNameWhereAndWhat) {
  try {
    check(false, "micro_batch must be >= 1");
    FAIL() << "check(false) must throw";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("policy_test.cpp"), std::string::npos) << what;
    EXPECT_NE(what.find("micro_batch must be >= 1"), std::string::npos) << what;
  }
}

// ---- strategy_name: every non-default policy, in canonical order; different strategies, different names ----------
#include <squeeze/policy/strategy_name.hpp>

#include <set>
#include <tuple>

namespace {

using NameCases = std::tuple<
    squeeze::Strategy<>, squeeze::Strategy<squeeze::Sharded<squeeze::Stage1>>, squeeze::Strategy<squeeze::Sharded<squeeze::Stage2>>,
    squeeze::Strategy<squeeze::Sharded<squeeze::Stage3>>,
    squeeze::Strategy<squeeze::Sharded<squeeze::Stage3>, squeeze::Offload<squeeze::Host>>, squeeze::Strategy<squeeze::Accumulate<4>>,
    squeeze::Strategy<squeeze::Accumulate<8>>, squeeze::Strategy<squeeze::Precision<squeeze::bf16, float>>,
    squeeze::Strategy<squeeze::Precision<squeeze::bf16, squeeze::bf16>, squeeze::Inference>,
    squeeze::Strategy<squeeze::Sharded<squeeze::Stage3>, squeeze::Offload<squeeze::Host, squeeze::Streamed>>,
    squeeze::Strategy<squeeze::Sharded<squeeze::Stage3>, squeeze::Offload<squeeze::Host, squeeze::Streamed>,
                      squeeze::Precision<squeeze::bf16, squeeze::bf16>>,
    squeeze::Strategy<squeeze::Precision<squeeze::half, float>>,
    squeeze::Strategy<squeeze::Precision<squeeze::half, float>, squeeze::StaticLossScale<10>>,
    squeeze::Strategy<squeeze::Precision<squeeze::half, float>, squeeze::StaticLossScale<12>>,
    squeeze::Strategy<squeeze::Precision<squeeze::half, float>, squeeze::NoLossScale>,
    squeeze::Strategy<squeeze::Precision<squeeze::half, squeeze::half>, squeeze::Inference>,
    squeeze::Strategy<squeeze::Quantized<4, squeeze::NF4>, squeeze::LoRA<8, 16>>,
    squeeze::Strategy<squeeze::Quantized<4, squeeze::NF4, squeeze::DoubleQuant>, squeeze::LoRA<8, 16>>,
    squeeze::Strategy<squeeze::Quantized<4, squeeze::NF4, squeeze::DoubleQuant>, squeeze::LoRA<8, 16, squeeze::all_linears>>,
    squeeze::Strategy<squeeze::Quantized<4, squeeze::NF4, squeeze::DoubleQuant>, squeeze::LoRA<8, 32>>,
    squeeze::Strategy<squeeze::Quantized<4, squeeze::NF4, squeeze::DoubleQuant>, squeeze::LoRA<16, 32>>,
    squeeze::Strategy<squeeze::Quantized<4, squeeze::GPTQ, squeeze::Group<128>>, squeeze::LoRA<8, 16>>,
    squeeze::Strategy<squeeze::Quantized<4, squeeze::GPTQ, squeeze::Group<128>, squeeze::ActOrder>, squeeze::LoRA<8, 16>>,
    squeeze::Strategy<squeeze::Quantized<4, squeeze::GPTQ>, squeeze::LoRA<8, 16>>,
    squeeze::Strategy<squeeze::Quantized<4, squeeze::RTN, squeeze::Group<128>>, squeeze::LoRA<8, 16>>,
    squeeze::Strategy<squeeze::Quantized<3, squeeze::GPTQ, squeeze::Group<128>>, squeeze::LoRA<8, 16>>,
    squeeze::Strategy<squeeze::Quantized<4, squeeze::GPTQ, squeeze::Group<128>>, squeeze::Inference>,
    squeeze::Strategy<squeeze::QuantizedState<8>>, squeeze::Strategy<squeeze::Quantized<8, squeeze::Blockwise8, squeeze::Group<128>>>,
    squeeze::Strategy<squeeze::Checkpointed>, squeeze::Strategy<squeeze::CheckpointEvery<2>>,
    squeeze::Strategy<squeeze::Checkpointed, squeeze::CheckpointOffload<squeeze::Host>>,
    squeeze::Strategy<squeeze::CheckpointEvery<2>, squeeze::CheckpointOffload<squeeze::Host>>,
    squeeze::Strategy<squeeze::Checkpointed, squeeze::CheckpointOffload<squeeze::Host, squeeze::Int8>>,
    squeeze::Strategy<squeeze::Checkpointed, squeeze::CheckpointOffload<squeeze::Device, squeeze::Int8>>,
    squeeze::Strategy<squeeze::Inference>, squeeze::Strategy<squeeze::LoRA<8, 16>>,
    squeeze::Strategy<squeeze::LoRA<8, 16, squeeze::LoraTargets::q | squeeze::LoraTargets::k>>>;

template <std::size_t... I>
void check_names(std::index_sequence<I...>) {
  std::vector<std::string> names = {squeeze::strategy_name<std::tuple_element_t<I, NameCases>>()...};
  std::set<std::string> distinct(names.begin(), names.end());
  EXPECT_EQ(distinct.size(), names.size()) << "two different strategies share a name";
}

}  // namespace

TEST(StrategyName, EveryPairOfDifferentStrategiesHasADifferentName) {
  // The cases are pairwise different strategies (checked at compile time through their canonical forms).
  []<std::size_t... I>(std::index_sequence<I...>) {
    auto distinct_types = []<std::size_t A>() {
      return ((A == I || !std::is_same_v<typename std::tuple_element_t<A, NameCases>::canonical,
                                         typename std::tuple_element_t<I, NameCases>::canonical>)&&...);
    };
    static_assert((distinct_types.template operator()<I>() && ...), "two cases are the same strategy");
  }
  (std::make_index_sequence<std::tuple_size_v<NameCases>>{});
  check_names(std::make_index_sequence<std::tuple_size_v<NameCases>>{});
}

TEST(StrategyName, SpellsEveryPolicyInCanonicalOrder) {
  using namespace squeeze;
  EXPECT_EQ(strategy_name<Strategy<>>(), "Strategy<>");
  EXPECT_EQ((strategy_name<Strategy<Checkpointed, Precision<bf16, float>, Offload<Host>, Sharded<Stage3>>>()),
            "Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, Checkpointed>");
  EXPECT_EQ((strategy_name<Strategy<LoRA<8, 16, all_linears>, Quantized<4, NF4, DoubleQuant>, Accumulate<2>, Precision<bf16, float>>>()),
            "Strategy<Accumulate<2>, Precision<bf16, float>, Quantized<4, NF4, DoubleQuant>, LoRA<8, 16, all_linears>>");
  EXPECT_EQ((strategy_name<Strategy<QuantizedState<8>, Checkpointed, Sharded<Stage3>, Offload<Host>, Precision<bf16, float>>>()),
            "Strategy<Sharded<Stage3>, Offload<Host>, Precision<bf16, float>, QuantizedState<8>, Checkpointed>");
  EXPECT_EQ((strategy_name<Strategy<StaticLossScale<10>, Precision<half, float>>>()),
            "Strategy<Precision<half, float>, StaticLossScale<10>>");
  EXPECT_EQ((strategy_name<Strategy<Precision<half, float>>>()), "Strategy<Precision<half, float>>");  // dynamic: half's default
  EXPECT_EQ((strategy_name<Strategy<Quantized<4, GPTQ, Group<128>, ActOrder>, Inference>>()),
            "Strategy<Quantized<4, GPTQ, Group<128>, ActOrder>, Inference>");
  EXPECT_EQ((strategy_name<Strategy<LoRA<8, 16, LoraTargets::q | LoraTargets::k>>>()),
            "Strategy<LoRA<8, 16, LoraTargets::q | LoraTargets::k>>");
}

// The old spelling of 8-bit optimizer state still means the same state (it warns at compile time).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST(StrategyName, OldSpellingOfEightBitStateIsTheSameState) {
  using Old = squeeze::Strategy<squeeze::Quantized<8, squeeze::Blockwise8>>;
  using New = squeeze::Strategy<squeeze::QuantizedState<8>>;
  static_assert(Old::state_bits == 8 && New::state_bits == 8 && Old::state_quantization::group == New::state_quantization::group);
  static_assert(!Old::quantized_weights && Old::base_trainable);
  EXPECT_EQ(squeeze::strategy_name<Old>(), squeeze::strategy_name<New>());
  EXPECT_EQ(squeeze::strategy_name<New>(), "Strategy<QuantizedState<8>>");
}
#pragma GCC diagnostic pop
