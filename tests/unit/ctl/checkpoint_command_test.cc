// canzonactl checkpoint inspect end to end: a valid checkpoint is listed
// (text and JSON); a corrupted one exits 1 naming the code and the file.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/checkpoint.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::testing::HasSubstr;

struct CtlRun {
  int exit_code = -1;
  std::string out, err;
};

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

CtlRun Canzonactl(const std::string& args) {
  const std::string base =
      absl::StrCat(::testing::TempDir(), "/ckpt_cmd_", getpid());
  const int status = std::system(absl::StrCat(CANZONACTL_PATH, " ", args, " >",
                                              base, ".out 2>", base, ".err")
                                     .c_str());
  CtlRun run;
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  run.out = Slurp(base + ".out");
  run.err = Slurp(base + ".err");
  return run;
}

// A committed checkpoint: an AdamW and a Muon record with real state.
std::string WriteCheckpoint() {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/ckpt_cmd_dir_", getpid());
  std::filesystem::remove_all(dir);
  auto writer = CheckpointWriter::Create(dir, "0");
  EXPECT_OK(writer);
  for (auto [name, kind] : {std::pair{"layers.0.norm", OptimizerKind::kAdamW},
                            std::pair{"layers.0.w", OptimizerKind::kMuon}}) {
    OptimizerState state;
    state.kind = kind;
    state.step = 12;
    state.tensors = {{"exp_avg", {4, 3}, std::vector<float>(12, 0.25f)}};
    EXPECT_OK((*writer)->Add(name, *MakeOptimizerConfig(kind, {}), state));
  }
  auto shard = (*writer)->Finish();
  EXPECT_OK(shard);
  CheckpointManifest manifest;
  manifest.layout = {1, 2, 2};
  manifest.strategy = "cost";
  manifest.plan_digest = "d1";
  manifest.step = 12;
  manifest.shards = {*shard};
  EXPECT_OK(CommitCheckpoint(dir, manifest));
  return dir;
}

TEST(CheckpointCommandTest, InspectListsAValidCheckpoint) {
  const std::string dir = WriteCheckpoint();
  CtlRun text = Canzonactl("checkpoint inspect " + dir);
  EXPECT_EQ(text.exit_code, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr("step 12"));
  EXPECT_THAT(text.out, HasSubstr("layout PP1 x DP2 x TP2"));
  EXPECT_THAT(text.out, HasSubstr("layers.0.w"));
  EXPECT_THAT(text.out, HasSubstr("muon"));

  CtlRun json = Canzonactl("checkpoint inspect --json " + dir);
  ASSERT_EQ(json.exit_code, 0) << json.err;
  const nlohmann::json j = nlohmann::json::parse(json.out);
  EXPECT_EQ(j["step"], 12);
  EXPECT_EQ(j["params"].size(), 2u);
  EXPECT_EQ(j["kinds"]["adamw"], 1);
  EXPECT_EQ(j["total_state_bytes"], 2 * 12 * 4);
}

TEST(CheckpointCommandTest, InspectRefusesACorruptedCheckpoint) {
  const std::string dir = WriteCheckpoint();
  const std::string shard = dir + "/" + ShardFileName("0");
  std::filesystem::resize_file(shard, std::filesystem::file_size(shard) - 1);
  CtlRun run = Canzonactl("checkpoint inspect " + dir);
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_THAT(run.err, HasSubstr("DATA_LOSS"));
  EXPECT_THAT(run.err, HasSubstr(ShardFileName("0")));
  CtlRun missing = Canzonactl("checkpoint inspect " + dir + "/nope");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.err, HasSubstr("no complete manifest"));
  // Without a daemon, save names the address it could not reach.
  CtlRun save = Canzonactl(
      "checkpoint save --job j --dir /tmp/x --target unix:/nonexistent.sock");
  EXPECT_EQ(save.exit_code, 1);
  EXPECT_THAT(save.err, HasSubstr("cannot reach canzonad"));
}

}  // namespace
}  // namespace canzona
