#include "proto/shared_memory/shared_memory.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

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
