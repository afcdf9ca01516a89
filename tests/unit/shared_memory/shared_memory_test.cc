#include "proto/shared_memory/shared_memory.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

// Unique per test process so parallel ctest runs never collide.
std::string TestName(int seq) {
  return ShmName(absl::StrCat("test-", getpid()), 0, seq);
}

TEST(ShmNameTest, AcceptsOnlyTheDocumentedPattern) {
  EXPECT_OK(ValidateShmName("/canzona.job_1-a.3.17"));
  EXPECT_EQ(ShmName("j", 2, 5), "/canzona.j.2.5");
  for (const char* bad :
       {"/other.job.0.0", "/canzona.job.0", "/canzona..0.0", "/canzona.j/x.0.0",
        "/canzona.job.-1.0", "/canzona.job.0.0.0", "canzona.job.0.0",
        "/canzona.job.0.x"}) {
    EXPECT_THAT(ValidateShmName(bad),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(bad)))
        << bad;
  }
  EXPECT_THAT(
      ValidateShmName(absl::StrCat("/canzona.", std::string(65, 'j'), ".0.0")),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1 to 64")));
}

TEST(SharedMemoryTest, AnotherProcessSeesAndWritesTheSameBytes) {
  const std::string name = TestName(0);
  ASSERT_OK_AND_ASSIGN(SharedMemory owner, SharedMemory::Create(name, 4096));
  ASSERT_OK_AND_ASSIGN(float* floats, owner.FloatRange(0, 4096));
  for (int i = 0; i < 1024; ++i) floats[i] = 0.25f * static_cast<float>(i + 1);

  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The "daemon": maps by name, checks the owner, doubles every value.
    SharedMemory::OpenOptions options;
    options.expected_owner_uid = geteuid();
    absl::StatusOr<SharedMemory> view = SharedMemory::Open(name, options);
    if (!view.ok() || view->size() != 4096) _exit(2);
    absl::StatusOr<float*> p = view->FloatRange(0, 4096);
    if (!p.ok()) _exit(3);
    for (int i = 0; i < 1024; ++i) {
      if ((*p)[i] != 0.25f * static_cast<float>(i + 1)) _exit(4);
      (*p)[i] *= 2.0f;
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);
  for (int i = 0; i < 1024; ++i) {
    ASSERT_EQ(floats[i], 0.5f * static_cast<float>(i + 1)) << i;
  }
}

TEST(SharedMemoryTest, CreatorUnlinksOnDestruction) {
  const std::string name = TestName(1);
  {
    ASSERT_OK_AND_ASSIGN(SharedMemory owner, SharedMemory::Create(name, 64));
    EXPECT_THAT(SharedMemory::Create(name, 64),
                StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr(name)));
    ASSERT_OK(SharedMemory::Open(name).status());
  }
  EXPECT_THAT(SharedMemory::Open(name),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(name)));
}

// The daemon's side of a trainer killed before it removed its object:
// the name goes while the mapping stays usable; a name another object took
// since is left alone; a name already gone is no error.
TEST(SharedMemoryTest, RemoveNameIfOursRemovesOnlyTheObjectItMapped) {
  const std::string name = TestName(5);
  ASSERT_OK_AND_ASSIGN(SharedMemory trainer, SharedMemory::Create(name, 64));
  ASSERT_OK_AND_ASSIGN(SharedMemory daemon, SharedMemory::Open(name));
  ASSERT_OK_AND_ASSIGN(float* floats, daemon.FloatRange(0, 64));
  ASSERT_OK(daemon.RemoveNameIfOurs());
  EXPECT_THAT(SharedMemory::Open(name),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr(name)));
  floats[3] = 7.0f;  // still mapped
  ASSERT_OK_AND_ASSIGN(float* seen, trainer.FloatRange(0, 64));
  EXPECT_EQ(seen[3], 7.0f);
  EXPECT_OK(daemon.RemoveNameIfOurs());  // gone already
  // A new object under the same name (a restarted trainer's) stays.
  ASSERT_OK_AND_ASSIGN(SharedMemory successor, SharedMemory::Create(name, 64));
  ASSERT_OK(daemon.RemoveNameIfOurs());
  EXPECT_OK(SharedMemory::Open(name).status());
}

// Seqs are unique within a process and differ between processes (a forked
// child draws its own), and make valid names.
TEST(ShmNameTest, NextShmSeqIsUniquePerProcess) {
  const int64_t first = NextShmSeq();
  const int64_t second = NextShmSeq();
  EXPECT_EQ(second, first + 1);
  EXPECT_GT(first, 0);
  EXPECT_OK(ValidateShmName(ShmName("job", 0, first)));
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    const int64_t seq = NextShmSeq();
    const bool ok = ::write(pipe_fds[1], &seq, sizeof(seq)) == sizeof(seq);
    ::_exit(ok ? 0 : 1);
  }
  ASSERT_GT(child, 0);
  int64_t child_seq = 0;
  ASSERT_EQ(::read(pipe_fds[0], &child_seq, sizeof(child_seq)),
            static_cast<ssize_t>(sizeof(child_seq)));
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  // Another nonce: not within this process's range of 10^6.
  EXPECT_GE(std::abs(child_seq - first), 1'000'000) << child_seq;
}

TEST(SharedMemoryTest, RejectsForeignOwnerBadRangesAndBadNames) {
  const std::string name = TestName(2);
  ASSERT_OK_AND_ASSIGN(SharedMemory owner, SharedMemory::Create(name, 256));
  SharedMemory::OpenOptions foreign;
  foreign.expected_owner_uid = geteuid() + 1;
  EXPECT_THAT(SharedMemory::Open(name, foreign),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("uid")));
  EXPECT_THAT(
      owner.FloatRange(128, 256),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside")));
  EXPECT_THAT(
      owner.FloatRange(8, ~uint64_t{0} - 4),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside")));
  EXPECT_THAT(
      owner.FloatRange(2, 8),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("aligned")));
  EXPECT_THAT(owner.FloatRange(0, 6),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("whole")));
  EXPECT_OK(owner.FloatRange(252, 4).status());
  EXPECT_THAT(SharedMemory::Open("/dev/shm/../etc/passwd"),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(SharedMemory::Create(TestName(3), 0),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("size")));
}

// The bytes of /dev/shm backing object `name` (-1: cannot tell).
int64_t BackedBytes(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return -1;
  struct stat st;
  const int rc = fstat(fd, &st);
  close(fd);
  return rc == 0 ? static_cast<int64_t>(st.st_blocks) * 512 : -1;
}

// Every page of a created object, and of a sparse one another client made
// (ftruncate alone) once the daemon opens it, is backed: a write cannot
// find /dev/shm full later. Before, both stayed unbacked (0 bytes).
TEST(SharedMemoryTest, CreateAndOpenBackEveryPage) {
  constexpr uint64_t kBytes = 4 << 20;
  const std::string created = TestName(4);
  ASSERT_OK_AND_ASSIGN(SharedMemory owner,
                       SharedMemory::Create(created, kBytes));
  EXPECT_GE(BackedBytes(created), static_cast<int64_t>(kBytes));

  const std::string sparse = TestName(5);
  const int fd = shm_open(sparse.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, kBytes), 0);
  close(fd);
  EXPECT_EQ(BackedBytes(sparse), 0);
  absl::StatusOr<SharedMemory> view = SharedMemory::Open(sparse);
  EXPECT_GE(BackedBytes(sparse), static_cast<int64_t>(kBytes));
  shm_unlink(sparse.c_str());
  ASSERT_OK(view.status());
}

// With /dev/shm too small for an object (a container's, 64 MiB under
// Docker by default), creating it, or opening a sparse one as the daemon
// opens a trainer's, is RESOURCE_EXHAUSTED naming /dev/shm; before, the
// first write past the limit killed the writer with SIGBUS. Runs in a
// child with a private 1 MiB /dev/shm (needs CAP_SYS_ADMIN: skipped
// without it).
TEST(SharedMemoryTest, AFullDevShmIsResourceExhaustedNotABusError) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (unshare(CLONE_NEWNS) != 0 ||
        mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=1m") != 0) {
      _exit(77);
    }
    constexpr uint64_t kBytes = 8 << 20;
    absl::StatusOr<SharedMemory> created =
        SharedMemory::Create(TestName(6), kBytes);
    if (created.ok() ||
        created.status().code() != absl::StatusCode::kResourceExhausted ||
        !absl::StrContains(created.status().message(), "/dev/shm")) {
      _exit(2);
    }
    const std::string sparse = TestName(7);
    const int fd = shm_open(sparse.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || ftruncate(fd, kBytes) != 0) _exit(3);
    close(fd);
    absl::StatusOr<SharedMemory> opened = SharedMemory::Open(sparse);
    if (opened.ok() ||
        opened.status().code() != absl::StatusCode::kResourceExhausted) {
      _exit(4);
    }
    // What still fits works.
    absl::StatusOr<SharedMemory> small =
        SharedMemory::Create(TestName(8), 256 << 10);
    if (!small.ok()) _exit(5);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "signal " << WTERMSIG(status);
  if (WEXITSTATUS(status) == 77) {
    GTEST_SKIP() << "no private mount namespace (needs CAP_SYS_ADMIN)";
  }
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace canzona
