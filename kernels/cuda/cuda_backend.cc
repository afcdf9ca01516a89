#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "kernels/base/cuda_host_memory.h"
#include "kernels/base/cuda_status.h"
#include "kernels/base/status_macros.h"
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/cuda_kernels.h"

namespace canzona {
namespace cuda_internal {

absl::Status CudaBackend::Activate() {
  int current = -1;
  CANZONA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
  if (current != device_) CANZONA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  return absl::OkStatus();
}

absl::Status CudaBackend::Init() {
  CANZONA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaDeviceProp prop;
  CANZONA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_));
  num_sms_ = prop.multiProcessorCount > 0 ? prop.multiProcessorCount : 1;
  description_ = absl::StrCat("cuda:", device_, " (", prop.name, ", sm_",
                              prop.major, prop.minor, ")");

  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CANZONA_CUDA_RETURN_IF_ERROR(cublasCreate(&cublas_));
  CANZONA_CUDA_RETURN_IF_ERROR(cublasSetStream(cublas_, stream_));
  // CUBLAS_DEFAULT_MATH never lowers float32 GEMMs to TF32 (TF32 has fewer
  // mantissa bits than requested), keeping fp32 results within 1e-4 of the
  // cpu backend. bf16 GemmEx calls still use tensor cores, and may reduce
  // split-K partial sums in bf16, as torch's default allows (no
  // CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION; not measured apart).
  CANZONA_CUDA_RETURN_IF_ERROR(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
  CANZONA_CUDA_RETURN_IF_ERROR(cusolverDnCreate(&cusolver_));
  CANZONA_CUDA_RETURN_IF_ERROR(cusolverDnSetStream(cusolver_, stream_));

  int pools_supported = 0;
  CANZONA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
      &pools_supported, cudaDevAttrMemoryPoolsSupported, device_));
  if (pools_supported != 0) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device_;
    CANZONA_CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&pool_, &props));
    // Keep freed memory in the pool across synchronizations: the optimizer
    // frees and reallocates same-sized temporaries every step.
    uint64_t threshold = std::numeric_limits<uint64_t>::max();
    CANZONA_CUDA_RETURN_IF_ERROR(cudaMemPoolSetAttribute(
        pool_, cudaMemPoolAttrReleaseThreshold, &threshold));
    // Peer access (cudaDeviceEnablePeerAccess) does not cover pool
    // memory: a pool's allocations are reachable from another GPU only if
    // the pool grants it. NCCL may read and write staging of several local
    // ranks (one per GPU) through direct pointers within the process, so
    // every peer that can reach this GPU gets read-write access. A peer the
    // driver refuses (some PCIe or virtualized topologies) is left out, not
    // fatal: NCCL's transports move data through buffers of their own; the
    // description names the peers granted and refused.
    int devices = 0;
    CANZONA_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&devices));
    std::vector<std::string> peers, refused;
    for (int peer = 0; peer < devices; ++peer) {
      if (peer == device_) continue;
      int can = 0;
      CANZONA_CUDA_RETURN_IF_ERROR(
          cudaDeviceCanAccessPeer(&can, peer, device_));
      if (can == 0) continue;
      cudaMemAccessDesc access = {};
      access.location.type = cudaMemLocationTypeDevice;
      access.location.id = peer;
      access.flags = cudaMemAccessFlagsProtReadWrite;
      if (cudaMemPoolSetAccess(pool_, &access, 1) == cudaSuccess) {
        peers.push_back(absl::StrCat(peer));
      } else {
        (void)cudaGetLastError();
        refused.push_back(absl::StrCat(peer));
      }
    }
    if (!peers.empty() || !refused.empty()) {
      absl::StrAppend(&description_, ", pool peers [",
                      absl::StrJoin(peers, ","), "]");
      if (!refused.empty()) {
        absl::StrAppend(&description_, " refused [",
                        absl::StrJoin(refused, ","), "]");
      }
    }
  }
  // cuBLAS gets its workspace up front (32 MiB, what it asks for on
  // Hopper): without one it may allocate on first use, which is illegal
  // inside a graph capture.
  constexpr size_t kCublasWorkspace = size_t{32} << 20;
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMalloc(&cublas_workspace_, kCublasWorkspace));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cublasSetWorkspace(cublas_, cublas_workspace_, kCublasWorkspace));
  const char* graphs = std::getenv("CANZONA_CUDA_GRAPHS");
  ns_graphs_enabled_ = graphs == nullptr || std::string(graphs) != "0";
  const char* symmetric = std::getenv("CANZONA_NS_SYMMETRIC");
  ns_symmetric_enabled_ = symmetric == nullptr || std::string(symmetric) != "0";
  void* pinned = nullptr;
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaHostAlloc(&pinned, sizeof(PinnedScratch), cudaHostAllocDefault));
  pinned_ = new (pinned) PinnedScratch();
  // The queued sums' workspace has one size: taken here, not by a step's
  // first EnqueueSumSquares.
  CANZONA_RETURN_IF_ERROR(
      Reserve(queued_ws_, (cuda_kernels::kMaxReductionBlocks + kQueuedSums) *
                              sizeof(double))
          .status());
  return Reserve(many_ws_, static_cast<size_t>(cuda_kernels::kAdamWManyMax) *
                               cuda_kernels::kMaxReductionBlocks *
                               sizeof(double))
      .status();
}

// How long a backend's destruction waits for its stream before it leaves
// its memory to the process (Backend::stalled).
constexpr absl::Duration kTeardownWait = absl::Seconds(10);

CudaBackend::~CudaBackend() {
  // Best effort: a destructor cannot report, and the process may be going
  // down with a broken context already.
  if (cudaSetDevice(device_) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (stream_ != nullptr) {
    // A stream that does not finish within kTeardownWait (or, stalled, at
    // once) may wait for good: every call below that frees memory may
    // synchronize with it and hang the daemon. Its memory, handles and
    // stream are left to the process instead.
    set_wait_timeout(kTeardownWait);
    if (!AwaitStream("teardown").ok()) {
      (void)cudaGetLastError();
      return;
    }
  }
  DropNsGraphs();
  for (Workspace* ws :
       {&ns_ws_, &solver_ws_, &scratch_ws_, &queued_ws_, &many_ws_}) {
    if (ws->data != nullptr) DeviceRelease(ws->data);
    ws->data = nullptr;
  }
  if (stream_ != nullptr) (void)cudaStreamSynchronize(stream_);
  if (pool_ != nullptr) (void)cudaMemPoolDestroy(pool_);
  if (pinned_ != nullptr) (void)cudaFreeHost(pinned_);
  if (pinned_segments_ != nullptr) (void)cudaFreeHost(pinned_segments_);
  for (void* table : retired_segments_) (void)cudaFreeHost(table);
  for (cudaEvent_t e : marks_) {
    if (e != nullptr) (void)cudaEventDestroy(e);
  }
  if (cusolver_ != nullptr) (void)cusolverDnDestroy(cusolver_);
  if (cublas_ != nullptr) (void)cublasDestroy(cublas_);
  if (cublas_workspace_ != nullptr) (void)cudaFree(cublas_workspace_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  (void)cudaGetLastError();
}

absl::StatusOr<void*> CudaBackend::DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  if (pool_ != nullptr) {
    CANZONA_CUDA_RETURN_IF_ERROR(
        cudaMallocFromPoolAsync(&p, bytes, pool_, stream_));
  } else {
    CANZONA_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes));
  }
  backend_internal::CountAllocation();
  return p;
}

void CudaBackend::DeviceRelease(void* p) {
  if (p == nullptr) return;
  if (pool_ != nullptr) {
    if (cudaFreeAsync(p, stream_) != cudaSuccess) (void)cudaGetLastError();
    return;
  }
  // Plain cudaFree must not race queued kernels still using p; on a
  // stream that may wait for good (stalled) the memory is left instead.
  if (stalled()) return;
  (void)cudaStreamSynchronize(stream_);
  if (cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
}

absl::StatusOr<void*> CudaBackend::Reserve(Workspace& ws, size_t bytes) {
  if (bytes <= ws.bytes && ws.data != nullptr) return ws.data;
  // Round up (2 MiB granules, at least 2 MiB) rather than grow
  // geometrically: the Newton-Schulz workspace can be gigabytes, and the
  // set of shapes an optimizer uses is fixed, so it settles after the first
  // step anyway.
  constexpr size_t kGranule = size_t{2} << 20;
  const size_t want = (bytes + kGranule - 1) / kGranule * kGranule +
                      (bytes == 0 ? kGranule : 0);
  DeviceRelease(ws.data);
  ws.data = nullptr;
  ws.bytes = 0;
  CANZONA_ASSIGN_OR_RETURN(ws.data, DeviceAlloc(want));
  ws.bytes = want;
  return ws.data;
}

absl::Status CudaBackend::CopyHostToDevice(const void* host, size_t bytes,
                                           void* dst) {
  CANZONA_ASSIGN_OR_RETURN(const bool pageable,
                           BeforeHostCopy("CopyFromHost", host, bytes));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_));
  if (!pageable) CANZONA_RETURN_IF_ERROR(AwaitStream("CopyFromHost"));
  return absl::OkStatus();
}

absl::StatusOr<bool> CudaBackend::BeforeHostCopy(absl::string_view method,
                                                 const void* host,
                                                 size_t bytes) {
  if (!CudaHostPageable(host)) return false;
  NotePageableCopy(method, host, static_cast<int64_t>(bytes));
  CANZONA_RETURN_IF_ERROR(AwaitStream(method));
  return true;
}

absl::Status CudaBackend::FetchToPinned(const void* src, size_t bytes,
                                        void* pinned_dst,
                                        absl::string_view method) {
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(pinned_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  return AwaitStream(method);
}

absl::Status CudaBackend::AwaitStream(absl::string_view method) {
  const std::string what = absl::StrCat(description_, " ", method);
  return AwaitWork(
      what,
      [&]() -> absl::StatusOr<bool> {
        const cudaError_t code = cudaStreamQuery(stream_);
        if (code == cudaErrorNotReady) {
          (void)cudaGetLastError();
          return false;
        }
        CANZONA_CUDA_RETURN_IF_ERROR(code);
        return true;
      },
      [&]() -> absl::Status {
        CANZONA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
        return absl::OkStatus();
      },
      // Yield rather than sleep between queries, as cudaStreamSynchronize
      // spins under CUDA's default scheduling where the cores outnumber the
      // GPUs: a sleep's pause (up to 100 us) would be seen late on every
      // step's one wait, the critical path of a GPU's step.
      [](absl::Duration) { std::this_thread::yield(); });
}

// ---- Memory ---------------------------------------------------------------

absl::StatusOr<DeviceBuffer> CudaBackend::DoAllocate(int64_t count) {
  CANZONA_RETURN_IF_ERROR(Activate());
  const size_t bytes = static_cast<size_t>(count) * sizeof(float);
  absl::StatusOr<void*> allocated = DeviceAlloc(bytes);
  if (!allocated.ok()) {
    // The pool's error names cudaMallocFromPoolAsync; callers (and the
    // conformance suite) look for the entry point, as on cpu.
    return absl::Status(
        allocated.status().code(),
        absl::StrCat("Allocate: cannot allocate ", count, " floats (", bytes,
                     " bytes) on cuda:", device_, ": ",
                     allocated.status().message()));
  }
  void* p = *allocated;
  // Zero-filled per the interface; ordered before any later use on stream_.
  cudaError_t err = cudaMemsetAsync(p, 0, bytes, stream_);
  if (err != cudaSuccess) {
    absl::Status status = CudaStatus(err, "Allocate: cudaMemsetAsync");
    DeviceRelease(p);
    return status;
  }
  return DeviceBuffer(this, static_cast<float*>(p), count);
}

void CudaBackend::Free(float* data, int64_t /*size*/) {
  if (data == nullptr) return;
  if (!Activate().ok()) return;
  DeviceRelease(data);
}

absl::Status CudaBackend::DoCopyFromHost(const float* host, int64_t count,
                                         float* dst) {
  CANZONA_RETURN_IF_ERROR(Activate());
  return CopyHostToDevice(host, static_cast<size_t>(count) * sizeof(float),
                          dst);
}

absl::Status CudaBackend::DoCopyToHost(const float* src, int64_t count,
                                       float* host) {
  CANZONA_RETURN_IF_ERROR(Activate());
  const size_t bytes = static_cast<size_t>(count) * sizeof(float);
  CANZONA_RETURN_IF_ERROR(BeforeHostCopy("CopyToHost", host, bytes).status());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream_));
  return AwaitStream("CopyToHost");
}

// Asynchronous only with page-locked host memory; with pageable memory the
// call returns once the bytes are staged (from host) or copied (to host),
// after BeforeHostCopy's bounded wait: still correct, only slower.
absl::Status CudaBackend::DoEnqueueCopyFromHost(const float* host,
                                                int64_t count, float* dst) {
  CANZONA_RETURN_IF_ERROR(Activate());
  const size_t bytes = static_cast<size_t>(count) * sizeof(float);
  CANZONA_RETURN_IF_ERROR(
      BeforeHostCopy("EnqueueCopyFromHost", host, bytes).status());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoEnqueueCopyToHost(const float* src, int64_t count,
                                              float* host) {
  CANZONA_RETURN_IF_ERROR(Activate());
  const size_t bytes = static_cast<size_t>(count) * sizeof(float);
  CANZONA_RETURN_IF_ERROR(
      BeforeHostCopy("EnqueueCopyToHost", host, bytes).status());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoCopy(const float* src, int64_t count, float* dst) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src, static_cast<size_t>(count) * sizeof(float),
                      cudaMemcpyDeviceToDevice, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoCopy2D(int64_t rows, int64_t cols, const float* src,
                                   int64_t src_ld, float* dst, int64_t dst_ld) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
      dst, static_cast<size_t>(dst_ld) * sizeof(float), src,
      static_cast<size_t>(src_ld) * sizeof(float),
      static_cast<size_t>(cols) * sizeof(float), static_cast<size_t>(rows),
      cudaMemcpyDeviceToDevice, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoFill(float value, int64_t count, float* dst) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::Fill(Cfg(), count, value, dst));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoSynchronize() {
  CANZONA_RETURN_IF_ERROR(Activate());
  return AwaitStream("Synchronize");
}

int64_t CudaBackend::workspace_bytes() const {
  return static_cast<int64_t>(ns_ws_.bytes + solver_ws_.bytes +
                              scratch_ws_.bytes + queued_ws_.bytes +
                              many_ws_.bytes);
}

// ---- Timing marks ---------------------------------------------------------

absl::Status CudaBackend::DoMark(int mark) {
  CANZONA_RETURN_IF_ERROR(Activate());
  if (marks_[mark] == nullptr) {
    CANZONA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&marks_[mark]));
  }
  CANZONA_CUDA_RETURN_IF_ERROR(cudaEventRecord(marks_[mark], stream_));
  return absl::OkStatus();
}

absl::StatusOr<double> CudaBackend::DoSecondsBetween(int from, int to) {
  CANZONA_RETURN_IF_ERROR(Activate());
  for (int mark : {from, to}) {
    if (marks_[mark] == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("SecondsBetween: mark ", mark, " was never set"));
    }
    // Not a wait: the caller keeps its host time while the GPU runs.
    const cudaError_t done = cudaEventQuery(marks_[mark]);
    if (done == cudaErrorNotReady) {
      // cudaEventQuery leaves cudaErrorNotReady as the thread's last
      // error, which the next kernel launch's cudaGetLastError would
      // report as its own failure.
      (void)cudaGetLastError();
      return absl::UnavailableError(absl::StrCat(
          "SecondsBetween: the work before mark ", mark, " is running"));
    }
    CANZONA_CUDA_RETURN_IF_ERROR(done);
  }
  float ms = 0;
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaEventElapsedTime(&ms, marks_[from], marks_[to]));
  return 1e-3 * static_cast<double>(ms);
}

}  // namespace cuda_internal

namespace {

constexpr absl::string_view kNoDevice = "no usable CUDA device";

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // CudaStatus already says "no usable CUDA device" for the driver /
    // no-device codes; any other failure to enumerate means the same here.
    absl::Status status = CudaStatus(err, "cudaGetDeviceCount");
    if (status.code() == absl::StatusCode::kFailedPrecondition) return status;
    return absl::FailedPreconditionError(
        absl::StrCat(kNoDevice, ": ", status.message()));
  }
  if (count <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(kNoDevice, ": cudaGetDeviceCount found no devices"));
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda backend: device ", device, " out of range [0, ", count, ")"));
  }
  auto backend = std::make_unique<cuda_internal::CudaBackend>(device);
  // On failure the destructor releases whatever Init created.
  CANZONA_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace canzona
