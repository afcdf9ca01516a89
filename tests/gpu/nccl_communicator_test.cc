// The NCCL communicator on real devices against float64 CPU references on
// random data: world size 1 on device 0, and 2 ranks on devices 0 and 1
// (both uneven-count strategies, in-place forms, the grouped teardown, a
// missing peer's timeout before and after the ranks connected, Abort from
// another thread while a rank waits for a peer that never comes).
// NCCL does not allow two ranks of one communicator on the same device
// (ncclCommInitRank fails with "Duplicate GPU detected"), so the 2-rank
// cases skip on a machine with one GPU. Every test skips when no CUDA device
// is usable or the build has no CUDA.
#include "server/comm/nccl_communicator.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/comm/nccl_api.h"
#include "server/control/kv_store.h"
#include "tests/matchers/status_matchers.h"

#ifdef CANZONA_ENABLE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace canzona {

// Failure messages print the strategy's name.
inline void PrintTo(NcclUneven strategy, std::ostream* os) {
  *os << NcclUnevenName(strategy);
}

namespace {

#ifndef CANZONA_ENABLE_CUDA

TEST(NcclGpuTest, NeedsCuda) {
  GTEST_SKIP() << "built without CUDA (CANZONA_ENABLE_CUDA=OFF)";
}

#else

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

#define CANZONA_SKIP_UNLESS_DEVICES(n)                                     \
  do {                                                                     \
    const int have = DeviceCount();                                        \
    if (have < (n)) {                                                      \
      GTEST_SKIP() << "needs " << (n) << " CUDA device(s), found " << have \
                   << ((n) > 1 ? " (NCCL allows one rank per device in a " \
                                 "communicator)"                           \
                               : "");                                      \
    }                                                                      \
  } while (false)

// Device memory of `n` floats on `device`, freed on destruction.
class DeviceFloats {
 public:
  DeviceFloats(int device, int64_t n) : device_(device), n_(n) {
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<int64_t>(n, 1) * sizeof(float)),
              cudaSuccess);
  }
  ~DeviceFloats() {
    cudaSetDevice(device_);
    cudaFree(ptr_);
  }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;

  float* get() { return static_cast<float*>(ptr_); }
  void Upload(const std::vector<float>& v, int64_t at = 0) {
    cudaSetDevice(device_);
    ASSERT_EQ(cudaMemcpy(get() + at, v.data(), v.size() * sizeof(float),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<float> Download(int64_t n, int64_t at = 0) {
    std::vector<float> v(n);
    cudaSetDevice(device_);
    EXPECT_EQ(cudaMemcpy(v.data(), get() + at, n * sizeof(float),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return v;
  }

 private:
  int device_;
  int64_t n_;
  void* ptr_ = nullptr;
};

// A stream on `device`, destroyed with the object.
class Stream {
 public:
  explicit Stream(int device) : device_(device) {
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
              cudaSuccess);
  }
  ~Stream() {
    cudaSetDevice(device_);
    cudaStreamDestroy(stream_);
  }
  cudaStream_t get() const { return stream_; }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
};

std::vector<float> Random(std::mt19937& rng, int64_t n) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

int64_t Sum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

void ExpectNear64(const std::vector<float>& got,
                  const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-5 * (1.0 + std::fabs(want[i])))
        << what << " at " << i;
  }
}

NcclOptions Forced(NcclUneven strategy, absl::Duration timeout) {
  NcclOptions options;
  options.timeout = timeout;
  options.chooser = [strategy](absl::Span<const int64_t>) { return strategy; };
  // The largest padded collective (2 x 1029) and staged output (4096) below.
  options.scratch_floats = 2 * 4096;
  return options;
}

TEST(NcclGpuTest, WorldSizeOne) {
  CANZONA_SKIP_UNLESS_DEVICES(1);
  ASSERT_OK_AND_ASSIGN(NcclApi * api, RealNcclApi());
  Stream stream(0);
  InMemoryKvStore store;
  ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<Communicator> comm,
      CreateNcclCommunicator(&store, "gpu/size1", api,
                             {.rank = 0, .device = 0, .stream = stream.get()},
                             1, NcclOptions{}));
  std::mt19937 rng(5);
  const int64_t n = 1000;
  std::vector<float> x = Random(rng, n);
  std::vector<double> x64(x.begin(), x.end());
  DeviceFloats a(0, n), b(0, n);
  a.Upload(x);
  ASSERT_OK(comm->ReduceScatterV(a.get(), {n}, b.get()));
  ExpectNear64(b.Download(n), x64, "ReduceScatterV");
  ASSERT_OK(comm->ReduceScatterV(a.get(), {n}, a.get()));  // in place
  ExpectNear64(a.Download(n), x64, "in-place ReduceScatterV");
  ASSERT_OK(comm->AllGatherV(a.get(), {n}, b.get()));
  ExpectNear64(b.Download(n), x64, "AllGatherV");
  ASSERT_OK(comm->AllToAllV(a.get(), {n}, b.get(), {n}));
  ExpectNear64(b.Download(n), x64, "AllToAllV");
  ASSERT_OK(comm->AllReduce(b.get(), n));
  ExpectNear64(b.Download(n), x64, "AllReduce");
  ASSERT_OK(comm->Broadcast(b.get(), n, 0));
  ASSERT_OK(comm->Barrier());
  ExpectNear64(b.Download(n), x64, "Broadcast");
}

class NcclGpuTwoRankTest : public ::testing::TestWithParam<NcclUneven> {};

TEST_P(NcclGpuTwoRankTest, CollectivesMatchFloat64References) {
  CANZONA_SKIP_UNLESS_DEVICES(2);
  ASSERT_OK_AND_ASSIGN(NcclApi * api, RealNcclApi());
  constexpr int kSize = 2;
  Stream s0(0), s1(1);
  InMemoryKvStore store;
  const std::vector<NcclLocalRank> locals = {
      {.rank = 0, .device = 0, .stream = s0.get()},
      {.rank = 1, .device = 1, .stream = s1.get()}};
  ASSERT_OK_AND_ASSIGN(
      std::vector<std::unique_ptr<Communicator> > comms,
      CreateNcclCommunicators(
          &store, absl::StrCat("gpu/two/", static_cast<int>(GetParam())), api,
          locals, kSize, Forced(GetParam(), absl::Seconds(60))));

  std::mt19937 rng(11);
  const std::vector<std::vector<int64_t> > cases = {
      {1000, 0}, {0, 777}, {513, 1029}, {4096, 4096}};
  for (const std::vector<int64_t>& counts : cases) {
    const int64_t total = Sum(counts);
    std::vector<std::vector<float> > send(kSize);
    for (int r = 0; r < kSize; ++r) send[r] = Random(rng, total);
    std::vector<std::vector<int64_t> > a2a = {{3, 250}, {17, 0}};
    std::vector<std::vector<float> > a2a_send(kSize);
    for (int r = 0; r < kSize; ++r) a2a_send[r] = Random(rng, Sum(a2a[r]));
    std::vector<std::vector<float> > rs(kSize), rs_inplace(kSize), ag(kSize),
        a2a_out(kSize), ar(kSize);
    std::vector<std::vector<float> > ar_in(kSize);
    for (int r = 0; r < kSize; ++r) ar_in[r] = Random(rng, 999);

    std::vector<std::thread> threads;
    for (int r = 0; r < kSize; ++r) {
      threads.emplace_back([&, r] {
        Communicator* c = comms[r].get();
        DeviceFloats d_send(r, total), d_recv(r, counts[r]), d_all(r, total),
            d_inplace(r, total);
        d_send.Upload(send[r]);
        d_inplace.Upload(send[r]);
        ASSERT_OK(c->ReduceScatterV(d_send.get(), counts, d_recv.get()));
        rs[r] = d_recv.Download(counts[r]);
        ASSERT_OK(c->ReduceScatterV(d_inplace.get(), counts, d_inplace.get()));
        rs_inplace[r] = d_inplace.Download(counts[r]);
        ASSERT_OK(c->AllGatherV(d_recv.get(), counts, d_all.get()));
        ag[r] = d_all.Download(total);
        std::vector<int64_t> recv_counts = {a2a[0][r], a2a[1][r]};
        DeviceFloats d_a2a(r, Sum(a2a[r])), d_a2a_out(r, Sum(recv_counts));
        d_a2a.Upload(a2a_send[r]);
        ASSERT_OK(
            c->AllToAllV(d_a2a.get(), a2a[r], d_a2a_out.get(), recv_counts));
        a2a_out[r] = d_a2a_out.Download(Sum(recv_counts));
        DeviceFloats d_ar(r, 999);
        d_ar.Upload(ar_in[r]);
        ASSERT_OK(c->AllReduce(d_ar.get(), 999));
        ar[r] = d_ar.Download(999);
        ASSERT_OK(c->Barrier());
      });
    }
    for (auto& t : threads) t.join();

    std::vector<double> full;
    for (int r = 0; r < kSize; ++r) {
      int64_t off = r == 0 ? 0 : counts[0];
      std::vector<double> want(counts[r], 0.0);
      for (int q = 0; q < kSize; ++q) {
        for (int64_t i = 0; i < counts[r]; ++i) want[i] += send[q][off + i];
      }
      ExpectNear64(rs[r], want, "ReduceScatterV");
      ExpectNear64(rs_inplace[r], want, "in-place ReduceScatterV");
      full.insert(full.end(), want.begin(), want.end());
    }
    for (int r = 0; r < kSize; ++r) {
      ExpectNear64(ag[r], full, "AllGatherV");
      std::vector<double> want_a2a;
      for (int i = 0; i < kSize; ++i) {
        int64_t off = r == 0 ? 0 : a2a[i][0];
        for (int64_t k = 0; k < a2a[i][r]; ++k) {
          want_a2a.push_back(a2a_send[i][off + k]);
        }
      }
      ExpectNear64(a2a_out[r], want_a2a, "AllToAllV");
      std::vector<double> sum(999, 0.0);
      for (int q = 0; q < kSize; ++q) {
        for (int i = 0; i < 999; ++i) sum[i] += ar_in[q][i];
      }
      ExpectNear64(ar[r], sum, "AllReduce");
    }
  }
  // Both local ranks' communicators finalize inside one group.
  EXPECT_OK(DestroyNcclCommunicators(std::move(comms)));
}

INSTANTIATE_TEST_SUITE_P(Strategies, NcclGpuTwoRankTest,
                         ::testing::Values(NcclUneven::kPerRoot,
                                           NcclUneven::kPadded),
                         [](const auto& info) {
                           return std::string(NcclUnevenName(info.param));
                         });

// Two local ranks of a fresh group, with `timeout`.
absl::StatusOr<std::vector<std::unique_ptr<Communicator> > > TwoRanks(
    NcclApi* api, InMemoryKvStore& store, const std::string& prefix,
    const Stream& s0, const Stream& s1, absl::Duration timeout) {
  const std::vector<NcclLocalRank> locals = {
      {.rank = 0, .device = 0, .stream = s0.get()},
      {.rank = 1, .device = 1, .stream = s1.get()}};
  NcclOptions options;
  options.timeout = timeout;
  return CreateNcclCommunicators(&store, prefix, api, locals, 2, options);
}

TEST(NcclGpuTest, MissingPeerAtTheFirstCollectiveTimesOut) {
  CANZONA_SKIP_UNLESS_DEVICES(2);
  ASSERT_OK_AND_ASSIGN(NcclApi * api, RealNcclApi());
  Stream s0(0), s1(1);
  InMemoryKvStore store;
  const absl::Duration timeout = absl::Seconds(2);
  ASSERT_OK_AND_ASSIGN(std::vector<std::unique_ptr<Communicator> > comms,
                       TwoRanks(api, store, "gpu/first", s0, s1, timeout));
  DeviceFloats d(0, 64);
  // Rank 1 never joins: the non-blocking launch of rank 0's first
  // collective connects lazily and never finishes.
  const absl::Time start = absl::Now();
  EXPECT_THAT(
      comms[0]->AllReduce(d.get(), 64),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("AllReduce")));
  EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(5));
  EXPECT_THAT(comms[0]->Barrier(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  comms[1]->Abort();
  EXPECT_OK(DestroyNcclCommunicators(std::move(comms)));
}

TEST(NcclGpuTest, MissingPeerAfterConnectingTimesOut) {
  CANZONA_SKIP_UNLESS_DEVICES(2);
  ASSERT_OK_AND_ASSIGN(NcclApi * api, RealNcclApi());
  Stream s0(0), s1(1);
  InMemoryKvStore store;
  const absl::Duration timeout = absl::Seconds(2);
  ASSERT_OK_AND_ASSIGN(std::vector<std::unique_ptr<Communicator> > comms,
                       TwoRanks(api, store, "gpu/timeout", s0, s1, timeout));
  DeviceFloats d(0, 64), e(1, 64);
  // Both ranks once, so that NCCL has connected the ring: then the missing
  // peer shows in the kernel, not in the launch.
  std::thread peer([&] { EXPECT_OK(comms[1]->AllReduce(e.get(), 64)); });
  ASSERT_OK(comms[0]->AllReduce(d.get(), 64));
  peer.join();
  // Rank 1 never joins this all-reduce.
  const absl::Time start = absl::Now();
  EXPECT_THAT(
      comms[0]->AllReduce(d.get(), 64),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("AllReduce")));
  EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(5));
  EXPECT_THAT(comms[0]->Barrier(),
              StatusIs(absl::StatusCode::kFailedPrecondition));
  comms[1]->Abort();
  EXPECT_OK(DestroyNcclCommunicators(std::move(comms)));
}

TEST(NcclGpuTest, AbortFromAnotherThreadIsPromptWhileWaitingForAPeer) {
  CANZONA_SKIP_UNLESS_DEVICES(2);
  ASSERT_OK_AND_ASSIGN(NcclApi * api, RealNcclApi());
  Stream s0(0), s1(1);
  InMemoryKvStore store;
  const absl::Duration timeout = absl::Seconds(60);
  ASSERT_OK_AND_ASSIGN(std::vector<std::unique_ptr<Communicator> > comms,
                       TwoRanks(api, store, "gpu/abort", s0, s1, timeout));
  DeviceFloats d(0, 64);
  const absl::Time start = absl::Now();
  absl::Status result;
  std::thread waiting([&] { result = comms[0]->AllReduce(d.get(), 64); });
  absl::SleepFor(absl::Milliseconds(500));  // inside the wait for rank 1
  const absl::Time abort_start = absl::Now();
  comms[0]->Abort();
  const absl::Duration abort_took = absl::Now() - abort_start;
  waiting.join();
  EXPECT_LT(abort_took, absl::Seconds(2));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_THAT(result,
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("aborted")));
  comms[1]->Abort();
  EXPECT_OK(DestroyNcclCommunicators(std::move(comms)));
}

#endif  // CANZONA_ENABLE_CUDA

}  // namespace
}  // namespace canzona
