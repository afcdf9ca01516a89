// The cuda Backend's class, shared by the files that implement it:
// cuda_backend.cc (lifetime, memory, copies, waits, timing marks),
// cuda_backend_linalg.cc (cuBLAS, cuSOLVER and the matrix helpers),
// cuda_backend_newton_schulz.cc (Newton-Schulz and its CUDA graphs) and
// cuda_backend_elementwise.cc (the fused elementwise kernels and the
// reductions). Internal to kernels/cuda: everything else reaches the backend
// through CreateCudaBackend (cuda_backend.h) and the Backend interface.
#ifndef CANZONA_KERNELS_CUDA_CUDA_BACKEND_IMPL_H_
#define CANZONA_KERNELS_CUDA_CUDA_BACKEND_IMPL_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/newton_schulz.h"

namespace canzona {
namespace cuda_internal {

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

// The cuda Backend (CreateCudaBackend). Owns one non-blocking stream with a
// cuBLAS and a cuSOLVER handle bound to it, a backend-private stream-ordered
// memory pool for Allocate() (so freeing never waits for the device) and
// grow-only device workspaces (no allocation per call in steady state).
// Backend's entry points validate the arguments; the Do-methods check only
// cuSOLVER's 32-bit index range.
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
  // The stable descending order of keys[0, n) (SortColumns), computed into
  // the scratch workspace on the stream.
  absl::StatusOr<const int64_t*> DescendingOrder(int64_t n, const float* keys);
  // H2D copy of `bytes` from any host memory, finished on return (the
  // caller may reuse its buffer): page-locked sources are DMA, waited for
  // after; pageable ones as BeforeHostCopy says.
  absl::Status CopyHostToDevice(const void* host, size_t bytes, void* dst);
  // Before a copy of `bytes` between the device and `host` by `method`:
  // where `host` is pageable the driver waits inside cudaMemcpyAsync for the
  // stream's work, without a bound (before staging the bytes from it; into
  // it until the copy is done), behind a dead trainer's event for good. So
  // such a copy is counted (NotePageableCopy) and the stream waited for
  // first, within the wait timeout, which leaves the driver nothing to wait
  // for. Returns whether `host` is pageable.
  absl::StatusOr<bool> BeforeHostCopy(absl::string_view method,
                                      const void* host, size_t bytes);
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
  cuda_kernels::LaunchConfig Cfg() const {
    return cuda_kernels::LaunchConfig{stream_, num_sms_};
  }

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

}  // namespace cuda_internal
}  // namespace canzona

#endif  // CANZONA_KERNELS_CUDA_CUDA_BACKEND_IMPL_H_
