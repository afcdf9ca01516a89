#include "kernels/base/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace canzona {
namespace {

const char* CublasName(cublasStatus_t code) {
  switch (code) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
      return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
      return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* CusolverName(cusolverStatus_t code) {
  switch (code) {
    case CUSOLVER_STATUS_SUCCESS:
      return "CUSOLVER_STATUS_SUCCESS";
    case CUSOLVER_STATUS_NOT_INITIALIZED:
      return "CUSOLVER_STATUS_NOT_INITIALIZED";
    case CUSOLVER_STATUS_ALLOC_FAILED:
      return "CUSOLVER_STATUS_ALLOC_FAILED";
    case CUSOLVER_STATUS_INVALID_VALUE:
      return "CUSOLVER_STATUS_INVALID_VALUE";
    case CUSOLVER_STATUS_ARCH_MISMATCH:
      return "CUSOLVER_STATUS_ARCH_MISMATCH";
    case CUSOLVER_STATUS_EXECUTION_FAILED:
      return "CUSOLVER_STATUS_EXECUTION_FAILED";
    case CUSOLVER_STATUS_INTERNAL_ERROR:
      return "CUSOLVER_STATUS_INTERNAL_ERROR";
    case CUSOLVER_STATUS_NOT_SUPPORTED:
      return "CUSOLVER_STATUS_NOT_SUPPORTED";
    default:
      return "CUSOLVER_STATUS_OTHER";
  }
}

}  // namespace

absl::Status CudaStatus(cudaError_t code, absl::string_view what) {
  if (code == cudaSuccess) return absl::OkStatus();
  // Clear the sticky last error so a later, unrelated check does not see it.
  (void)cudaGetLastError();
  std::string message = absl::StrCat(what, ": ", cudaGetErrorName(code), " (",
                                     cudaGetErrorString(code), ")");
  switch (code) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorDevicesUnavailable:
      return absl::FailedPreconditionError(
          absl::StrCat("no usable CUDA device: ", message));
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status CublasStatus(cublasStatus_t code, absl::string_view what) {
  if (code == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": ", CublasName(code));
  switch (code) {
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return absl::FailedPreconditionError(message);
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(message);
    case CUBLAS_STATUS_INVALID_VALUE:
      return absl::InvalidArgumentError(message);
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::UnimplementedError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status CusolverStatus(cusolverStatus_t code, absl::string_view what) {
  if (code == CUSOLVER_STATUS_SUCCESS) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": ", CusolverName(code));
  switch (code) {
    case CUSOLVER_STATUS_NOT_INITIALIZED:
      return absl::FailedPreconditionError(message);
    case CUSOLVER_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(message);
    case CUSOLVER_STATUS_INVALID_VALUE:
      return absl::InvalidArgumentError(message);
    case CUSOLVER_STATUS_ARCH_MISMATCH:
    case CUSOLVER_STATUS_NOT_SUPPORTED:
      return absl::UnimplementedError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::Status NcclStatus(ncclResult_t code, absl::string_view what) {
  if (code == ncclSuccess) return absl::OkStatus();
  std::string message = absl::StrCat(what, ": ", ncclGetErrorString(code), " (",
                                     static_cast<int>(code), ")");
  switch (code) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(message);
    case ncclRemoteError:
      return absl::UnavailableError(message);
    case ncclInProgress:
      return absl::UnavailableError(message);
    case ncclSystemError:
    case ncclUnhandledCudaError:
    case ncclInternalError:
    default:
      return absl::InternalError(message);
  }
}

absl::Status NcclCommStatus(ncclResult_t code, absl::string_view what,
                            ncclComm_t comm) {
  absl::Status status = NcclStatus(code, what);
  if (status.ok()) return status;
  const char* detail = ncclGetLastError(comm);
  if (detail == nullptr || *detail == '\0') return status;
  return absl::Status(status.code(),
                      absl::StrCat(status.message(), ": ", detail));
}

}  // namespace canzona
