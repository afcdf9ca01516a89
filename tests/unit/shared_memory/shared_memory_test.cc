#include "proto/shared_memory/shared_memory.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>

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

}  // namespace
}  // namespace canzona
