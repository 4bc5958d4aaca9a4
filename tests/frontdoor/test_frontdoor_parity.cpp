// A user's model under each stage x {float, bf16} x accumulation {1, 4} at worlds 1-4 (LocalComm threads) against
// unsharded training of the same precision on the whole batch. Tolerances: float 1e-5 absolute + 1e-4 relative
// (the ranks' gradients are summed in another order); bf16 5% relative Frobenius error per tensor and no element
// more than 3 lr x steps apart (expect_close_16bit: rounding that depends on the batch split, amplified by Adam).
#include "frontdoor_model.hpp"

namespace frontdoor {
namespace {

using sq::Accumulate;
using sq::bf16;
using sq::Precision;
using sq::Sharded;

constexpr int kRows = 12;  // rows per micro-step over all ranks: divides by 1, 2, 3, 4
constexpr int kWindows = 3;

template <class S>
Params train_user_model(int world, std::vector<float>* losses = nullptr) {
  constexpr int A = S::accumulation_steps;
  torch::manual_seed(1);
  const auto data = torch::randint(37, {kWindows * A, kRows, 9});  // [micro-steps, rows, T + 1]
  Params out;
  // Built before the rank threads start: the CPU generator is process-wide, so threads drawing from it at once
  // would interleave their draws.
  std::vector<UserLM> models;
  for (int r = 0; r < world; ++r) torch::manual_seed(0), models.emplace_back();
  sq::comm::run_ranks(world, [&](std::shared_ptr<sq::comm::LocalComm> comm) {
    UserLM& model = models[std::size_t(comm->rank())];
    auto trainer = sq::make_trainer<S>(model, sq::AdamW{.lr = 1e-2f, .weight_decay = 0.1f}, comm, {.replicate = {"norm"}});
    const int r = comm->rank(), per = kRows / world;
    for (int s = 0; s < kWindows * A; ++s) {
      const auto rows = data[s].narrow(0, r * per, per);
      auto res = trainer.step([&] { return lm_loss(model, rows); });
      if (r == 0 && losses) losses->push_back(res.loss);
    }
    auto full = to_params(trainer.full_parameters());
    if (r == 0) out = full;
  });
  return out;
}

template <class S>
struct Parity : ::testing::Test {};

template <int Stage, class C, int A>
using StrategyOf = sq::Strategy<Sharded<sq::Stage<Stage>>, Precision<C, float>, Accumulate<A>>;

using Strategies = ::testing::Types<StrategyOf<0, float, 1>, StrategyOf<0, float, 4>, StrategyOf<0, bf16, 1>, StrategyOf<0, bf16, 4>,
                                    StrategyOf<1, float, 1>, StrategyOf<1, float, 4>, StrategyOf<1, bf16, 1>, StrategyOf<1, bf16, 4>,
                                    StrategyOf<2, float, 1>, StrategyOf<2, float, 4>, StrategyOf<2, bf16, 1>, StrategyOf<2, bf16, 4>,
                                    StrategyOf<3, float, 1>, StrategyOf<3, float, 4>, StrategyOf<3, bf16, 1>, StrategyOf<3, bf16, 4>,
                                    // host offload: stage 1 frees its gradient buffers between windows as stage 0 does
                                    sq::Strategy<Sharded<sq::Stage1>, sq::Offload<sq::Host>, Precision<bf16, float>, Accumulate<4>>,
                                    sq::Strategy<Sharded<sq::Stage3>, sq::Offload<sq::Host>, Precision<float, float>>>;
TYPED_TEST_SUITE(Parity, Strategies);

TYPED_TEST(Parity, UserModelAtWorlds1To4MatchesUnshardedTraining) {
  using S = TypeParam;
  using Reference = sq::Strategy<Precision<typename S::compute_type, float>, Accumulate<S::accumulation_steps>>;
  constexpr bool is_float = std::is_same_v<typename S::compute_type, float>;
  std::vector<float> ref_losses;
  const Params ref = train_user_model<Reference>(1, &ref_losses);
  for (int world = 1; world <= 4; ++world) {
    std::vector<float> losses;
    const Params got = train_user_model<S>(world, &losses);
    const std::string what = "world " + std::to_string(world);
    if (is_float)
      expect_close(got, ref, 1e-5, 1e-4, what);
    else
      expect_close_16bit(got, ref, 5e-2, 3 * 1e-2 * kWindows, what);
    // rank 0's first micro-batch loss is its rows' loss: equal to the reference's only at world 1
    if (world == 1) EXPECT_NEAR(losses.front(), ref_losses.front(), 1e-6);
  }
}

}  // namespace
}  // namespace frontdoor
