// Where a checkpoint may be written: absolute, no "..", under the root.
#include "server/engine/rank_checkpoint.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;

TEST(CheckpointDirTest, NormalizedAbsolutePathsUnderTheRoot) {
  ASSERT_OK_AND_ASSIGN(std::string a,
                       ValidateCheckpointDir("/ckpt//run1/", ""));
  EXPECT_EQ(a, "/ckpt/run1");
  ASSERT_OK_AND_ASSIGN(std::string b,
                       ValidateCheckpointDir("/srv/ckpt/run1", "/srv/ckpt/"));
  EXPECT_EQ(b, "/srv/ckpt/run1");
  ASSERT_OK_AND_ASSIGN(std::string c,
                       ValidateCheckpointDir("/srv/ckpt", "/srv/ckpt"));
  EXPECT_EQ(c, "/srv/ckpt");
}

TEST(CheckpointDirTest, BadDirectoriesAreRefused) {
  EXPECT_THAT(ValidateCheckpointDir("run1", ""),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("must be an absolute path")));
  EXPECT_THAT(ValidateCheckpointDir("/srv/ckpt/../etc", "/srv/ckpt"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("..")));
  EXPECT_THAT(ValidateCheckpointDir("/srv/ckpt2/run", "/srv/ckpt"),
              StatusIs(absl::StatusCode::kPermissionDenied,
                       HasSubstr("outside this daemon's checkpoint root")));
}

}  // namespace
}  // namespace canzona
