#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/casts.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/backend_checks.h"
#include "kernels/base/cuda_host_memory.h"
#include "kernels/base/cuda_status.h"
#include "kernels/base/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/newton_schulz.h"

namespace canzona {
namespace {

namespace checks = backend_checks;
using cuda_kernels::LaunchConfig;

constexpr absl::string_view kNoDevice = "no usable CUDA device";

// Sizes handed to cuSOLVER's 32-bit legacy API must fit in an int. This
// limit is the cuda backend's own (cuBLAS calls use the 64-bit API; LAPACK
// on cpu has its own), hence checked here rather than in Backend's entry
// points.
absl::Status FitsInt(absl::string_view what, absl::string_view field,
                     int64_t value) {
  return checks::Int32Index(what, field, value, "cuSOLVER");
}

cublasOperation_t ToCublas(Transpose t) {
  return t == Transpose::kYes ? CUBLAS_OP_T : CUBLAS_OP_N;
}

// EnqueueSumSquares' results wait on the device in a fixed queue of this
// many (so it never moves while results wait in it).
constexpr int kQueuedSums = 1024;

// Host-side results of the few methods that return to the host; pinned so
// the device-to-host copies are true asynchronous DMA on our stream.
struct PinnedScratch {
  double sum = 0.0;
  int flag = 0;
  // SymmetricEigen's report: the solver's info, then whether an eigenvalue
  // is not finite (one copy, the wait the solver needs anyway).
  int eigen_report[2] = {};
  double queued[kQueuedSums] = {};
};

// The cuda Backend. Owns one non-blocking stream with a cuBLAS and a
// cuSOLVER handle bound to it, a backend-private stream-ordered memory pool
// for Allocate() (so freeing never waits for the device) and grow-only
// device workspaces (no allocation per call in steady state). Backend's
// entry points validate the arguments; the Do-methods check only cuSOLVER's
// 32-bit index range.
//
// Thread-safety: not thread-safe (see Backend); every method makes the
// backend's device current on the calling thread first, so the owner thread
// may differ from the creating one.
class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {}
  ~CudaBackend() override;

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  BackendKind kind() const override { return BackendKind::kCuda; }
  MemorySpace memory_space() const override { return MemorySpace::kDevice; }
  std::string description() const override { return description_; }
  void* native_stream() const override { return stream_; }

  absl::Status Init();

 protected:
  void Free(float* data, int64_t size) override;

 private:
  absl::StatusOr<DeviceBuffer> DoAllocate(int64_t count) override;
  absl::Status DoCopyFromHost(const float* host, int64_t count,
                              float* dst) override;
  absl::Status DoCopyToHost(const float* src, int64_t count,
                            float* host) override;
  absl::Status DoEnqueueCopyFromHost(const float* host, int64_t count,
                                     float* dst) override;
  absl::Status DoEnqueueCopyToHost(const float* src, int64_t count,
                                   float* host) override;
  absl::Status DoCopy(const float* src, int64_t count, float* dst) override;
  absl::Status DoCopy2D(int64_t rows, int64_t cols, const float* src,
                        int64_t src_ld, float* dst, int64_t dst_ld) override;
  absl::Status DoFill(float value, int64_t count, float* dst) override;
  absl::Status DoSynchronize() override;

  absl::Status DoGemm(Transpose trans_a, Transpose trans_b, int64_t m,
                      int64_t n, int64_t k, float alpha, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float beta,
                      float* c, int64_t ldc) override;
  absl::Status DoGemmStridedBatched(Transpose trans_a, Transpose trans_b,
                                    int64_t m, int64_t n, int64_t k,
                                    float alpha, const float* a, int64_t lda,
                                    int64_t stride_a, const float* b,
                                    int64_t ldb, int64_t stride_b, float beta,
                                    float* c, int64_t ldc, int64_t stride_c,
                                    int64_t batch) override;
  absl::Status DoSyrk(Transpose trans, int64_t n, int64_t k, float alpha,
                      const float* a, int64_t lda, float beta, float* c,
                      int64_t ldc) override;
  absl::Status DoSymmetricEigen(int64_t n, float* a, float* eigenvalues,
                                EigenPrecision precision) override;
  absl::Status DoQrOrthonormalize(int64_t rows, int64_t cols,
                                  float* a) override;
  absl::Status DoNewtonSchulz(const NewtonSchulzSpec& spec, int64_t batch,
                              int64_t rows, int64_t cols, const float* input,
                              float* output) override;

  absl::Status DoLerp(int64_t n, const float* a, const float* b, float weight,
                      float* out) override;
  absl::Status DoNesterovMomentum(int64_t n, float beta, const float* grad,
                                  float* momentum, float* out) override;
  absl::Status DoAxpby(int64_t n, float alpha, const float* x, float beta,
                       float* y, SquaredChange change) override;
  absl::Status DoScale(int64_t n, float alpha, float* x) override;
  absl::Status DoEmaSquare(int64_t n, float decay, float weight, const float* g,
                           float* v) override;
  absl::Status DoAdamDirection(int64_t n, const float* m, float m_scale,
                               const float* v, float v_scale, float eps,
                               float* out) override;
  absl::Status DoAdamWStep(int64_t n, float lr, float beta1, float beta2,
                           float eps, float weight_decay, int64_t step,
                           const float* g, float* p, float* m, float* v,
                           SquaredChange change) override;
  absl::Status DoAdamWStepMany(absl::Span<const AdamWTensor> tensors, float lr,
                               float beta1, float beta2, float eps,
                               float weight_decay, int64_t step,
                               SquaredChange change) override;
  absl::StatusOr<double> DoSumSquares(int64_t n, const float* x) override;
  absl::Status DoSumSquaresMany(absl::Span<const float* const> xs,
                                absl::Span<const int64_t> ns,
                                absl::Span<double> out) override;
  absl::Status DoEnqueueSumSquares(int64_t n, const float* x) override;
  absl::Status DoEnqueueSquaredDistance(int64_t n, const float* a,
                                        const float* b) override;
  absl::StatusOr<double> DoTakeSumSquares() override;
  absl::Status DoMark(int mark) override;
  absl::StatusOr<double> DoSecondsBetween(int from, int to) override;
  absl::StatusOr<bool> DoAllFinite(int64_t n, const float* x) override;

  absl::Status DoScaleToNorm(int64_t n, const float* reference, Norm norm,
                             double eps, float* x) override;
  absl::Status DoLiftedPower(int64_t n, const float* x, double floor,
                             double exponent, float* out) override;
  absl::Status DoAddIdentity(int64_t n, float alpha, float* a) override;
  absl::Status DoScaleColumns(int64_t rows, int64_t cols, const float* d,
                              float* a) override;
  absl::Status DoColumnDots(int64_t rows, int64_t cols, const float* a,
                            const float* b, float* out) override;
  absl::Status DoSortColumns(int64_t rows, int64_t cols, const float* keys,
                             const float* src, float* dst) override;
  absl::Status DoSortRows(int64_t rows, int64_t cols, const float* keys,
                          const float* src, float* dst) override;
  absl::Status DoTranspose2D(int64_t rows, int64_t cols, const float* src,
                             float* dst) override;
  absl::Status DoReserveNewtonSchulz(const NewtonSchulzSpec& spec,
                                     int64_t batch, int64_t rows,
                                     int64_t cols) override;

 public:
  int64_t workspace_bytes() const override;

 private:
  // A grow-only device buffer. Growing releases the old block in stream
  // order, so work already queued on it stays valid.
  struct Workspace {
    void* data = nullptr;
    size_t bytes = 0;
  };

  // Makes device_ current on the calling thread (cheap when it already is).
  absl::Status Activate();
  absl::StatusOr<void*> DeviceAlloc(size_t bytes);
  // Releases memory from DeviceAlloc after all work queued so far.
  void DeviceRelease(void* p);
  absl::StatusOr<void*> Reserve(Workspace& ws, size_t bytes);
  // H2D copy of `bytes` from arbitrary host memory. Pageable sources are
  // staged by the driver before cudaMemcpyAsync returns; pinned sources are
  // DMA'd later, so we wait for those to honour "the caller may reuse its
  // buffer when the call returns".
  // The stable descending order of keys[0, n) (SortColumns), computed into
  // the scratch workspace on the stream.
  absl::StatusOr<const int64_t*> DescendingOrder(int64_t n, const float* keys);
  absl::Status CopyHostToDevice(const void* host, size_t bytes, void* dst);
  // Copies `bytes` from device memory to pinned_ and waits (for `method`).
  absl::Status FetchToPinned(const void* src, size_t bytes, void* pinned_dst,
                             absl::string_view method);
  // After a syevd: the solver's info at report[0] and whether an
  // eigenvalue is not finite (flagged into report[1]) in one copy and
  // wait; INTERNAL naming `solver` for either.
  absl::Status FetchEigenReport(int64_t n, const float* eigenvalues,
                                int* report, absl::string_view solver);
  // Waits on the host for everything queued on stream_, within the wait
  // timeout (Backend::AwaitWork): a query loop where a timeout is set,
  // cudaStreamSynchronize where none is.
  absl::Status AwaitStream(absl::string_view method);
  LaunchConfig Cfg() const { return LaunchConfig{stream_, num_sms_}; }

  const int device_;
  std::string description_;
  int num_sms_ = 1;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  cusolverDnHandle_t cusolver_ = nullptr;
  // Backend-private pool (release threshold: keep everything) so Allocate /
  // Free are stream-ordered and never sync; nullptr when the device has no
  // memory-pool support, then plain cudaMalloc / synchronizing cudaFree.
  cudaMemPool_t pool_ = nullptr;
  PinnedScratch* pinned_ = nullptr;
  Workspace ns_ws_;  // Newton-Schulz operands
  // CUDA graphs of Newton-Schulz. An optimizer runs the same iteration on
  // the same buffers every step: 3 + 5 launches per coefficient step,
  // captured once per (spec, shape, input, output) and then replayed as one
  // graph launch. Graphs bake in addresses, so they are dropped whenever
  // the workspace moves; a key runs eagerly on its first call and is
  // captured on its second; a key whose capture fails runs eagerly for good.
  // CANZONA_CUDA_GRAPHS=0 turns them off.
  bool ns_graphs_enabled_ = true;
  // CANZONA_NS_SYMMETRIC=0: full GEMMs for Newton-Schulz's symmetric
  // products (kernels/symmetric_tiles.h), whatever the spec asks.
  bool ns_symmetric_enabled_ = true;
  void* ns_graphs_workspace_ = nullptr;  // the workspace they were made with
  std::map<std::string, cudaGraphExec_t> ns_graphs_;
  std::set<std::string> ns_eager_;
  std::set<std::string> ns_seen_;     // keys run once eagerly, captured next
  void* cublas_workspace_ = nullptr;  // fixed, so captures never allocate
  void DropNsGraphs();
  cuda_internal::NsContext NsRunContext() const {
    return {stream_, cublas_, num_sms_, ns_symmetric_enabled_};
  }
  Workspace solver_ws_;   // cuSOLVER work arrays, copies and devInfo
  Workspace scratch_ws_;  // reductions, flags, permutations
  // SumSquaresMany's segment table, written here and copied to the device
  // (page-locked: the copy is DMA on the stream, not a wait), grown to the
  // most vectors one call has had.
  cuda_kernels::SumSquaresSegment* pinned_segments_ = nullptr;
  double* pinned_results_ = nullptr;  // after the segments, in their block
  size_t pinned_segment_capacity_ = 0;
  std::vector<cuda_kernels::SumSquaresSegment*> retired_segments_;
  // EnqueueSumSquares: partials, then room for kQueuedSums results; how
  // many wait, and the total of those already read, in queue order.
  Workspace queued_ws_;
  // AdamWStepMany's partials: at most kAdamWManyMax tensors of at most
  // kMaxReductionBlocks blocks each (one size: taken at Init).
  Workspace many_ws_;
  int queued_ = 0;
  double queued_total_ = 0;
  // Enqueues the copy of the waiting results to pinned_->queued; after the
  // next wait AddQueuedSums adds them to queued_total_.
  absl::Status FetchQueuedSums();
  void AddQueuedSums(int fetched);
  // Both with one wait.
  absl::Status DrainQueuedSums();
  // Queues one sum: `reduce` writes it to its second argument, with the
  // queue's partials as scratch.
  absl::Status Enqueue(
      const std::function<cudaError_t(double*, double*)>& reduce);
  // Mark's timing events, created at first use.
  std::array<cudaEvent_t, kTimeMarks> marks_ = {};
};

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
  // cpu backend. bf16 GemmEx calls still use tensor cores.
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
  // From pageable memory the driver waits for the stream before staging
  // the bytes, unbounded: the bounded wait first leaves it nothing to wait
  // for. From page-locked memory the copy is DMA, later: waited for after.
  const bool pageable = CudaHostPageable(host);
  if (pageable) {
    NotePageableCopy("CopyFromHost", host, static_cast<int64_t>(bytes));
    CANZONA_RETURN_IF_ERROR(AwaitStream("CopyFromHost"));
  }
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_));
  if (!pageable) CANZONA_RETURN_IF_ERROR(AwaitStream("CopyFromHost"));
  return absl::OkStatus();
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
  // Into pageable memory cudaMemcpyAsync returns only once the copy is
  // done, behind the stream's work, unbounded: the bounded wait first.
  if (CudaHostPageable(host)) {
    NotePageableCopy("CopyToHost", host, count * int64_t{sizeof(float)});
    CANZONA_RETURN_IF_ERROR(AwaitStream("CopyToHost"));
  }
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host, src, static_cast<size_t>(count) * sizeof(float),
                      cudaMemcpyDeviceToHost, stream_));
  return AwaitStream("CopyToHost");
}

// Asynchronous only from page-locked host memory; from pageable memory the
// driver stages the bytes and the call returns once they are staged,
// still correct.
absl::Status CudaBackend::DoEnqueueCopyFromHost(const float* host,
                                                int64_t count, float* dst) {
  CANZONA_RETURN_IF_ERROR(Activate());
  if (CudaHostPageable(host)) {
    NotePageableCopy("EnqueueCopyFromHost", host,
                     count * int64_t{sizeof(float)});
  }
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, host, static_cast<size_t>(count) * sizeof(float),
                      cudaMemcpyHostToDevice, stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoEnqueueCopyToHost(const float* src, int64_t count,
                                              float* host) {
  CANZONA_RETURN_IF_ERROR(Activate());
  if (CudaHostPageable(host)) {
    NotePageableCopy("EnqueueCopyToHost", host, count * int64_t{sizeof(float)});
  }
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(host, src, static_cast<size_t>(count) * sizeof(float),
                      cudaMemcpyDeviceToHost, stream_));
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

// ---- Dense linear algebra -------------------------------------------------
//
// cuBLAS is column-major. A row-major matrix with leading dimension ld read
// column-major is its transpose, so the row-major C = op(A) op(B) is the
// column-major C^T = op(B)^T op(A)^T: swap the operands and m/n, keep the
// transpose flags.

absl::Status CudaBackend::DoGemm(Transpose trans_a, Transpose trans_b,
                                 int64_t m, int64_t n, int64_t k, float alpha,
                                 const float* a, int64_t lda, const float* b,
                                 int64_t ldb, float beta, float* c,
                                 int64_t ldc) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cublasSgemm_64(cublas_, ToCublas(trans_b), ToCublas(trans_a), n, m, k,
                     &alpha, b, ldb, a, lda, &beta, c, ldc));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoGemmStridedBatched(
    Transpose trans_a, Transpose trans_b, int64_t m, int64_t n, int64_t k,
    float alpha, const float* a, int64_t lda, int64_t stride_a, const float* b,
    int64_t ldb, int64_t stride_b, float beta, float* c, int64_t ldc,
    int64_t stride_c, int64_t batch) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(cublasSgemmStridedBatched_64(
      cublas_, ToCublas(trans_b), ToCublas(trans_a), n, m, k, &alpha, b, ldb,
      stride_b, a, lda, stride_a, &beta, c, ldc, stride_c, batch));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoSyrk(Transpose trans, int64_t n, int64_t k,
                                 float alpha, const float* a, int64_t lda,
                                 float beta, float* c, int64_t ldc) {
  CANZONA_RETURN_IF_ERROR(Activate());
  // Row-major A (n x k) is column-major A' = A^T (k x n), so A A^T = A'^T A'
  // (CUBLAS_OP_T); symmetrically A^T A = A' A'^T (CUBLAS_OP_N). cuBLAS fills
  // the column-major lower triangle, i.e. the row-major upper one; beta
  // therefore scales (and reads) only that triangle of C.
  const cublasOperation_t op =
      trans == Transpose::kNo ? CUBLAS_OP_T : CUBLAS_OP_N;
  CANZONA_CUDA_RETURN_IF_ERROR(cublasSsyrk_64(cublas_, CUBLAS_FILL_MODE_LOWER,
                                              op, n, k, &alpha, a, lda, &beta,
                                              c, ldc));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::MirrorUpperToLower(Cfg(), 1, n, c, ldc, 0));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoSymmetricEigen(int64_t n, float* a,
                                           float* eigenvalues,
                                           EigenPrecision precision) {
  constexpr absl::string_view kWhat = "SymmetricEigen";
  CANZONA_RETURN_IF_ERROR(FitsInt(kWhat, "n * n", checks::SatMul(n, n)));
  CANZONA_RETURN_IF_ERROR(Activate());
  // syevd may wait for the stream inside cuSOLVER (its host stage reads the
  // tridiagonal form), without a bound: the bounded wait first.
  CANZONA_RETURN_IF_ERROR(AwaitStream(kWhat));
  const int ni = static_cast<int>(n);
  const size_t nn = static_cast<size_t>(n) * static_cast<size_t>(n);
  const LaunchConfig cfg = Cfg();
  // The input is symmetric, so its row-major and column-major views agree
  // and syevd reads it as is (lower column-major == upper row-major
  // triangle). syevd runs on a copy in the workspace: on failure `a` keeps
  // the input, so the caller can retry with kFloat64.
  int* info = nullptr;
  if (precision == EigenPrecision::kFloat32) {
    int lwork = 0;
    CANZONA_CUDA_RETURN_IF_ERROR(cusolverDnSsyevd_bufferSize(
        cusolver_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, ni, a, ni,
        eigenvalues, &lwork));
    const size_t v_off = 0;
    const size_t w_off = v_off + (nn * sizeof(float) + 255) / 256 * 256;
    const size_t info_off =
        w_off + (static_cast<size_t>(lwork) * sizeof(float) + 255) / 256 * 256;
    CANZONA_ASSIGN_OR_RETURN(
        void* ws,
        Reserve(solver_ws_, info_off + sizeof(pinned_->eigen_report)));
    char* base = static_cast<char*>(ws);
    auto* v = reinterpret_cast<float*>(base + v_off);
    auto* work = reinterpret_cast<float*>(base + w_off);
    info = reinterpret_cast<int*>(base + info_off);
    CANZONA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        v, a, nn * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    CANZONA_CUDA_RETURN_IF_ERROR(cusolverDnSsyevd(
        cusolver_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, ni, v, ni,
        eigenvalues, work, lwork, info));
    CANZONA_RETURN_IF_ERROR(
        FetchEigenReport(n, eigenvalues, info, "cusolverDnSsyevd"));
    // Column-major eigenvectors-as-columns == row-major eigenvectors-as-rows;
    // the interface wants them as row-major columns: transpose.
    CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::Transpose(cfg, 1, n, n, v, a));
    return absl::OkStatus();
  }

  // kFloat64: solve in double, round the results to float32.
  const size_t v_off = 0;
  const size_t ev_off = v_off + (nn * sizeof(double) + 255) / 256 * 256;
  const size_t w_off =
      ev_off + (static_cast<size_t>(n) * sizeof(double) + 255) / 256 * 256;
  // Query with placeholder pointers: bufferSize reads no data.
  int lwork = 0;
  CANZONA_CUDA_RETURN_IF_ERROR(cusolverDnDsyevd_bufferSize(
      cusolver_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, ni,
      reinterpret_cast<const double*>(a), ni,
      reinterpret_cast<const double*>(eigenvalues), &lwork));
  const size_t info_off =
      w_off + (static_cast<size_t>(lwork) * sizeof(double) + 255) / 256 * 256;
  CANZONA_ASSIGN_OR_RETURN(
      void* ws, Reserve(solver_ws_, info_off + sizeof(pinned_->eigen_report)));
  char* base = static_cast<char*>(ws);
  auto* v = reinterpret_cast<double*>(base + v_off);
  auto* w = reinterpret_cast<double*>(base + ev_off);
  auto* work = reinterpret_cast<double*>(base + w_off);
  info = reinterpret_cast<int*>(base + info_off);
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::FloatToDouble(cfg, static_cast<int64_t>(nn), a, v));
  CANZONA_CUDA_RETURN_IF_ERROR(cusolverDnDsyevd(
      cusolver_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, ni, v, ni, w,
      work, lwork, info));
  // Rounded before the report, so that one too large for float32 counts as
  // not finite; `a` is written only after it (a failure leaves the input).
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::DoubleToFloat(cfg, n, w, eigenvalues));
  CANZONA_RETURN_IF_ERROR(
      FetchEigenReport(n, eigenvalues, info, "cusolverDnDsyevd"));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::TransposeDoubleToFloat(cfg, n, n, v, a));
  return absl::OkStatus();
}

absl::Status CudaBackend::FetchEigenReport(int64_t n, const float* eigenvalues,
                                           int* report,
                                           absl::string_view solver) {
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(report + 1, 0, sizeof(int), stream_));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::FlagNonFinite(Cfg(), n, eigenvalues, report + 1));
  CANZONA_RETURN_IF_ERROR(FetchToPinned(report, sizeof(pinned_->eigen_report),
                                        pinned_->eigen_report,
                                        "SymmetricEigen"));
  const int info = pinned_->eigen_report[0];
  if (info != 0) {
    return absl::InternalError(
        absl::StrCat("SymmetricEigen: ", solver, " failed (info = ", info,
                     info > 0 ? ", did not converge)" : ", bad argument)"));
  }
  if (pinned_->eigen_report[1] != 0) return NonFiniteEigenvalue();
  return absl::OkStatus();
}

absl::Status CudaBackend::DoQrOrthonormalize(int64_t rows, int64_t cols,
                                             float* a) {
  CANZONA_RETURN_IF_ERROR(
      FitsInt("QrOrthonormalize", "rows * cols", checks::SatMul(rows, cols)));
  CANZONA_RETURN_IF_ERROR(Activate());
  const int m = static_cast<int>(rows);
  const int k = static_cast<int>(cols);
  const size_t size = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  // Query with the caller's buffer as a placeholder for both arrays:
  // bufferSize reads no data.
  int lwork_geqrf = 0, lwork_orgqr = 0;
  CANZONA_CUDA_RETURN_IF_ERROR(
      cusolverDnSgeqrf_bufferSize(cusolver_, m, k, a, m, &lwork_geqrf));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cusolverDnSorgqr_bufferSize(cusolver_, m, k, k, a, m, a, &lwork_orgqr));
  const int lwork = lwork_geqrf > lwork_orgqr ? lwork_geqrf : lwork_orgqr;
  const size_t q_off = 0;
  const size_t tau_off = q_off + (size * sizeof(float) + 255) / 256 * 256;
  const size_t w_off =
      tau_off + (static_cast<size_t>(cols) * sizeof(float) + 255) / 256 * 256;
  const size_t info_off =
      w_off + (static_cast<size_t>(lwork) * sizeof(float) + 255) / 256 * 256;
  CANZONA_ASSIGN_OR_RETURN(void* ws,
                           Reserve(solver_ws_, info_off + sizeof(int)));
  char* base = static_cast<char*>(ws);
  auto* q = reinterpret_cast<float*>(base + q_off);
  auto* tau = reinterpret_cast<float*>(base + tau_off);
  auto* work = reinterpret_cast<float*>(base + w_off);
  auto* info = reinterpret_cast<int*>(base + info_off);
  const LaunchConfig cfg = Cfg();
  // Row-major rows x cols -> row-major cols x rows == column-major rows x
  // cols (ld = rows), which is what LAPACK factors. The same Householder
  // reflectors as the cpu backend's LAPACKE_sgeqrf result, hence the same
  // signs.
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::Transpose(cfg, 1, rows, cols, a, q));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cusolverDnSgeqrf(cusolver_, m, k, q, m, tau, work, lwork, info));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cusolverDnSorgqr(cusolver_, m, k, k, q, m, tau, work, lwork, info));
  // devInfo is only ever negative for an illegal argument, which Backend's
  // entry point and FitsInt rule out; not reading it keeps QR free of host
  // synchronization.
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::Transpose(cfg, 1, cols, rows, q, a));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoReserveNewtonSchulz(const NewtonSchulzSpec& spec,
                                                int64_t batch, int64_t rows,
                                                int64_t cols) {
  CANZONA_RETURN_IF_ERROR(Activate());
  return Reserve(ns_ws_, cuda_internal::NewtonSchulzWorkspaceBytes(
                             NsRunContext(), spec,
                             ResolvedNsAlgorithm(spec, kind(), rows, cols),
                             batch, rows, cols))
      .status();
}

int64_t CudaBackend::workspace_bytes() const {
  return static_cast<int64_t>(ns_ws_.bytes + solver_ws_.bytes +
                              scratch_ws_.bytes + queued_ws_.bytes +
                              many_ws_.bytes);
}

absl::Status CudaBackend::DoNewtonSchulz(const NewtonSchulzSpec& spec,
                                         int64_t batch, int64_t rows,
                                         int64_t cols, const float* input,
                                         float* output) {
  CANZONA_RETURN_IF_ERROR(Activate());
  const NsAlgorithm algorithm = ResolvedNsAlgorithm(spec, kind(), rows, cols);
  const cuda_internal::NsContext ctx = NsRunContext();
  const size_t bytes = cuda_internal::NewtonSchulzWorkspaceBytes(
      ctx, spec, algorithm, batch, rows, cols);
  CANZONA_ASSIGN_OR_RETURN(void* ws, Reserve(ns_ws_, bytes));
  auto run = [&] {
    return cuda_internal::RunNewtonSchulz(ctx, spec, algorithm, batch, rows,
                                          cols, input, output, ws);
  };
  if (!ns_graphs_enabled_) return run();
  if (ws != ns_graphs_workspace_) {
    DropNsGraphs();
    ns_graphs_workspace_ = ws;
  }
  // Everything the captured launches depend on.
  std::string key = absl::StrCat(
      static_cast<int>(spec.precision), ":", static_cast<int>(algorithm), ":",
      cuda_internal::SymmetricProducts(ctx, spec) ? "sym:" : "full:", batch,
      ":", rows, ":", cols, ":", reinterpret_cast<uintptr_t>(input), ":",
      reinterpret_cast<uintptr_t>(output), ":",
      absl::bit_cast<uint32_t>(spec.norm_scale), ":",
      absl::bit_cast<uint32_t>(spec.norm_eps));
  for (const auto& c : spec.coefficients) {
    absl::StrAppend(&key, ":", absl::bit_cast<uint32_t>(c[0]), ",",
                    absl::bit_cast<uint32_t>(c[1]), ",",
                    absl::bit_cast<uint32_t>(c[2]));
  }
  if (auto it = ns_graphs_.find(key); it != ns_graphs_.end()) {
    CANZONA_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(it->second, stream_));
    return absl::OkStatus();
  }
  // Bounded: a caller cycling through fresh buffers gains nothing.
  constexpr size_t kMaxGraphs = 4096;
  if (ns_eager_.count(key) > 0 || ns_graphs_.size() >= kMaxGraphs) {
    return run();
  }
  // The first call of a key runs eagerly: it may be the first use of the
  // cuBLAS handle or of a kernel, whose lazy setup (module loading,
  // heuristics) is not capturable; capturing then would send the key to
  // eager for good. The second call captures.
  if (ns_seen_.size() < kMaxGraphs && ns_seen_.insert(key).second) {
    return run();
  }
  if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) !=
      cudaSuccess) {
    // A stream that cannot capture runs the key eagerly, as any failed
    // capture does, rather than failing every Newton-Schulz of the shape.
    (void)cudaGetLastError();
    ns_eager_.insert(std::move(key));
    return run();
  }
  const absl::Status captured = run();
  cudaGraph_t graph = nullptr;
  cudaError_t result = cudaStreamEndCapture(stream_, &graph);
  cudaGraphExec_t exec = nullptr;
  if (captured.ok() && result == cudaSuccess && graph != nullptr) {
    result = cudaGraphInstantiateWithFlags(&exec, graph, 0);
  }
  if (graph != nullptr) (void)cudaGraphDestroy(graph);
  if (!captured.ok() || result != cudaSuccess || exec == nullptr) {
    // Capture errors invalidate only the capture; run this one eagerly.
    (void)cudaGetLastError();
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    ns_eager_.insert(std::move(key));
    return run();
  }
  ns_graphs_.emplace(std::move(key), exec);
  CANZONA_CUDA_RETURN_IF_ERROR(cudaGraphLaunch(exec, stream_));
  return absl::OkStatus();
}

void CudaBackend::DropNsGraphs() {
  for (auto& [key, exec] : ns_graphs_) (void)cudaGraphExecDestroy(exec);
  ns_graphs_.clear();
  ns_eager_.clear();
  ns_seen_.clear();
}

// ---- Fused elementwise kernels --------------------------------------------

absl::Status CudaBackend::DoLerp(int64_t n, const float* a, const float* b,
                                 float weight, float* out) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::Lerp(Cfg(), n, a, b, weight, out));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoNesterovMomentum(int64_t n, float beta,
                                             const float* grad, float* momentum,
                                             float* out) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::NesterovMomentum(Cfg(), n, beta, grad, momentum, out));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoAxpby(int64_t n, float alpha, const float* x,
                                  float beta, float* y, SquaredChange change) {
  if (change == SquaredChange::kQueue) {
    return Enqueue([&](double* partials, double* result) {
      const cuda_kernels::ChangeSum sum{partials, result};
      return cuda_kernels::Axpby(Cfg(), n, alpha, x, beta, y, &sum);
    });
  }
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::Axpby(Cfg(), n, alpha, x, beta, y));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoScale(int64_t n, float alpha, float* x) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::Scale(Cfg(), n, alpha, x));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoEmaSquare(int64_t n, float decay, float weight,
                                      const float* g, float* v) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::EmaSquare(Cfg(), n, decay, weight, g, v));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoAdamDirection(int64_t n, const float* m,
                                          float m_scale, const float* v,
                                          float v_scale, float eps,
                                          float* out) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::AdamDirection(Cfg(), n, m, m_scale, v, v_scale, eps, out));
  return absl::OkStatus();
}

namespace {

// torch computes these scalars in Python (double) and hands them to the
// kernels as float32: so do AdamWStep and AdamWStepMany.
cuda_kernels::AdamWScalars AdamWScalarsOf(float lr, float beta1, float beta2,
                                          float eps, float weight_decay,
                                          int64_t step) {
  const double bc1 =
      1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 =
      1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  cuda_kernels::AdamWScalars s;
  s.decay = static_cast<float>(1.0 - static_cast<double>(lr) *
                                         static_cast<double>(weight_decay));
  s.lerp_weight = static_cast<float>(1.0 - static_cast<double>(beta1));
  s.beta2 = beta2;
  s.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(beta2));
  s.step_size = static_cast<float>(static_cast<double>(lr) / bc1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.eps = eps;
  return s;
}

}  // namespace

absl::Status CudaBackend::DoAdamWStep(int64_t n, float lr, float beta1,
                                      float beta2, float eps,
                                      float weight_decay, int64_t step,
                                      const float* g, float* p, float* m,
                                      float* v, SquaredChange change) {
  CANZONA_RETURN_IF_ERROR(Activate());
  const cuda_kernels::AdamWScalars s =
      AdamWScalarsOf(lr, beta1, beta2, eps, weight_decay, step);
  if (change == SquaredChange::kQueue) {
    return Enqueue([&](double* partials, double* result) {
      const cuda_kernels::ChangeSum sum{partials, result};
      return cuda_kernels::AdamWStep(Cfg(), n, s, g, p, m, v, &sum);
    });
  }
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::AdamWStep(Cfg(), n, s, g, p, m, v));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoAdamWStepMany(absl::Span<const AdamWTensor> tensors,
                                          float lr, float beta1, float beta2,
                                          float eps, float weight_decay,
                                          int64_t step, SquaredChange change) {
  CANZONA_RETURN_IF_ERROR(Activate());
  const bool counted = change == SquaredChange::kQueue;
  cuda_kernels::AdamWMany many{};
  many.s = AdamWScalarsOf(lr, beta1, beta2, eps, weight_decay, step);
  for (size_t first = 0; first < tensors.size();
       first += cuda_kernels::kAdamWManyMax) {
    const int count = static_cast<int>(
        std::min<size_t>(cuda_kernels::kAdamWManyMax, tensors.size() - first));
    // Each change sum takes a queue slot, as AdamWStep's does.
    if (counted && queued_ + count > kQueuedSums) {
      CANZONA_RETURN_IF_ERROR(DrainQueuedSums());
    }
    many.count = count;
    int64_t total_blocks = 0;
    for (int k = 0; k < count; ++k) {
      const AdamWTensor& t = tensors[first + k];
      const int blocks =
          cuda_kernels::AdamWBlocks(Cfg(), t.n, t.g, t.p, t.m, t.v, counted);
      many.segments[k] = {
          t.g, t.p, t.m, t.v, t.n, static_cast<int32_t>(total_blocks), blocks};
      total_blocks += blocks;
    }
    if (total_blocks > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "AdamWStepMany: ", total_blocks, " blocks exceed one launch"));
    }
    double* partials = nullptr;
    double* results = nullptr;
    if (counted) {
      partials = static_cast<double*>(many_ws_.data);
      results = static_cast<double*>(queued_ws_.data) +
                cuda_kernels::kMaxReductionBlocks + queued_;
    }
    CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::AdamWStepMany(
        Cfg(), many, static_cast<int>(total_blocks), partials, results));
    if (counted) queued_ += count;
  }
  return absl::OkStatus();
}

absl::StatusOr<double> CudaBackend::DoSumSquares(int64_t n, const float* x) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_ASSIGN_OR_RETURN(
      void* ws, Reserve(scratch_ws_, (cuda_kernels::kMaxReductionBlocks + 1) *
                                         sizeof(double)));
  auto* partials = static_cast<double*>(ws);
  double* result = partials + cuda_kernels::kMaxReductionBlocks;
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::SumSquares(Cfg(), n, x, partials, result));
  CANZONA_RETURN_IF_ERROR(
      FetchToPinned(result, sizeof(double), &pinned_->sum, "SumSquares"));
  return pinned_->sum;
}

absl::Status CudaBackend::DoScaleToNorm(int64_t n, const float* reference,
                                        Norm norm, double eps, float* x) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_ASSIGN_OR_RETURN(
      void* ws, Reserve(scratch_ws_, (cuda_kernels::kMaxReductionBlocks + 2) *
                                         sizeof(double)));
  auto* partials = static_cast<double*>(ws);
  double* sums = partials + cuda_kernels::kMaxReductionBlocks;
  const double divisor = norm == Norm::kRms ? static_cast<double>(n) : 1.0;
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::ScaleToNorm(
      Cfg(), n, reference, divisor, eps, x, partials, sums));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoLiftedPower(int64_t n, const float* x, double floor,
                                        double exponent, float* out) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::LiftedPower(Cfg(), n, x, floor, exponent, out));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoSumSquaresMany(absl::Span<const float* const> xs,
                                           absl::Span<const int64_t> ns,
                                           absl::Span<double> out) {
  CANZONA_RETURN_IF_ERROR(Activate());
  const size_t k = xs.size();  // > 0 (Backend::SumSquaresMany)
  // Every vector's blocks in one launch and their sums in a second (a
  // step's norm pass has one vector per gradient: hundreds of launches
  // before), each sum bitwise what SumSquares gives.
  if (k > pinned_segment_capacity_) {
    const size_t capacity = std::max<size_t>(k, 1024);
    void* table = nullptr;
    // [segments | results]: the results come back into page-locked memory,
    // so that their copy never waits inside cudaMemcpyAsync (into the
    // caller's pageable memory it would, unbounded) and the one bounded
    // wait below is the only one.
    const cudaError_t allocated = cudaHostAlloc(
        &table,
        capacity * (sizeof(cuda_kernels::SumSquaresSegment) + sizeof(double)),
        cudaHostAllocDefault);
    if (allocated != cudaSuccess) {
      (void)cudaGetLastError();  // not the next launch's error
      CANZONA_CUDA_RETURN_IF_ERROR(allocated);
    }
    // The smaller table stays until teardown: cudaFreeHost would
    // synchronize the device in a step.
    if (pinned_segments_ != nullptr) {
      retired_segments_.push_back(pinned_segments_);
    }
    pinned_segments_ = static_cast<cuda_kernels::SumSquaresSegment*>(table);
    pinned_results_ = reinterpret_cast<double*>(pinned_segments_ + capacity);
    pinned_segment_capacity_ = capacity;
  }
  int64_t total_blocks = 0;
  for (size_t i = 0; i < k; ++i) {
    const int blocks = cuda_kernels::SumSquaresBlocks(Cfg(), ns[i], xs[i]);
    pinned_segments_[i] = {xs[i], ns[i], static_cast<int32_t>(total_blocks),
                           blocks};
    total_blocks += blocks;
  }
  if (total_blocks > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("SumSquaresMany: ", total_blocks, " reduction blocks for ",
                     k, " vectors exceed one launch"));
  }
  // [partials | results | segments], all 8-byte aligned.
  const size_t segments_at = (static_cast<size_t>(total_blocks) + k) * 8;
  CANZONA_ASSIGN_OR_RETURN(
      void* ws,
      Reserve(scratch_ws_,
              segments_at + k * sizeof(cuda_kernels::SumSquaresSegment)));
  auto* partials = static_cast<double*>(ws);
  double* results = partials + total_blocks;
  auto* segments = reinterpret_cast<cuda_kernels::SumSquaresSegment*>(
      static_cast<char*>(ws) + segments_at);
  // One copy and one wait for all of them, and for the queued sums
  // (Backend: a later TakeSumSquares does not wait).
  const int fetched = queued_;
  absl::Status status = [&]() -> absl::Status {
    CANZONA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
        segments, pinned_segments_, k * sizeof(cuda_kernels::SumSquaresSegment),
        cudaMemcpyHostToDevice, stream_));
    CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::SumSquaresMany(
        Cfg(), static_cast<int>(k), segments, static_cast<int>(total_blocks),
        partials, results));
    CANZONA_RETURN_IF_ERROR(FetchQueuedSums());
    CANZONA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(pinned_results_, results, k * sizeof(double),
                        cudaMemcpyDeviceToHost, stream_));
    CANZONA_RETURN_IF_ERROR(AwaitStream("SumSquaresMany"));
    std::copy(pinned_results_, pinned_results_ + k, out.begin());
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    // Nothing may still copy from the table or into the pinned results
    // when the next call writes them, and the queued sums, still on the
    // device, stay queued.
    if (stalled()) {
      // The stream may run this call's copies whenever it resumes: the
      // block is left to them (freed at teardown) and the next call
      // takes a new one.
      retired_segments_.push_back(pinned_segments_);
      pinned_segments_ = nullptr;
      pinned_results_ = nullptr;
      pinned_segment_capacity_ = 0;
    } else {
      (void)cudaStreamSynchronize(stream_);
      (void)cudaGetLastError();
    }
    queued_ = fetched;
    return status;
  }
  AddQueuedSums(fetched);
  return absl::OkStatus();
}

absl::Status CudaBackend::DoEnqueueSumSquares(int64_t n, const float* x) {
  return Enqueue([&](double* partials, double* result) {
    return cuda_kernels::SumSquares(Cfg(), n, x, partials, result);
  });
}

absl::Status CudaBackend::DoEnqueueSquaredDistance(int64_t n, const float* a,
                                                   const float* b) {
  return Enqueue([&](double* partials, double* result) {
    return cuda_kernels::SquaredDistance(Cfg(), n, a, b, partials, result);
  });
}

absl::Status CudaBackend::Enqueue(
    const std::function<cudaError_t(double*, double*)>& reduce) {
  CANZONA_RETURN_IF_ERROR(Activate());
  if (queued_ == kQueuedSums) CANZONA_RETURN_IF_ERROR(DrainQueuedSums());
  CANZONA_ASSIGN_OR_RETURN(
      void* ws,
      Reserve(queued_ws_, (cuda_kernels::kMaxReductionBlocks + kQueuedSums) *
                              sizeof(double)));
  auto* partials = static_cast<double*>(ws);
  double* results = partials + cuda_kernels::kMaxReductionBlocks;
  CANZONA_CUDA_RETURN_IF_ERROR(reduce(partials, results + queued_));
  ++queued_;
  return absl::OkStatus();
}

absl::Status CudaBackend::FetchQueuedSums() {
  if (queued_ == 0) return absl::OkStatus();
  const double* results = static_cast<const double*>(queued_ws_.data) +
                          cuda_kernels::kMaxReductionBlocks;
  CANZONA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(pinned_->queued, results, queued_ * sizeof(double),
                      cudaMemcpyDeviceToHost, stream_));
  // The queue's slots are free for new sums, which the stream orders after
  // this copy.
  queued_ = 0;
  return absl::OkStatus();
}

void CudaBackend::AddQueuedSums(int fetched) {
  for (int i = 0; i < fetched; ++i) queued_total_ += pinned_->queued[i];
}

absl::Status CudaBackend::DrainQueuedSums() {
  const int fetched = queued_;
  if (fetched == 0) return absl::OkStatus();
  CANZONA_RETURN_IF_ERROR(FetchQueuedSums());
  CANZONA_RETURN_IF_ERROR(AwaitStream("TakeSumSquares"));
  AddQueuedSums(fetched);
  return absl::OkStatus();
}

absl::StatusOr<double> CudaBackend::DoTakeSumSquares() {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_RETURN_IF_ERROR(DrainQueuedSums());
  const double total = queued_total_;
  queued_total_ = 0;
  return total;
}

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

absl::StatusOr<bool> CudaBackend::DoAllFinite(int64_t n, const float* x) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_ASSIGN_OR_RETURN(void* ws, Reserve(scratch_ws_, sizeof(int)));
  int* flag = static_cast<int*>(ws);
  CANZONA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flag, 0, sizeof(int), stream_));
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::FlagNonFinite(Cfg(), n, x, flag));
  CANZONA_RETURN_IF_ERROR(
      FetchToPinned(flag, sizeof(int), &pinned_->flag, "AllFinite"));
  return pinned_->flag == 0;
}

// ---- Matrix helpers -------------------------------------------------------

absl::Status CudaBackend::DoAddIdentity(int64_t n, float alpha, float* a) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(cuda_kernels::AddIdentity(Cfg(), n, alpha, a));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoScaleColumns(int64_t rows, int64_t cols,
                                         const float* d, float* a) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::ScaleColumns(Cfg(), rows, cols, d, a));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoColumnDots(int64_t rows, int64_t cols,
                                       const float* a, const float* b,
                                       float* out) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::ColumnDots(Cfg(), rows, cols, a, b, out));
  return absl::OkStatus();
}

absl::StatusOr<const int64_t*> CudaBackend::DescendingOrder(int64_t n,
                                                            const float* keys) {
  CANZONA_ASSIGN_OR_RETURN(
      void* ws, Reserve(scratch_ws_, static_cast<size_t>(n) * sizeof(int64_t)));
  auto* order = static_cast<int64_t*>(ws);
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::DescendingOrder(Cfg(), n, keys, order));
  return order;
}

absl::Status CudaBackend::DoSortColumns(int64_t rows, int64_t cols,
                                        const float* keys, const float* src,
                                        float* dst) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_ASSIGN_OR_RETURN(const int64_t* order, DescendingOrder(cols, keys));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::GatherColumns(Cfg(), rows, cols, order, src, dst));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoSortRows(int64_t rows, int64_t cols,
                                     const float* keys, const float* src,
                                     float* dst) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_ASSIGN_OR_RETURN(const int64_t* order, DescendingOrder(rows, keys));
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::GatherRows(Cfg(), rows, cols, order, src, dst));
  return absl::OkStatus();
}

absl::Status CudaBackend::DoTranspose2D(int64_t rows, int64_t cols,
                                        const float* src, float* dst) {
  CANZONA_RETURN_IF_ERROR(Activate());
  CANZONA_CUDA_RETURN_IF_ERROR(
      cuda_kernels::Transpose(Cfg(), 1, rows, cols, src, dst));
  return absl::OkStatus();
}

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
  auto backend = std::make_unique<CudaBackend>(device);
  // On failure the destructor releases whatever Init created.
  CANZONA_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace canzona
