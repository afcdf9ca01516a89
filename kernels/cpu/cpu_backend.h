// The cpu numeric backend: OpenBLAS (sgemm, ssyrk) and LAPACKE (ssyevd,
// dsyevd, sgeqrf/sorgqr) with plain loops for the elementwise kernels.
// Host memory is the backend's memory space.
//
// Thread-safety: as Backend (one owner thread); OpenBLAS's own threads are
// used inside each call.
#ifndef CANZONA_KERNELS_CPU_CPU_BACKEND_H_
#define CANZONA_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace canzona {

// `space` kDevice makes the backend stand in for a GPU in tests without
// one: the same kernels on host memory, with device memory's range rules
// (MemorySpace): every kernel argument inside its allocations or memory
// registered with it, every host argument of a copy outside them.
// `page_aligned`: every allocation starts on a page and its padding fills
// its last page (host staging beside a GPU): page-locking it
// (cudaHostRegister works in whole pages) never reaches a page another
// allocation, maybe another rank's, has already locked.
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(
    MemorySpace space = MemorySpace::kHost, bool page_aligned = false);

// Tests: while set, the work of every cpu backend standing in for a GPU
// (MemorySpace::kDevice) "never finishes", as a GPU stream's that waits
// for an event no one records (a dead or hung trainer's): its host waits
// last their timeout (Backend::set_wait_timeout). One without a timeout
// would hang on a GPU; here it fails with INTERNAL after 20 s, so a test
// shows the unbounded wait instead of hanging.
// Process-wide; thread-safe.
void SetDeviceLikeWorkBlocked(bool blocked);

// Threads OpenBLAS uses inside each call, process-wide. A daemon runs one
// device worker per local rank, each calling BLAS concurrently: one thread
// per worker avoids oversubscribing the cores (OpenBLAS threads spin).
void SetCpuBlasThreads(int threads);

}  // namespace canzona

#endif  // CANZONA_KERNELS_CPU_CPU_BACKEND_H_
