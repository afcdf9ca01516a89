// The conformance suite's range checks (kernels/allocation_registry.h):
// every entry point rejects a range that leaves its allocation, before it
// touches anything, on every backend; device-memory backends (cuda, and the
// cpu backend standing in for a GPU) also reject kernel arguments outside
// their allocations and registered memory, and host arguments inside them.
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/matchers/status_matchers.h"
#include "tests/unit/kernels/backend_conformance.h"
#include "tests/unit/kernels/backend_reference.h"

namespace canzona {
namespace {

using ::canzona::backend_reference::QuinticSpec;
using ::canzona::backend_reference::RandomNormal;
using ::canzona::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

::testing::Matcher<absl::Status> Rejected(const std::string& what,
                                          const std::string& why) {
  return StatusIs(absl::StatusCode::kInvalidArgument,
                  AllOf(HasSubstr(what), HasSubstr(why)));
}

// The world sum that failed on the first GPU run: five floats into a buffer
// of four, through every kind of entry point. Each call is refused before
// it writes, whatever the backend's allocator pads.
TEST_P(BackendConformanceTest, RangesThatLeaveTheirAllocationAreRefused) {
  const std::vector<float> four = RandomNormal(4, 11);
  const std::vector<float> eight = RandomNormal(8, 12);
  DeviceBuffer buf = Upload(four);
  DeviceBuffer big = Upload(eight);
  float* p = buf.data();
  float* q = big.data();
  std::vector<float> host(8, 1.0f);
  const Transpose kN = Transpose::kNo;
  const std::string past = "runs 4 bytes past the end of its allocation";
  Backend& b = *backend_;

  EXPECT_THAT(b.CopyFromHost(host.data(), 5, p),
              Rejected("CopyFromHost: dst [0x", past));
  EXPECT_THAT(b.CopyFromHost(host.data(), 5, p), Rejected("", "Allocate(4)"));
  EXPECT_THAT(b.CopyToHost(p, 5, host.data()),
              Rejected("CopyToHost: src", past));
  EXPECT_THAT(b.Copy(q, 5, p), Rejected("Copy: dst", past));
  EXPECT_THAT(b.Copy(p, 5, q), Rejected("Copy: src", past));
  EXPECT_THAT(b.Fill(1.0f, 5, p), Rejected("Fill: dst", past));
  // Strided rows: 2 x 2 with a leading dimension of 3 spans 5 floats.
  EXPECT_THAT(b.Copy2D(2, 2, q, 2, p, 3), Rejected("Copy2D: dst", past));
  // C = 1 x 5 from A (1 x 1) and B (1 x 5).
  EXPECT_THAT(b.Gemm(kN, kN, 1, 5, 1, 1.0f, q, 1, q, 5, 0.0f, p, 5),
              Rejected("Gemm: c", past));
  EXPECT_THAT(b.GemmStridedBatched(kN, kN, 1, 2, 1, 1.0f, q, 1, 1, q, 2, 2,
                                   0.0f, p, 2, 3, 2),
              Rejected("GemmStridedBatched: c", past));
  EXPECT_THAT(b.Syrk(kN, 2, 3, 1.0f, q, 3, 0.0f, p + 1, 2),
              Rejected("Syrk: c", "runs 4 bytes past"));
  EXPECT_THAT(b.NewtonSchulz(QuinticSpec(), 1, 1, 5, q, p),
              Rejected("NewtonSchulz: output", past));
  EXPECT_THAT(b.Lerp(5, q, q, 0.5f, p), Rejected("Lerp: out", past));
  EXPECT_THAT(b.AdamWStep(5, 0.1f, 0.9f, 0.99f, 1e-8f, 0.0f, 1, q, p, q, q),
              Rejected("AdamWStep: p", past));
  EXPECT_THAT(b.SumSquares(5, p).status(), Rejected("SumSquares: x", past));
  EXPECT_THAT(b.AllFinite(5, p).status(), Rejected("AllFinite: x", past));
  EXPECT_THAT(b.Transpose2D(1, 5, q, p), Rejected("Transpose2D: dst", past));
  EXPECT_THAT(b.LiftedPower(5, q, 1e-6, -0.25, p),
              Rejected("LiftedPower: out", past));

  // Nothing was written: the buffer still holds its four floats.
  EXPECT_EQ(Download(buf), four);
  EXPECT_EQ(Download(big), eight);
}

// Overlaps a GPU leaves undefined, refused on every backend (the cpu's
// loops would happen to work): a copy between partly overlapping ranges,
// a GEMM whose C aliases A or B, a batch whose C matrices overlap.
TEST_P(BackendConformanceTest, OverlapsAGpuLeavesUndefinedAreRefused) {
  const std::vector<float> values = RandomNormal(16, 21);
  DeviceBuffer buf = Upload(values);
  float* p = buf.data();
  const Transpose kN = Transpose::kNo;
  Backend& b = *backend_;
  EXPECT_THAT(b.Copy(p, 8, p + 4), Rejected("Copy: src", "overlap"));
  EXPECT_THAT(b.Copy(p + 4, 8, p), Rejected("Copy: src", "overlap"));
  EXPECT_THAT(b.Copy2D(2, 4, p, 4, p + 2, 4), Rejected("Copy2D: src", "overlap"));
  // C (2 x 2 at p + 2) over A (2 x 2 at p, ld 2).
  EXPECT_THAT(b.Gemm(kN, kN, 2, 2, 2, 1.0f, p, 2, p + 8, 2, 0.0f, p + 2, 2),
              Rejected("Gemm: c", "may not alias its inputs"));
  EXPECT_THAT(b.Gemm(kN, kN, 2, 2, 2, 1.0f, p + 8, 2, p, 2, 0.0f, p, 2),
              Rejected("Gemm: c", "may not alias its inputs"));
  // Two 2 x 2 outputs 2 floats apart.
  EXPECT_THAT(b.GemmStridedBatched(kN, kN, 2, 2, 1, 1.0f, p, 1, 2, p + 4, 2, 2,
                                   0.0f, p + 8, 2, 2, 2),
              Rejected("GemmStridedBatched: stride_c 2", "spans overlap"));
  // Permutations and transposes in place (a kernel reading what it writes).
  EXPECT_THAT(b.Transpose2D(2, 2, p, p),
              Rejected("Transpose2D: src", "overlap"));
  EXPECT_THAT(b.SortColumns(2, 2, p + 12, p, p + 2),
              Rejected("SortColumns: src", "overlap"));
  EXPECT_THAT(b.SortRows(2, 2, p + 12, p + 2, p),
              Rejected("SortRows: src", "overlap"));
  EXPECT_THAT(b.LiftedPower(4, p, 1e-6, -0.25, p + 1),
              Rejected("LiftedPower: x", "overlap"));
  // Elementwise kernels write an operand over another one only element
  // for element: shifted by one, a GPU thread reads what another wrote.
  EXPECT_THAT(b.Lerp(4, p, p + 8, 0.5f, p + 1),
              Rejected("Lerp: a", "overlap"));
  EXPECT_THAT(b.NesterovMomentum(4, 0.9f, p, p + 8, p + 9),
              Rejected("NesterovMomentum: momentum", "overlap"));
  EXPECT_THAT(b.Axpby(4, 1.0f, p + 1, 1.0f, p),
              Rejected("Axpby: x", "overlap"));
  EXPECT_THAT(b.EmaSquare(4, 0.9f, 0.1f, p + 3, p),
              Rejected("EmaSquare: g", "overlap"));
  EXPECT_THAT(b.AdamDirection(4, p, 1.0f, p + 8, 1.0f, 1e-8f, p + 10),
              Rejected("AdamDirection: v", "overlap"));
  EXPECT_THAT(b.AdamWStep(4, 0.1f, 0.9f, 0.99f, 1e-8f, 0.0f, 1, p, p + 4,
                          p + 8, p + 10),
              Rejected("AdamWStep: m", "overlap"));
  EXPECT_THAT(b.AdamWStepMany({{4, p, p + 4, p + 6, p + 12}}, 0.1f, 0.9f,
                              0.99f, 1e-8f, 0.0f, 1),
              Rejected("AdamWStepMany: tensors[0].p", "overlap"));
  // Nothing was written.
  EXPECT_EQ(Download(buf), values);
  // Disjoint ranges of one buffer, and a copy onto itself, are fine.
  EXPECT_OK(b.Copy(p, 4, p + 4));
  EXPECT_OK(b.Copy(p, 8, p));
  EXPECT_OK(b.Copy2D(2, 2, p, 4, p + 2, 4));
  EXPECT_OK(b.Copy2D(2, 4, p, 4, p, 4));
  // The same operand twice is element for element; inputs may overlap.
  EXPECT_OK(b.Lerp(4, p + 8, p, 0.5f, p + 8));
  EXPECT_OK(b.Lerp(4, p, p + 1, 0.5f, p + 8));
  EXPECT_OK(b.AdamDirection(4, p, 1.0f, p + 1, 1.0f, 1e-8f, p + 8));
}

// What a device's driver enforces, on every device-memory backend: kernels
// and device copies touch its live allocations and registered memory only,
// and the host side of a copy is never one of them.
TEST_P(BackendConformanceTest, DeviceMemoryRulesHoldOnDeviceBackends) {
  if (backend_->memory_space() != MemorySpace::kDevice) {
    GTEST_SKIP() << GetParam().name << " works on host memory";
  }
  Backend& b = *backend_;
  DeviceBuffer buf = Upload(RandomNormal(16, 21));
  std::vector<float> host(16, 2.0f);
  EXPECT_THAT(b.Fill(1.0f, 4, host.data()),
              Rejected("Fill: dst", "lies in no live allocation"));
  EXPECT_THAT(b.CopyToHost(host.data(), 4, host.data() + 8),
              Rejected("CopyToHost: src", "lies in no live allocation"));
  // The wrong direction: device memory as the host side.
  EXPECT_THAT(
      b.CopyFromHost(buf.data(), 4, buf.data() + 8),
      Rejected("CopyFromHost: host", "must be memory outside the backend"));
  EXPECT_THAT(
      b.CopyToHost(buf.data(), 4, buf.data() + 8),
      Rejected("CopyToHost: host", "must be memory outside the backend"));

  // A freed buffer's range is refused from then on.
  float* freed = nullptr;
  {
    DeviceBuffer gone = Zeros(16);
    freed = gone.data();
  }
  EXPECT_THAT(b.Fill(1.0f, 4, freed),
              Rejected("Fill: dst", "lies in no live allocation"));

  // Memory of another backend on the same device (what a trainer's CUDA
  // IPC buffer is to the daemon) is usable only while registered.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> other, GetParam().create());
  ASSERT_OK_AND_ASSIGN(DeviceBuffer foreign, other->Allocate(16));
  EXPECT_THAT(b.Fill(3.0f, 16, foreign.data()),
              Rejected("Fill: dst", "lies in no live allocation"));
  {
    ASSERT_OK_AND_ASSIGN(
        RegisteredMemory registered,
        b.RegisterMemory(foreign.data(), 16 * sizeof(float), "foreign"));
    EXPECT_OK(b.Fill(3.0f, 16, foreign.data()));
    EXPECT_THAT(b.Fill(3.0f, 17, foreign.data()),
                Rejected("Fill: dst", "past the end of its allocation"));
    EXPECT_THAT(
        b.RegisterMemory(foreign.data() + 4, 4, "twice").status(),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overlaps")));
    ASSERT_OK(b.Synchronize());
  }
  EXPECT_THAT(b.Fill(3.0f, 16, foreign.data()),
              Rejected("Fill: dst", "lies in no live allocation"));
  std::vector<float> filled(16);
  ASSERT_OK(other->CopyToHost(foreign.data(), 16, filled.data()));
  EXPECT_EQ(filled, std::vector<float>(16, 3.0f));
}

// Host-memory backends take any host memory, but a range still may not run
// into an allocation or registered memory from outside it.
TEST_P(BackendConformanceTest, HostMemoryRangesMayNotRunIntoAnAllocation) {
  if (backend_->memory_space() != MemorySpace::kHost) {
    GTEST_SKIP() << GetParam().name << " works on device memory";
  }
  Backend& b = *backend_;
  std::vector<float> host(16, 2.0f);
  EXPECT_OK(b.Fill(1.0f, 16, host.data()));
  ASSERT_OK_AND_ASSIGN(
      RegisteredMemory registered,
      b.RegisterMemory(host.data() + 8, 8 * sizeof(float), "upper half"));
  EXPECT_OK(b.Fill(1.0f, 8, host.data()));
  EXPECT_THAT(b.Fill(1.0f, 12, host.data()),
              Rejected("Fill: dst", "runs into the allocation"));
  EXPECT_THAT(b.Fill(1.0f, 12, host.data()), Rejected("", "(upper half)"));
}

}  // namespace
}  // namespace canzona
