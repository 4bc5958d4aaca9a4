#pragma once
// Where fp32 master weights and optimizer state live. Offload<Host> keeps them in host memory and runs the
// CPU AdamW there (DeepSpeed's offload_optimizer: cpu); only what crosses PCIe (the gradient and parameter copies)
// is pinned.
#include <type_traits>

#include "squeeze/policy/family.hpp"

namespace squeeze {

struct Device {};
struct Host {};

template <class Where>
struct Offload {
  static_assert(std::is_same_v<Where, Host> || std::is_same_v<Where, Device>,
                "Offload takes a place: write Offload<Host> (optimizer state in host memory) or leave it out (Offload<Device>)");
  using family = offload_family;
  static constexpr bool to_host = std::is_same_v<Where, Host>;
};

template <class P>
concept OffloadPolicy = PolicyOf<P, offload_family> && requires {
  { P::to_host } -> std::convertible_to<bool>;
};
static_assert(OffloadPolicy<Offload<Host>>);

}  // namespace squeeze
