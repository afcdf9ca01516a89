// Whether host memory is pageable to the CUDA driver: a copy between it
// and the device goes through the driver's bounce buffer, and
// cudaMemcpyAsync waits for the stream inside the call, without a bound
// (kernels/pageable_copies.h). Shared by the cuda backend, the CUDA IPC
// copies and the NCCL plane's runtime seam (server/comm/nccl_api.h), which
// each count such copies. Only compiled when CANZONA_ENABLE_CUDA is set.
//
// Thread-safety: stateless; safe from any thread.
#ifndef CANZONA_KERNELS_BASE_CUDA_HOST_MEMORY_H_
#define CANZONA_KERNELS_BASE_CUDA_HOST_MEMORY_H_

namespace canzona {

// True when the driver reports `p` as unregistered host memory (neither
// page-locked nor mapped nor device memory); false when the driver cannot
// tell (the copy then reports its own error).
bool CudaHostPageable(const void* p);

}  // namespace canzona

#endif  // CANZONA_KERNELS_BASE_CUDA_HOST_MEMORY_H_
