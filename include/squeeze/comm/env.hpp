#pragma once
// The torchrun environment of this process: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
// Missing variables take single-process defaults; malformed ones are a squeeze::Error naming them.
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "squeeze/error.hpp"

namespace squeeze::comm {

// The torchrun environment of this process.
struct DistEnv {
  int rank = 0, world = 1, local_rank = 0;
  std::string master_addr = "127.0.0.1";
  std::uint16_t master_port = 29500;

  static DistEnv from_environment() {
    auto get_int = [](const char* name, int fallback) {
      const char* v = std::getenv(name);
      if (!v || !*v) return fallback;
      char* end = nullptr;
      const long x = std::strtol(v, &end, 10);
      check(end && *end == '\0' && x >= INT_MIN && x <= INT_MAX,
            std::string("environment variable ") + name + "='" + v + "' is not an integer");
      return int(x);
    };
    DistEnv e;
    e.world = get_int("WORLD_SIZE", 1);
    e.rank = get_int("RANK", 0);
    e.local_rank = get_int("LOCAL_RANK", e.rank);
    if (const char* a = std::getenv("MASTER_ADDR"); a && *a) e.master_addr = a;
    const int port = get_int("MASTER_PORT", 29500);
    check(port >= 0 && port <= 65535, "MASTER_PORT=" + std::to_string(port) + " is not a TCP port");
    e.master_port = std::uint16_t(port);
    check(e.world >= 1, "WORLD_SIZE must be >= 1, got " + std::to_string(e.world));
    check(e.rank >= 0 && e.rank < e.world,
          "RANK=" + std::to_string(e.rank) + " is outside [0, WORLD_SIZE=" + std::to_string(e.world) + ")");
    return e;
  }
};

}  // namespace squeeze::comm
