// Bridges from CUDA runtime, cuBLAS, cuSOLVER and NCCL return codes to
// absl::Status, so GPU code reports failures the same way as the rest of
// Canzona. Usage:
//
//   CANZONA_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, bytes), "cudaMalloc"));
//   CANZONA_CUDA_RETURN_IF_ERROR(cublasSgemm(handle, ...));
//
// Every CUDA runtime failure also clears the thread's sticky "last error" so
// an unrelated later call does not report it again (as NCCL's CUDACHECK does).
// Only compiled when CANZONA_ENABLE_CUDA is set.
//
// Thread-safety: stateless functions; safe from any thread.
#ifndef CANZONA_KERNELS_BASE_CUDA_STATUS_H_
#define CANZONA_KERNELS_BASE_CUDA_STATUS_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace canzona {

// `what` names the call (e.g. "cudaMalloc") and prefixes the message.
absl::Status CudaStatus(cudaError_t code, absl::string_view what);
absl::Status CublasStatus(cublasStatus_t code, absl::string_view what);
absl::Status CusolverStatus(cusolverStatus_t code, absl::string_view what);
absl::Status NcclStatus(ncclResult_t code, absl::string_view what);
// NcclStatus plus NCCL's detail for `comm` (ncclGetLastError), e.g. which
// peer or transport failed; `comm` may be null.
absl::Status NcclCommStatus(ncclResult_t code, absl::string_view what,
                            ncclComm_t comm);

// Overloads so one macro serves every library.
inline absl::Status ToStatus(cudaError_t c, absl::string_view w) {
  return CudaStatus(c, w);
}
inline absl::Status ToStatus(cublasStatus_t c, absl::string_view w) {
  return CublasStatus(c, w);
}
inline absl::Status ToStatus(cusolverStatus_t c, absl::string_view w) {
  return CusolverStatus(c, w);
}
inline absl::Status ToStatus(ncclResult_t c, absl::string_view w) {
  return NcclStatus(c, w);
}

}  // namespace canzona

// Returns from the enclosing function with a Status when a CUDA-family call
// fails; the message carries the call's text and source location.
#define CANZONA_CUDA_RETURN_IF_ERROR(call)                                    \
  do {                                                                        \
    ::absl::Status canzona_cuda_status_ = ::canzona::ToStatus(                \
        (call), #call " at " __FILE__ ":" CANZONA_CUDA_STRINGIFY_(__LINE__)); \
    if (!canzona_cuda_status_.ok()) return canzona_cuda_status_;              \
  } while (false)
#define CANZONA_CUDA_STRINGIFY_INNER_(x) #x
#define CANZONA_CUDA_STRINGIFY_(x) CANZONA_CUDA_STRINGIFY_INNER_(x)

#endif  // CANZONA_KERNELS_BASE_CUDA_STATUS_H_
