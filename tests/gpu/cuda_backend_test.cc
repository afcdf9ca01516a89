// The cuda backend: the conformance suite every backend passes
// (tests/unit/kernels/backend_conformance.h), then what only the cuda
// backend has: device description and selection, the bf16 Newton-Schulz,
// CUDA graph replays on fresh data, and agreement with the cpu backend on a
// Newton-Schulz shape too large for the float64 reference.
//
// Every test skips when no CUDA device is usable.
#include "kernels/cuda/cuda_backend.h"

#include <stdlib.h>

#if CANZONA_ENABLE_CUDA
#include <cuda_runtime_api.h>
#endif

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/base/cuda_host_memory.h"
#include "kernels/base/status_macros.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/kernels/backend_conformance.h"
#include "tests/unit/kernels/backend_reference.h"

namespace canzona {
namespace {

using ::canzona::backend_reference::Matrix;
using ::canzona::backend_reference::NewtonSchulzReference;
using ::canzona::backend_reference::QuinticSpec;
using ::canzona::backend_reference::RandomNormal;
using ::canzona::backend_reference::RelativeError;
using ::canzona::backend_reference::ToDouble;
using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::StartsWith;

std::string NoDevice() {
  return CudaDeviceCount() == 0 ? "no CUDA device" : "";
}

BackendUnderTest CudaUnderTest() {
  BackendUnderTest cuda;
  cuda.name = "cuda";
  cuda.create = [] { return CreateBackend(BackendKind::kCuda, 0); };
  cuda.unavailable = NoDevice;
  // cuSOLVER's syevd / geqrf + orgqr and cuBLAS's float32 GEMMs (no TF32)
  // inside Newton-Schulz round differently from LAPACK and OpenBLAS, and no
  // GPU has measured by how much yet. These keep what the cuda tests
  // asserted before the suite existed: eigen reconstruction and
  // orthogonality within 1e-4, QR's Q within 1e-4 of LAPACK's, and
  // Newton-Schulz within 1e-4 of the cpu result, itself within 1e-4 of
  // float64, hence 2e-4 against float64. Tighten once measured.
  cuda.tolerances = {.eigen_float32 = 1e-4, .qr = 1e-4, .newton_schulz = 2e-4};
  return cuda;
}

INSTANTIATE_TEST_SUITE_P(Cuda, BackendConformanceTest,
                         ::testing::Values(CudaUnderTest()),
                         BackendUnderTestName);

// bf16 Newton-Schulz stores X, A = X X^T and B = b A + c A A in bfloat16 and
// accumulates in float32. A host emulation of exactly that on this file's
// shapes gives 1.1-1.6% relative Frobenius error against float64, and a GPU
// code review's emulation up to 2.15% on 1x17: the old 2e-2 was too tight.
// 4e-2 keeps about 2x headroom and still catches real faults (a wrong
// coefficient or a missing normalization is off by order 1).
constexpr double kBf16NsTol = 4e-2;
// cuBLAS float32 against OpenBLAS float32 (see CudaUnderTest).
constexpr double kFp32Tol = 1e-4;

absl::StatusOr<DeviceBuffer> Upload(Backend& backend,
                                    const std::vector<float>& host) {
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer buffer,
                           backend.Allocate(static_cast<int64_t>(host.size())));
  CANZONA_RETURN_IF_ERROR(backend.CopyFromHost(
      host.data(), static_cast<int64_t>(host.size()), buffer.data()));
  return buffer;
}

absl::StatusOr<std::vector<float>> Download(Backend& backend,
                                            const DeviceBuffer& buffer) {
  std::vector<float> host(static_cast<size_t>(buffer.size()));
  CANZONA_RETURN_IF_ERROR(
      backend.CopyToHost(buffer.data(), buffer.size(), host.data()));
  return host;
}

// Newton-Schulz of `spec` on `input` (batch x rows x cols), out of place or
// in place; returns the result.
absl::StatusOr<std::vector<float>> RunNewtonSchulz(
    Backend& backend, const NewtonSchulzSpec& spec, int64_t batch, int64_t rows,
    int64_t cols, const std::vector<float>& input, bool in_place) {
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer in, Upload(backend, input));
  CANZONA_ASSIGN_OR_RETURN(
      DeviceBuffer out,
      backend.Allocate(in_place ? 0 : static_cast<int64_t>(input.size())));
  const DeviceBuffer& result = in_place ? in : out;
  CANZONA_RETURN_IF_ERROR(
      backend.NewtonSchulz(spec, batch, rows, cols, in.data(), result.data()));
  return Download(backend, result);
}

// A cuda backend created while `variable` is set to `value` (the backend
// reads its switches at creation).
absl::StatusOr<std::unique_ptr<Backend>> CudaBackendWith(const char* variable,
                                                         const char* value) {
  ::setenv(variable, value, 1);
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      CreateBackend(BackendKind::kCuda, 0);
  ::unsetenv(variable);
  return backend;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_OK_AND_ASSIGN(cuda_, CreateBackend(BackendKind::kCuda, 0));
    ASSERT_OK_AND_ASSIGN(cpu_, CreateBackend(BackendKind::kCpu));
  }

  std::unique_ptr<Backend> cuda_;
  std::unique_ptr<Backend> cpu_;
};

TEST_F(CudaBackendTest, DescribesDevice) {
  EXPECT_EQ(cuda_->kind(), BackendKind::kCuda);
  EXPECT_THAT(cuda_->description(), StartsWith("cuda:0 ("));
  EXPECT_THAT(cuda_->description(), HasSubstr(", sm_"));
  EXPECT_NE(cuda_->native_stream(), nullptr);
}

// What the driver calls pageable (kernels/base/cuda_host_memory.h), and so
// what the cuda backend counts (Backend::pageable_copies,
// StepResponse.pageable_copies): plain host memory only, not memory it
// page-locked (cudaHostRegister, cudaMallocHost) nor its own device memory;
// a copy from or to pageable memory is counted once, a page-locked one not.
TEST_F(CudaBackendTest, CountsOnlyCopiesWithAPageableHostSide) {
  constexpr int64_t n = 1 << 16;
  std::vector<float> pageable = RandomNormal(n, 3);
  std::vector<float> registered = RandomNormal(n, 4);
  void* page_locked = nullptr;
  ASSERT_EQ(cudaMallocHost(&page_locked, n * sizeof(float)), cudaSuccess);
  auto* allocated = static_cast<float*>(page_locked);
  ASSERT_EQ(cudaHostRegister(registered.data(), n * sizeof(float),
                             cudaHostRegisterDefault),
            cudaSuccess);
  absl::Cleanup unlock = [&] {
    (void)cudaHostUnregister(registered.data());
    (void)cudaFreeHost(allocated);
  };
  ASSERT_OK_AND_ASSIGN(DeviceBuffer x, cuda_->Allocate(n));
  EXPECT_TRUE(CudaHostPageable(pageable.data()));
  EXPECT_FALSE(CudaHostPageable(registered.data()));
  EXPECT_FALSE(CudaHostPageable(allocated));
  EXPECT_FALSE(CudaHostPageable(x.data()));

  const int64_t before = cuda_->pageable_copies();
  ASSERT_OK(cuda_->CopyFromHost(registered.data(), n, x.data()));
  ASSERT_OK(cuda_->CopyToHost(x.data(), n, allocated));
  EXPECT_EQ(cuda_->pageable_copies(), before);
  ASSERT_OK(cuda_->CopyFromHost(pageable.data(), n, x.data()));
  ASSERT_OK(cuda_->EnqueueCopyToHost(x.data(), n, registered.data()));
  ASSERT_OK(cuda_->Synchronize());
  EXPECT_EQ(cuda_->pageable_copies(), before + 1);
  EXPECT_EQ(registered, pageable);  // the copies themselves moved the values
}

TEST_F(CudaBackendTest, RejectsBadDeviceIndex) {
  EXPECT_THAT(CreateCudaBackend(-1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("-1")));
  EXPECT_THAT(CreateCudaBackend(CudaDeviceCount()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("range")));
}

struct NsShape {
  int64_t batch;
  int64_t rows;
  int64_t cols;
};

void PrintTo(const NsShape& s, std::ostream* os) {
  *os << s.batch << "x" << s.rows << "x" << s.cols;
}
std::string NsShapeName(const ::testing::TestParamInfo<NsShape>& info) {
  return absl::StrCat(info.param.batch, "x", info.param.rows, "x",
                      info.param.cols);
}

// The largest shape from the Newton-Schulz benchmarks: a float64 reference
// would take seconds, so the cpu backend (itself checked against float64 on
// smaller shapes) is the reference here. 2 x 512 x 512 runs float32 SYRK
// per matrix of a batch (both symmetric products), which the smaller
// batched shapes elsewhere do not reach.
TEST_F(CudaBackendTest, LargeNewtonSchulzMatchesCpu) {
  for (const NsShape& s : {NsShape{1, 256, 1024}, NsShape{2, 512, 512}}) {
    SCOPED_TRACE(::testing::PrintToString(s));
    const std::vector<float> x = RandomNormal(s.batch * s.rows * s.cols, 100);
    const NewtonSchulzSpec spec = QuinticSpec();
    ASSERT_OK_AND_ASSIGN(
        std::vector<float> want,
        RunNewtonSchulz(*cpu_, spec, s.batch, s.rows, s.cols, x, false));
    ASSERT_OK_AND_ASSIGN(
        std::vector<float> got,
        RunNewtonSchulz(*cuda_, spec, s.batch, s.rows, s.cols, x, false));
    EXPECT_LE(RelativeError(got, ToDouble(want)), kFp32Tol);
  }
}

// ---- Newton-Schulz in bf16, and in place ------------------------------------

class CudaNewtonSchulzTest : public CudaBackendTest,
                             public ::testing::WithParamInterface<NsShape> {};

TEST_P(CudaNewtonSchulzTest, Bfloat16MatchesFloat64Reference) {
  const auto [batch, rows, cols] = GetParam();
  const int64_t per = rows * cols;
  const std::vector<float> x = RandomNormal(batch * per, 100);
  const NewtonSchulzSpec spec = QuinticSpec(NsPrecision::kBfloat16);
  ASSERT_OK_AND_ASSIGN(
      std::vector<float> got,
      RunNewtonSchulz(*cuda_, spec, batch, rows, cols, x, false));
  for (int64_t i = 0; i < batch; ++i) {
    const std::vector<float> in(x.begin() + i * per, x.begin() + (i + 1) * per);
    const std::vector<float> out(got.begin() + i * per,
                                 got.begin() + (i + 1) * per);
    EXPECT_LE(RelativeError(out, NewtonSchulzReference(spec, in, rows, cols)),
              kBf16NsTol)
        << "matrix " << i;
  }
}

// The Gram iteration, batched (one strided-batched call per product), at
// both precisions: fp32 within the fp32 tolerance of the float64 standard
// iteration; bf16 (R and Q float32, TF32 products) within the bf16 one.
TEST_P(CudaNewtonSchulzTest, GramMatchesFloat64Reference) {
  const auto [batch, rows, cols] = GetParam();
  const int64_t per = rows * cols;
  const std::vector<float> x = RandomNormal(batch * per, 102);
  for (NsPrecision precision :
       {NsPrecision::kFloat32, NsPrecision::kBfloat16}) {
    NewtonSchulzSpec spec = QuinticSpec(precision);
    spec.algorithm = NsAlgorithm::kGram;
    ASSERT_OK_AND_ASSIGN(
        std::vector<float> got,
        RunNewtonSchulz(*cuda_, spec, batch, rows, cols, x, false));
    for (int64_t i = 0; i < batch; ++i) {
      const std::vector<float> in(x.begin() + i * per,
                                  x.begin() + (i + 1) * per);
      const std::vector<float> out(got.begin() + i * per,
                                   got.begin() + (i + 1) * per);
      EXPECT_LE(RelativeError(out, NewtonSchulzReference(spec, in, rows, cols)),
                precision == NsPrecision::kFloat32 ? kFp32Tol : kBf16NsTol)
          << "matrix " << i
          << " bf16=" << (precision == NsPrecision::kBfloat16);
    }
  }
}

TEST_P(CudaNewtonSchulzTest, InPlaceEqualsOutOfPlace) {
  const auto [batch, rows, cols] = GetParam();
  const std::vector<float> x = RandomNormal(batch * rows * cols, 101);
  for (NsPrecision precision :
       {NsPrecision::kFloat32, NsPrecision::kBfloat16}) {
    const NewtonSchulzSpec spec = QuinticSpec(precision);
    ASSERT_OK_AND_ASSIGN(
        std::vector<float> out_of_place,
        RunNewtonSchulz(*cuda_, spec, batch, rows, cols, x, false));
    ASSERT_OK_AND_ASSIGN(
        std::vector<float> in_place,
        RunNewtonSchulz(*cuda_, spec, batch, rows, cols, x, true));
    // Same computation (and separate CUDA graphs: the key includes the
    // pointers); only the input buffer's alignment may change the norm's
    // summation order (float4 or scalar loads).
    EXPECT_LE(RelativeError(in_place, ToDouble(out_of_place)), 1e-6);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaNewtonSchulzTest,
    ::testing::Values(NsShape{1, 64, 64}, NsShape{3, 96, 160},
                      NsShape{2, 160, 96}, NsShape{1, 37, 53},
                      NsShape{4, 53, 37}, NsShape{1, 1, 17},
                      NsShape{1, 256, 1024}),
    NsShapeName);

// The bf16 standard iteration computes X X^T and A A by their lower tiles
// where the short side splits into tiles of 1024 or more
// (kernels/symmetric_tiles.h; the shapes above are too small and take full
// GEMMs): transposed (k = 2), batched (k = 3) and square (k = 4). Each must
// equal the full products it replaces (symmetric_products = false) up to
// bf16 rounding: a host emulation of both in bf16 put them 0.4-0.5% apart
// on these shapes, each ~1% from float32. The smallest is also checked
// against the cpu's float32 iteration, within the bf16 tolerance and no
// worse than the full products; the bundle's runner gives the cpu one BLAS
// thread, so the larger ones skip that reference (seconds each).
TEST_F(CudaBackendTest, Bfloat16SymmetricTilesMatchFullProducts) {
  for (const NsShape& s : {NsShape{1, 4096, 2048}, NsShape{2, 3072, 3072},
                           NsShape{1, 4096, 4096}}) {
    SCOPED_TRACE(::testing::PrintToString(s));
    const int64_t per = s.rows * s.cols;
    const std::vector<float> x = RandomNormal(s.batch * per, 103);
    NewtonSchulzSpec spec = QuinticSpec(NsPrecision::kBfloat16);
    ASSERT_OK_AND_ASSIGN(
        std::vector<float> tiled,
        RunNewtonSchulz(*cuda_, spec, s.batch, s.rows, s.cols, x, false));
    spec.symmetric_products = false;
    ASSERT_OK_AND_ASSIGN(
        std::vector<float> full,
        RunNewtonSchulz(*cuda_, spec, s.batch, s.rows, s.cols, x, false));
    std::vector<float> want;
    if (s.rows * s.cols <= 4096 * 2048) {
      ASSERT_OK_AND_ASSIGN(want, RunNewtonSchulz(*cpu_, QuinticSpec(), s.batch,
                                                 s.rows, s.cols, x, false));
    }
    for (int64_t i = 0; i < s.batch; ++i) {
      auto part = [&](const std::vector<float>& v) {
        return std::vector<float>(v.begin() + i * per,
                                  v.begin() + (i + 1) * per);
      };
      EXPECT_LE(RelativeError(part(tiled), ToDouble(part(full))), 2e-2)
          << "matrix " << i;
      if (want.empty()) continue;
      const Matrix reference = ToDouble(part(want));
      const double tiled_error = RelativeError(part(tiled), reference);
      const double full_error = RelativeError(part(full), reference);
      EXPECT_LE(tiled_error, kBf16NsTol) << "matrix " << i;
      EXPECT_LE(full_error, kBf16NsTol) << "matrix " << i;
      EXPECT_LE(tiled_error, 1.25 * full_error + 2e-3)
          << "matrix " << i << ": tiles " << tiled_error << ", full "
          << full_error;
    }
  }
}

// CANZONA_NS_SYMMETRIC=0 in the environment makes a backend run full
// products whatever the spec asks: the same bits as symmetric_products
// false on a backend without it.
TEST_F(CudaBackendTest, SymmetricProductsCanBeTurnedOffByTheEnvironment) {
  absl::StatusOr<std::unique_ptr<Backend>> off =
      CudaBackendWith("CANZONA_NS_SYMMETRIC", "0");
  ASSERT_OK(off);
  const int64_t rows = 4096, cols = 2048;
  const std::vector<float> x = RandomNormal(rows * cols, 104);
  NewtonSchulzSpec spec = QuinticSpec(NsPrecision::kBfloat16);
  ASSERT_OK_AND_ASSIGN(std::vector<float> refused,
                       RunNewtonSchulz(**off, spec, 1, rows, cols, x, false));
  spec.symmetric_products = false;
  ASSERT_OK_AND_ASSIGN(std::vector<float> full,
                       RunNewtonSchulz(*cuda_, spec, 1, rows, cols, x, false));
  EXPECT_EQ(refused, full);
}

// CUDA graphs: later calls on the same buffers replay the graph captured by
// the first; each must compute on the buffers' current contents, equal to
// a backend without graphs (CANZONA_CUDA_GRAPHS=0) and to the cpu backend.
TEST_F(CudaBackendTest, NewtonSchulzGraphReplaysSeeFreshData) {
  absl::StatusOr<std::unique_ptr<Backend>> eager =
      CudaBackendWith("CANZONA_CUDA_GRAPHS", "0");
  ASSERT_OK(eager);
  // 2048 x 2048: bf16 by symmetric tiles (pointer arrays written inside the
  // graph), fp32 by SYRK; 96 x 160: full GEMMs.
  for (const auto& [rows, cols] :
       {std::pair<int64_t, int64_t>{96, 160}, {2048, 2048}}) {
    const int64_t n = rows * cols;
    // The cpu's float32 result per round, shared by both precisions (one
    // BLAS thread in the bundle).
    std::vector<std::vector<float>> refs;
    ASSERT_OK_AND_ASSIGN(DeviceBuffer c, cpu_->Allocate(n));
    for (int round = 0; round < 3; ++round) {
      const std::vector<float> data = RandomNormal(n, 200 + round);
      const NewtonSchulzSpec fp32 = QuinticSpec(NsPrecision::kFloat32);
      ASSERT_OK(cpu_->CopyFromHost(data.data(), n, c.data()));
      ASSERT_OK(cpu_->NewtonSchulz(fp32, 1, rows, cols, c.data(), c.data()));
      ASSERT_OK_AND_ASSIGN(std::vector<float> ref, Download(*cpu_, c));
      refs.push_back(std::move(ref));
    }
    for (NsPrecision precision :
         {NsPrecision::kFloat32, NsPrecision::kBfloat16}) {
      SCOPED_TRACE(::testing::Message()
                   << rows << "x" << cols
                   << " bf16=" << (precision == NsPrecision::kBfloat16));
      const NewtonSchulzSpec spec = QuinticSpec(precision);
      ASSERT_OK_AND_ASSIGN(DeviceBuffer x, cuda_->Allocate(n));
      ASSERT_OK_AND_ASSIGN(DeviceBuffer y, (*eager)->Allocate(n));
      for (int round = 0; round < 3; ++round) {
        SCOPED_TRACE(::testing::Message() << "round " << round);
        const std::vector<float> data = RandomNormal(n, 200 + round);
        ASSERT_OK(cuda_->CopyFromHost(data.data(), n, x.data()));
        ASSERT_OK(cuda_->NewtonSchulz(spec, 1, rows, cols, x.data(), x.data()));
        ASSERT_OK((*eager)->CopyFromHost(data.data(), n, y.data()));
        ASSERT_OK(
            (*eager)->NewtonSchulz(spec, 1, rows, cols, y.data(), y.data()));
        ASSERT_OK_AND_ASSIGN(std::vector<float> got, Download(*cuda_, x));
        ASSERT_OK_AND_ASSIGN(std::vector<float> want, Download(**eager, y));
        EXPECT_LE(RelativeError(got, ToDouble(want)), 1e-6);
        EXPECT_LE(RelativeError(got, ToDouble(refs[round])),
                  precision == NsPrecision::kFloat32 ? kFp32Tol : kBf16NsTol);
      }
    }
  }
}

#if CANZONA_ENABLE_CUDA
// Holds `backend`'s stream on the device, as a wait for an event whose
// record does not come does (a trainer that died or hangs before it): a
// host function holds another stream, whose event the backend's waits
// for, until Release, or 20 s at most: a backend call that blocks inside
// CUDA behind it (the defect the tests look for) then fails its test
// instead of holding the binary until its limit.
class StreamBlocker {
 public:
  explicit StreamBlocker(Backend& backend) {
    EXPECT_EQ(cudaStreamCreateWithFlags(&other_, cudaStreamNonBlocking),
              cudaSuccess);
    EXPECT_EQ(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming),
              cudaSuccess);
    EXPECT_EQ(cudaLaunchHostFunc(
                  other_,
                  [](void* flag) {
                    const auto give_up = std::chrono::steady_clock::now() +
                                         std::chrono::seconds(20);
                    while (!static_cast<std::atomic<bool>*>(flag)->load() &&
                           std::chrono::steady_clock::now() < give_up) {
                      std::this_thread::sleep_for(std::chrono::milliseconds(1));
                    }
                  },
                  &release_),
              cudaSuccess);
    EXPECT_EQ(cudaEventRecord(event_, other_), cudaSuccess);
    auto* stream = static_cast<cudaStream_t>(backend.native_stream());
    EXPECT_EQ(cudaStreamWaitEvent(stream, event_, 0), cudaSuccess);
  }
  ~StreamBlocker() {
    Release();
    (void)cudaStreamSynchronize(other_);
    (void)cudaEventDestroy(event_);
    (void)cudaStreamDestroy(other_);
  }
  void Release() { release_ = true; }

 private:
  std::atomic<bool> release_{false};
  cudaStream_t other_ = nullptr;
  cudaEvent_t event_ = nullptr;
};

// Synchronizes `backend` until its stream finished (after a Release).
absl::Status SynchronizeOnceReleased(Backend& backend) {
  absl::Status synchronized;
  for (int i = 0; i < 500; ++i) {
    synchronized = backend.Synchronize();
    if (synchronized.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return synchronized;
}

// A wait with a timeout on a blocked stream ends by it with
// DEADLINE_EXCEEDED, SumSquaresMany's included (it once returned success
// with sums it never read); later waits fail at once instead of waiting
// again; once the record comes the next wait finds the stream finished and
// the sums are right.
TEST_F(CudaBackendTest, WaitsEndAtTheirTimeoutOnAStreamThatDoesNotFinish) {
  constexpr int64_t n = 4096;
  const std::vector<float> data = RandomNormal(n, 7);
  double want = 0;
  for (float v : data) want += static_cast<double>(v) * v;
  ASSERT_OK_AND_ASSIGN(DeviceBuffer x, cuda_->Allocate(n));
  ASSERT_OK(cuda_->CopyFromHost(data.data(), n, x.data()));
  StreamBlocker blocker(*cuda_);
  const std::vector<const float*> xs = {x.data(), x.data()};
  const std::vector<int64_t> ns = {n, n};
  std::vector<double> sums(2, -1);
  {
    const absl::Duration timeout = absl::Seconds(1);
    ScopedWaitTimeout scope(*cuda_, timeout);
    const absl::Time start = absl::Now();
    EXPECT_THAT(cuda_->SumSquaresMany(xs, ns, absl::MakeSpan(sums)),
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         HasSubstr("SumSquaresMany")));
    EXPECT_GE(absl::Now() - start, timeout);
    EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(2));
    EXPECT_TRUE(cuda_->stalled());
    const absl::Time again = absl::Now();
    EXPECT_THAT(cuda_->Synchronize(),
                StatusIs(absl::StatusCode::kFailedPrecondition));
    EXPECT_LT(absl::Now() - again, timeout);
  }
  blocker.Release();
  ASSERT_OK(SynchronizeOnceReleased(*cuda_));
  EXPECT_FALSE(cuda_->stalled());
  ASSERT_OK(cuda_->SumSquaresMany(xs, ns, absl::MakeSpan(sums)));
  EXPECT_NEAR(sums[0], want, 1e-9 * want);
  EXPECT_EQ(sums[1], sums[0]);
}

// A copy between the device and pageable host memory waits inside
// cudaMemcpyAsync for the stream's work, without a bound (into pageable
// memory until the copy is done): behind a blocked stream, for good. Each
// copy form waits for the stream first, within the timeout, and ends with
// DEADLINE_EXCEEDED naming it (the enqueued forms once hung here); the
// stand-in for a GPU models the same (CpuAsDeviceTest.
// PageableCopiesWaitForTheWorkAheadOfThemWithinTheTimeout).
TEST_F(CudaBackendTest,
       PageableCopiesEndAtTheirTimeoutOnAStreamThatDoesNotFinish) {
  constexpr int64_t n = 1024;
  ASSERT_OK_AND_ASSIGN(DeviceBuffer x, cuda_->Allocate(n));
  std::vector<float> pageable = RandomNormal(n, 8);
  ASSERT_TRUE(CudaHostPageable(pageable.data()));
  const struct {
    const char* method;
    std::function<absl::Status()> copy;
  } copies[] = {
      {"EnqueueCopyToHost",
       [&] { return cuda_->EnqueueCopyToHost(x.data(), n, pageable.data()); }},
      {"EnqueueCopyFromHost",
       [&] {
         return cuda_->EnqueueCopyFromHost(pageable.data(), n, x.data());
       }},
      {"CopyToHost",
       [&] { return cuda_->CopyToHost(x.data(), n, pageable.data()); }},
      {"CopyFromHost",
       [&] { return cuda_->CopyFromHost(pageable.data(), n, x.data()); }},
  };
  for (const auto& c : copies) {
    SCOPED_TRACE(c.method);
    StreamBlocker blocker(*cuda_);
    {
      const absl::Duration timeout = absl::Seconds(1);
      ScopedWaitTimeout scope(*cuda_, timeout);
      const absl::Time start = absl::Now();
      EXPECT_THAT(c.copy(), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                     HasSubstr(c.method)));
      EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(2));
      EXPECT_TRUE(cuda_->stalled());
    }
    blocker.Release();
    ASSERT_OK(SynchronizeOnceReleased(*cuda_));
    EXPECT_FALSE(cuda_->stalled());
  }
}
#endif  // CANZONA_ENABLE_CUDA

}  // namespace
}  // namespace canzona
