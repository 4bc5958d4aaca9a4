#include <squeeze/squeeze.hpp>
#include <cstdio>
using namespace squeeze;
using Z3 = Strategy<Sharded<Stage3>, Precision<bf16, float>, Checkpointed>;
constexpr auto m = *plan::find_preset("tinyllama-1.1b");
static_assert(plan::plan_memory<Z3>(m, {1, 2048}, 8).model_state().device == 16 * plan::ceil_div(m.params(), 8));
int main() {
  const auto p = plan::plan_memory<Z3>(m, {1, 2048}, 8);
  std::printf("consumer: ZeRO-3 bf16 TinyLlama on 8 ranks: %.3f GB of model state per GPU\n", p.model_state().device / 1e9);
  return p.model_state().device > 0 ? 0 : 1;
}
