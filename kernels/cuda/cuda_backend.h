// The cuda numeric backend: cuBLAS (GEMM, SYRK, strided-batched GEMM),
// cuSOLVER (syevd, geqrf/orgqr) and Canzona's own kernels for the fused
// elementwise parts and the bf16 Newton-Schulz. Device memory is the
// backend's memory space; all work is issued on the backend's own stream.
//
// In a build without CUDA, or on a machine without a usable device,
// CreateCudaBackend returns FAILED_PRECONDITION ("no usable CUDA device...")
// and callers fall back to the cpu backend.
//
// Thread-safety: as Backend (one owner thread per device).
#ifndef CANZONA_KERNELS_CUDA_CUDA_BACKEND_H_
#define CANZONA_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace canzona {

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device);

// Number of usable CUDA devices (0 without CUDA or a driver).
int CudaDeviceCount();

}  // namespace canzona

#endif  // CANZONA_KERNELS_CUDA_CUDA_BACKEND_H_
