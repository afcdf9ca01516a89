// The Gloo communicator across real processes: one forked child per rank,
// rendezvous through a FileKvStore in a temporary directory. Children report
// through their exit code (and stderr), never through gtest, and leave with
// _exit so nothing of the parent's test state runs twice.
#include <signal.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/comm/communicator.h"
#include "server/comm/gloo_communicator.h"
#include "tests/unit/comm/comm_test_util.h"
#include "tests/unit/comm/file_kv_store.h"

namespace canzona::testing {
namespace {

constexpr absl::Duration kWaitForChildren = absl::Seconds(20);

class TempDir {
 public:
  TempDir() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "canzona_comm_XXXXXX")
            .string();
    path_ = mkdtemp(pattern.data()) != nullptr ? pattern : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Forks one child per rank running body(rank) (its return value is the exit
// code) and waits for all of them, killing any still running at the
// deadline. Returns the exit codes (-1: killed / abnormal).
std::vector<int> RunProcesses(int size, const std::function<int(int)>& body) {
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int code = 100;
      try {
        code = body(r);
      } catch (...) {
        std::fprintf(stderr, "rank %d: exception escaped\n", r);
      }
      std::fflush(stderr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  std::vector<int> codes(size, -1);
  std::vector<bool> done(size, false);
  const absl::Time deadline = absl::Now() + kWaitForChildren;
  int remaining = size;
  while (remaining > 0 && absl::Now() < deadline) {
    for (int r = 0; r < size; ++r) {
      if (done[r] || pids[r] < 0) continue;
      int wstatus = 0;
      if (waitpid(pids[r], &wstatus, WNOHANG) == pids[r]) {
        done[r] = true;
        --remaining;
        codes[r] = WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : -1;
      }
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  for (int r = 0; r < size; ++r) {
    if (!done[r] && pids[r] > 0) {
      kill(pids[r], SIGKILL);
      waitpid(pids[r], nullptr, 0);
    }
  }
  return codes;
}

// In a child: prints and returns 1 when `ok` is false.
#define CHILD_CHECK(ok, rank, what)                                 \
  do {                                                              \
    if (!(ok)) {                                                    \
      std::fprintf(stderr, "rank %d: %s failed\n", (rank), (what)); \
      return 1;                                                     \
    }                                                               \
  } while (false)

#define CHILD_CHECK_OK(expr, rank)                    \
  do {                                                \
    absl::Status child_status_ = (expr);              \
    if (!child_status_.ok()) {                        \
      std::fprintf(stderr, "rank %d: %s\n", (rank),   \
                   child_status_.ToString().c_str()); \
      return 1;                                       \
    }                                                 \
  } while (false)

TEST(GlooMultiProcessTest, EveryCollectiveAcrossProcesses) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  constexpr int kSize = 3;
  // Every child regenerates all ranks' inputs from the same seed, so each
  // can compute the expected result on its own.
  const unsigned seed = std::random_device{}();
  std::vector<int> codes = RunProcesses(kSize, [&](int rank) -> int {
    FileKvStore store(dir.path());
    GlooOptions options;
    options.timeout = absl::Seconds(10);
    absl::StatusOr<std::unique_ptr<Communicator>> made =
        CreateGlooCommunicator(&store, "mp", rank, kSize, options);
    CHILD_CHECK_OK(made.status(), rank);
    Communicator& comm = **made;
    std::mt19937 rng(seed);
    const std::vector<int64_t> counts = RandomCounts(rng, kSize, 50);
    std::vector<std::vector<int64_t>> a2a(kSize);
    for (auto& row : a2a) row = RandomCounts(rng, kSize, 30);
    Buffers send(kSize), gather_in(kSize), a2a_in(kSize), ar(kSize);
    for (int r = 0; r < kSize; ++r) {
      send[r] = ExactRandom(rng, Sum(counts));
      gather_in[r] = ExactRandom(rng, counts[r]);
      a2a_in[r] = ExactRandom(rng, Sum(a2a[r]));
      ar[r] = ExactRandom(rng, 1000);
    }

    std::vector<float> out(counts[rank]);
    CHILD_CHECK_OK(comm.ReduceScatterV(send[rank].data(), counts, out.data()),
                   rank);
    CHILD_CHECK(out == RefReduceScatterV(send, counts, rank), rank,
                "ReduceScatterV result");

    out.assign(Sum(counts), 0.0f);
    CHILD_CHECK_OK(comm.AllGatherV(gather_in[rank].data(), counts, out.data()),
                   rank);
    CHILD_CHECK(out == RefAllGatherV(gather_in), rank, "AllGatherV result");

    std::vector<int64_t> recv_counts(kSize);
    for (int i = 0; i < kSize; ++i) recv_counts[i] = a2a[i][rank];
    out.assign(Sum(recv_counts), 0.0f);
    CHILD_CHECK_OK(
        comm.AllToAllV(a2a_in[rank].data(), a2a[rank], out.data(), recv_counts),
        rank);
    CHILD_CHECK(out == RefAllToAllV(a2a_in, a2a, rank), rank,
                "AllToAllV result");

    out = ar[rank];
    CHILD_CHECK_OK(comm.AllReduce(out.data(), 1000), rank);
    CHILD_CHECK(out == RefAllReduce(ar), rank, "AllReduce result");

    out = ar[rank];
    CHILD_CHECK_OK(comm.Broadcast(out.data(), 1000, 2), rank);
    CHILD_CHECK(out == ar[2], rank, "Broadcast result");

    CHILD_CHECK_OK(comm.Barrier(), rank);
    return 0;
  });
  for (int r = 0; r < kSize; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// A peer process that exits after the rendezvous: the survivors' next
// collective fails (connection closed, not SIGPIPE, not a hang) within the
// timeout, and each survivor can then build a new group and work.
TEST(GlooMultiProcessTest, DeadPeerProcessFailsTheOthersAndTheyRecover) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  constexpr int kSize = 3;
  constexpr absl::Duration kTimeout = absl::Seconds(2);
  std::vector<int> codes = RunProcesses(kSize, [&](int rank) -> int {
    FileKvStore store(dir.path());
    GlooOptions options;
    options.timeout = kTimeout;
    absl::StatusOr<std::unique_ptr<Communicator>> made =
        CreateGlooCommunicator(&store, "dead", rank, kSize, options);
    CHILD_CHECK_OK(made.status(), rank);
    CHILD_CHECK_OK((*made)->Barrier(), rank);
    if (rank == 2) _exit(0);  // dies without a goodbye

    std::vector<float> data(4096, 1.0f);
    const absl::Time start = absl::Now();
    absl::Status status = (*made)->AllReduce(data.data(), 4096);
    const absl::Duration elapsed = absl::Now() - start;
    CHILD_CHECK(!status.ok(), rank, "AllReduce with a dead peer erred");
    CHILD_CHECK(status.code() == absl::StatusCode::kUnavailable ||
                    status.code() == absl::StatusCode::kDeadlineExceeded,
                rank, "status code UNAVAILABLE or DEADLINE_EXCEEDED");
    CHILD_CHECK(absl::StrContains(status.message(), "AllReduce"), rank,
                "status names the op");
    CHILD_CHECK(elapsed < kTimeout + absl::Milliseconds(1500), rank,
                "failure within the timeout");

    // The survivors form a new group (fresh prefix) and it works. They
    // noticed the death at different times (up to kTimeout apart), so the
    // new rendezvous gets a longer timeout.
    options.timeout = absl::Seconds(10);
    absl::StatusOr<std::unique_ptr<Communicator>> again =
        CreateGlooCommunicator(&store, "dead-after", rank, 2, options);
    CHILD_CHECK_OK(again.status(), rank);
    std::vector<float> ones(7, 1.0f);
    CHILD_CHECK_OK((*again)->AllReduce(ones.data(), 7), rank);
    CHILD_CHECK(ones == std::vector<float>(7, 2.0f), rank, "AllReduce after");
    return 0;
  });
  for (int r = 0; r < kSize; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

}  // namespace
}  // namespace canzona::testing
