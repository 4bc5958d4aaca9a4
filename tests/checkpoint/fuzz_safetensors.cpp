// libFuzzer target: any bytes given to the safetensors readers either parse into tensors whose byte ranges lie in
// the file, or raise squeeze::Error; nothing else (no crash, no out-of-bounds read under ASan/UBSan, no other
// exception). Built with clang's -fsanitize=fuzzer (tests/checkpoint/CMakeLists.txt); ctest runs it for a bounded
// time over fuzz_corpus/ (valid seeds and every input that once failed).
#include <unistd.h>

#include <version>
#if !defined(__cpp_lib_source_location)
// Debian's clang 14 has no __builtin_source_location, so libstdc++'s <source_location> declares nothing there. This
// fuzz build (clang only) supplies the part squeeze::Error uses; messages then carry no file and line.
namespace std {
struct source_location {
  static constexpr source_location current() noexcept { return {}; }
  constexpr const char* file_name() const noexcept { return "?"; }
  constexpr unsigned line() const noexcept { return 0; }
};
}  // namespace std
#endif

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <squeeze/io/safetensors.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace io = squeeze::io;
  std::vector<std::byte> bytes(size);
  if (size) std::memcpy(bytes.data(), data, size);
  try {  // the whole-file reader
    const io::SafetensorsFile f = io::SafetensorsFile::parse(bytes, "fuzz");
    for (const auto& [name, info] : f.tensors()) (void)f.bytes(name);
  } catch (const squeeze::Error&) {}
  // the streaming reader, from a file (its header checks are the whole-file reader's; its reads go through pread)
  static const std::string path = "/tmp/squeeze-fuzz-" + std::to_string(::getpid()) + ".safetensors";
  if (std::FILE* out = std::fopen(path.c_str(), "wb")) {
    if (size) std::fwrite(data, 1, size, out);
    std::fclose(out);
    try {
      const io::SafetensorsReader r = io::SafetensorsReader::open(path);
      for (const auto& [name, info] : r.tensors()) (void)r.read_bytes(name);
    } catch (const squeeze::Error&) {}
  }
  return 0;
}
