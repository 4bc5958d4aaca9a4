#pragma once
// Shared helpers of the kernels tests: random data, the (P, G) type grid, tolerances per dtype.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "squeeze/dtype.hpp"
#include "squeeze/error.hpp"

namespace squeeze::test {

// Sizes every kernel test covers: single element, not a multiple of any vector width, just under a
// power of two, and > 1 Mi with a ragged tail.
inline const std::vector<std::int64_t> kSizes = {1, 7, 1023, (std::int64_t(1) << 20) + 3};

template <class T>
std::vector<T> random_vec(std::int64_t n, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = from_float<T>(d(rng));
  return v;
}

// Relative rounding unit of a type: |round(x) - x| <= unit * |x| for normal x.
template <class T>
constexpr double unit_roundoff() {
  if constexpr (std::is_same_v<T, float>)
    return 0x1p-24;
  else if constexpr (std::is_same_v<T, half>)
    return 0x1p-11;
  else
    return 0x1p-8;
}

// Calls f.template operator()<P, G>() for every (P, G) in {float, half, bf16}^2.
template <class F>
void for_each_type_pair(F&& f) {
  auto with_p = [&]<class P>() {
    f.template operator()<P, float>();
    f.template operator()<P, half>();
    f.template operator()<P, bf16>();
  };
  with_p.template operator()<float>();
  with_p.template operator()<half>();
  with_p.template operator()<bf16>();
}

template <class F>
void for_each_type(F&& f) {
  f.template operator()<float>();
  f.template operator()<half>();
  f.template operator()<bf16>();
}

template <class T>
bool bits_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Expects `fn` to throw squeeze::Error whose message contains `needle`.
inline void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected squeeze::Error containing \"" << needle << "\", nothing was thrown";
  } catch (const squeeze::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

}  // namespace squeeze::test
