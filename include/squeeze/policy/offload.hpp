#pragma once
// Where fp32 master weights and optimizer state live, and whether the parameters follow them.
//   Offload<Host>            master weights and optimizer state in host memory, the CPU AdamW there (DeepSpeed's
//                            offload_optimizer: cpu); only what crosses PCIe (the gradient and parameter copies) is
//                            pinned. The compute-type parameters stay resident on the device.
//   Offload<Host, Streamed>  the compute-type parameters too: each stage-3 gather unit lives in pinned host memory, is
//                            copied to the GPU ahead of each use and dropped after it; its gradient is copied back as
//                            soon as backward is done with it (docs/architecture.md, "Streamed parameters").
#include <type_traits>

#include "squeeze/policy/family.hpp"

namespace squeeze {

struct Device {};
struct Host {};
// Where the parameters stay under Offload<Host>: resident on the device, or streamed through it from host memory.
struct Resident {};
struct Streamed {};

template <class Where, class What = Resident>
struct Offload {
  static_assert(std::is_same_v<Where, Host> || std::is_same_v<Where, Device>,
                "Offload takes a place: write Offload<Host> (optimizer state in host memory) or leave it out (Offload<Device>)");
  static_assert(std::is_same_v<What, Resident> || std::is_same_v<What, Streamed>,
                "Offload's second argument says where the parameters stay: write Offload<Host> (resident on the device) or "
                "Offload<Host, Streamed> (in host memory, streamed through the device)");
  static_assert(
      !(std::is_same_v<What, Streamed> && std::is_same_v<Where, Device>),
      "Offload<Device, Streamed> keeps everything on the device: write Offload<Host, Streamed> to stream parameters from host memory");
  using family = offload_family;
  static constexpr bool to_host = std::is_same_v<Where, Host>;
  static constexpr bool params_on_host = std::is_same_v<What, Streamed>;
};

template <class P>
concept OffloadPolicy = PolicyOf<P, offload_family> && requires {
  { P::to_host } -> std::convertible_to<bool>;
  { P::params_on_host } -> std::convertible_to<bool>;
};
static_assert(OffloadPolicy<Offload<Host>>);

}  // namespace squeeze
