// Where canzonactl looks up model configs (ResolveModelsDir): the flag, then
// $CANZONA_MODELS_DIR, then an installed directory beside the executable,
// then the source tree; and the shapes read from the source tree's configs.
#include "client/ctl/model_shapes.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

namespace fs = std::filesystem;

class ResolveModelsDirTest : public ::testing::Test {
 protected:
  void SetUp() override { ::unsetenv("CANZONA_MODELS_DIR"); }
  void TearDown() override { ::unsetenv("CANZONA_MODELS_DIR"); }
};

TEST_F(ResolveModelsDirTest, FlagWinsOverEnvironment) {
  ::setenv("CANZONA_MODELS_DIR", "/from/env", 1);
  EXPECT_EQ(ResolveModelsDir("/from/flag"), "/from/flag");
}

TEST_F(ResolveModelsDirTest, EnvironmentWinsOverInstalledAndSource) {
  ::setenv("CANZONA_MODELS_DIR", "/from/env", 1);
  EXPECT_EQ(ResolveModelsDir(""), "/from/env");
}

TEST_F(ResolveModelsDirTest, EmptyEnvironmentIsIgnored) {
  ::setenv("CANZONA_MODELS_DIR", "", 1);
  EXPECT_EQ(ResolveModelsDir(""), CANZONA_MODELS_SOURCE_DIR);
}

TEST_F(ResolveModelsDirTest, SourceTreeWithoutAnInstalledDirectory) {
  EXPECT_EQ(ResolveModelsDir(""), CANZONA_MODELS_SOURCE_DIR);
  EXPECT_TRUE(fs::is_regular_file(fs::path(CANZONA_MODELS_SOURCE_DIR) /
                                  "qwen3-8b.json"));
}

// This test binary stands in for an installed one: the install layout's
// models directory, created relative to it, must win over the source tree.
TEST_F(ResolveModelsDirTest, InstalledDirectoryBesideTheExecutable) {
  const fs::path exe = fs::read_symlink("/proc/self/exe");
  const fs::path installed =
      (exe.parent_path() / CANZONA_MODELS_INSTALL_RELDIR).lexically_normal();
  ASSERT_FALSE(fs::exists(installed)) << installed;
  ASSERT_TRUE(fs::create_directories(installed));
  const std::string resolved = ResolveModelsDir("");
  fs::remove(installed);
  EXPECT_EQ(resolved, installed.string());
  EXPECT_EQ(ResolveModelsDir(""), CANZONA_MODELS_SOURCE_DIR);
}

TEST_F(ResolveModelsDirTest, DistinctShapesOfTheSourceTreeConfig) {
  // qwen3-0.6b: hidden 1024, 16 heads x 128, 8 kv heads x 128, MLP 3072.
  ASSERT_OK_AND_ASSIGN(std::vector<MatrixShape> shapes,
                       DistinctMatrixShapes("qwen3-0.6b", ""));
  ASSERT_EQ(shapes.size(), 5u);
  EXPECT_EQ(shapes[0].rows * shapes[0].cols, 3072 * 1024);
  EXPECT_EQ(shapes.back().rows, 1024);
  EXPECT_EQ(shapes.back().cols, 1024);
}

}  // namespace
}  // namespace canzona
