#pragma once
// Helpers of the io tests: a scratch directory removed afterwards, and "throws squeeze::Error naming X".
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <initializer_list>
#include <string>

#include <squeeze/error.hpp>
#include <squeeze/io/posix_file.hpp>

namespace io_test {

struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& name)
      : path(std::filesystem::temp_directory_path() / ("squeeze_io_" + name + "_" + std::to_string(::getpid()))) {
    squeeze::io::remove_tree(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { squeeze::io::try_remove_tree(path); }
};

// The message of the E `f` throws ("" if it throws nothing, a failure if it throws anything else). E: squeeze::Error
// for the torch-free layers, c10::Error for the torch layer.
template <class E = squeeze::Error>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw another exception type: " << e.what();
    return e.what();
  }
  return "";
}

// `f` throws an E whose message contains every needle.
template <class E = squeeze::Error>
void expect_error(const std::function<void()>& f, std::initializer_list<std::string> needles) {
  const std::string msg = error_of<E>(f);
  if (msg.empty()) {
    ADD_FAILURE() << "no error thrown; expected one naming '" << *needles.begin() << "'";
    return;
  }
  for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "'" << n << "' not in: " << msg;
}

}  // namespace io_test
