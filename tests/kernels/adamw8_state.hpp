// Host buffers of one tensor with 8-bit AdamW state, shared by the CPU twin's tests (adamw8_test.cpp) and the
// CUDA launcher's (adamw8_cuda_test.cu).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "squeeze/dtype.hpp"
#include "squeeze/kernels/adamw8.hpp"

namespace squeeze::test {

// Weights w0 as P (and, for 16-bit P, as the fp32 master), fresh (zero) moments, a gradient the test fills.
template <class P, class G>
struct Adam8State {
  std::int64_t n;
  std::vector<P> param;
  std::vector<float> master;  // empty for float P (the parameter is its own master)
  std::vector<G> grad;
  std::vector<std::uint8_t> m, v;
  std::vector<float> m_absmax, v_absmax;  // one per state block
  Adam8State(std::int64_t n_, const std::vector<float>& w0)
      : n(n_),
        param(std::size_t(n_)),
        grad(std::size_t(n_)),
        m(std::size_t(n_)),
        v(std::size_t(n_)),
        m_absmax(std::size_t(kernels::state_blocks(n_))),
        v_absmax(std::size_t(kernels::state_blocks(n_))) {
    for (std::int64_t i = 0; i < n; ++i) param[std::size_t(i)] = from_float<P>(w0[std::size_t(i)]);
    if constexpr (!std::is_same_v<P, float>) master = w0;
  }
  kernels::AdamW8Tensor<P, G> tensor() {
    return {param.data(), master.empty() ? nullptr : master.data(), grad.data(), m.data(), m_absmax.data(), v.data(), v_absmax.data(), n};
  }
  // The fp32 weight AdamW updates: the master, or the float parameter.
  float weight(std::int64_t i) const {
    if constexpr (std::is_same_v<P, float>)
      return param[std::size_t(i)];
    else
      return master[std::size_t(i)];
  }
};

// Every byte of every buffer of `got` equal to `want`'s; the first differences (up to 5 per buffer) are reported
// with their index. nan_matches_nan: a NaN parameter or master matches any NaN (NaN payloads may differ between
// two correct implementations); codes and scales stay bitwise.
template <class T>
bool same_or_both_nan(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(to_float(a)) && std::isnan(to_float(b)));
}
template <class P, class G>
void expect_state_bitwise(const Adam8State<P, G>& got, const Adam8State<P, G>& want, const std::string& label,
                          bool nan_matches_nan = false) {
  auto same = [&](const auto& a, const auto& b, const char* what, bool nan_is_nan) {
    ASSERT_EQ(a.size(), b.size()) << label << " " << what;
    int shown = 0;
    for (std::size_t i = 0; i < a.size() && shown < 5; ++i)
      if (nan_is_nan ? !same_or_both_nan(a[i], b[i]) : std::memcmp(&a[i], &b[i], sizeof(a[i])) != 0) {
        ++shown;
        ADD_FAILURE() << label << " " << what << " differs at " << i << ": " << double(to_float(a[i])) << " vs " << double(to_float(b[i]));
      }
  };
  same(got.param, want.param, "param", nan_matches_nan);
  same(got.master, want.master, "master", nan_matches_nan);
  same(got.m_absmax, want.m_absmax, "m absmax", false);
  same(got.v_absmax, want.v_absmax, "v absmax", false);
  auto codes = [](const std::vector<std::uint8_t>& c) { return std::vector<float>(c.begin(), c.end()); };
  same(codes(got.m), codes(want.m), "m code", false);
  same(codes(got.v), codes(want.v), "v code", false);
}

}  // namespace squeeze::test
