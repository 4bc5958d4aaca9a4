#pragma once
// The library's one exception type and the check helpers that name the failing call, file and line.
// Layers 1-4 throw squeeze::Error; the torch layer converts it to TORCH_CHECK failures at its boundary.
#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>

namespace squeeze {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, std::source_location where = std::source_location::current())
      : std::runtime_error(std::string(where.file_name()) + ":" + std::to_string(where.line()) + ": " + what) {}
};

// Throws squeeze::Error with `what` when `ok` is false. `what` should say what was wrong and what to do.
inline void check(bool ok, std::string_view what, std::source_location where = std::source_location::current()) {
  if (!ok) throw Error(std::string(what), where);
}

}  // namespace squeeze

// Checks on CUDA-family status codes. Each names the call text, its error string, file and line.
// They are macros so the failing expression is spelled in the message.
#define SQUEEZE_CHECK(cond, msg) ::squeeze::check(static_cast<bool>(cond), (msg))

#if __has_include(<cuda_runtime_api.h>)
#include <cuda_runtime_api.h>
#define SQUEEZE_CUDA_CHECK(call)                                                                                        \
  do {                                                                                                                  \
    const cudaError_t squeeze_status_ = (call);                                                                         \
    if (squeeze_status_ != cudaSuccess)                                                                                 \
      throw ::squeeze::Error(std::string("CUDA call `" #call "` failed: ") + cudaGetErrorName(squeeze_status_) + " (" + \
                             cudaGetErrorString(squeeze_status_) + ")");                                                \
  } while (0)
#endif

#if __has_include(<cublas_v2.h>) && __has_include(<cuda_runtime_api.h>)
#include <cublas_v2.h>
#define SQUEEZE_CUBLAS_CHECK(call)                                                                                           \
  do {                                                                                                                       \
    const cublasStatus_t squeeze_status_ = (call);                                                                           \
    if (squeeze_status_ != CUBLAS_STATUS_SUCCESS)                                                                            \
      throw ::squeeze::Error(std::string("cuBLAS call `" #call "` failed: ") + cublasGetStatusName(squeeze_status_) + " (" + \
                             cublasGetStatusString(squeeze_status_) + ")");                                                  \
  } while (0)
#endif

#if __has_include(<nccl.h>) && __has_include(<cuda_runtime.h>)
#include <nccl.h>
#define SQUEEZE_NCCL_CHECK(call)                                                                                   \
  do {                                                                                                             \
    const ncclResult_t squeeze_status_ = (call);                                                                   \
    if (squeeze_status_ != ncclSuccess && squeeze_status_ != ncclInProgress)                                       \
      throw ::squeeze::Error(std::string("NCCL call `" #call "` failed: ") + ncclGetErrorString(squeeze_status_)); \
  } while (0)
#endif
