// canzonactl replay end to end: the binary's output equals the update rules
// run in-process on the same data, and every kind of bad input exits 2 with
// one line naming the problem and writes nothing.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/ctl/npy.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "server/optim/optimizer_config.h"
#include "server/optim/update_rule.h"
#include "tests/matchers/status_matchers.h"

namespace canzona {
namespace {

using ::testing::HasSubstr;

struct RunResult {
  int exit_code = -1;
  std::string stderr_text;
};

RunResult RunCanzonactl(const std::string& args) {
  const std::string err_path =
      absl::StrCat(::testing::TempDir(), "/replay_stderr_", getpid());
  const std::string command =
      absl::StrCat(CANZONACTL_PATH, " ", args, " 2>", err_path, " >/dev/null");
  const int status = std::system(command.c_str());
  RunResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  result.stderr_text = buffer.str();
  std::remove(err_path.c_str());
  return result;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

class ReplayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/replay_", getpid());
    ::mkdir(dir_.c_str(), 0755);
  }
  std::string Path(const std::string& name) const {
    return absl::StrCat(dir_, "/", name);
  }
  // Random N(0,1) data, never zeros.
  static std::vector<float> Random(int64_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = normal(rng);
    return v;
  }
  // The expected output: the same rule run in-process on the cpu backend.
  static std::vector<float> Expected(const std::string& optimizer,
                                     const std::string& settings,
                                     const std::vector<int64_t>& shape,
                                     std::vector<float> param,
                                     const std::vector<float>& grads) {
    auto backend = CreateBackend(BackendKind::kCpu);
    EXPECT_OK(backend.status());
    auto kind = ParseOptimizerKind(optimizer);
    auto parsed = ParseSettings(settings);
    EXPECT_OK(parsed.status());
    auto config = MakeOptimizerConfig(*kind, *parsed);
    EXPECT_OK(config.status());
    auto rule = UpdateRule::Create(*config, shape, backend->get());
    EXPECT_OK(rule.status());
    const size_t n = param.size();
    for (size_t k = 0; k * n < grads.size(); ++k) {
      EXPECT_OK((*rule)->Step(param.data(), grads.data() + k * n));
    }
    return param;
  }

  std::string dir_;
};

TEST_F(ReplayTest, OutputEqualsInProcessRulesForEveryOptimizer) {
  struct Case {
    std::string optimizer;
    std::string settings;
    std::vector<int64_t> shape;
  } cases[] = {
      {"muon", "lr=0.02,momentum=0.9", {12, 20}},
      {"muon", "ns_coefficients=polar_express,scale=match_rms_adamw", {20, 12}},
      {"muon", "ns_algorithm=gram,ns_coefficients=quintic", {12, 20}},
      {"muon", "ns_algorithm=gram", {20, 12}},
      {"muon", "ns_algorithm=standard", {12, 20}},
      {"adamw", "lr=0.01,weight_decay=0.1", {7}},
      {"adamw", "", {2, 3, 5}},
      {"shampoo", "lr=0.01,precondition_frequency=2", {9, 6}},
      {"soap", "lr=0.01,precondition_frequency=2", {8, 8}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.optimizer + " " + c.settings);
    int64_t numel = 1;
    for (int64_t d : c.shape) numel *= d;
    const int64_t steps = 4;
    std::vector<float> param = Random(numel, 1);
    std::vector<float> grads = Random(steps * numel, 2);
    std::vector<int64_t> grad_shape = {steps};
    grad_shape.insert(grad_shape.end(), c.shape.begin(), c.shape.end());
    ASSERT_OK(WriteNpyFloat32(Path("p.npy"), c.shape, param));
    ASSERT_OK(WriteNpyFloat32(Path("g.npy"), grad_shape, grads));
    std::remove(Path("out.npy").c_str());

    RunResult run = RunCanzonactl(absl::StrCat(
        "replay --optimizer ", c.optimizer,
        c.settings.empty() ? "" : " --set " + c.settings, " --param ",
        Path("p.npy"), " --grads ", Path("g.npy"), " --out ", Path("out.npy")));
    ASSERT_EQ(run.exit_code, 0) << run.stderr_text;
    ASSERT_OK_AND_ASSIGN(NpyArray out, ReadNpyAsFloat32(Path("out.npy")));
    EXPECT_EQ(out.shape, c.shape);
    std::vector<float> expected =
        Expected(c.optimizer, c.settings, c.shape, param, grads);
    EXPECT_EQ(out.data, expected);  // same code, same order: bitwise
    EXPECT_NE(out.data, param);     // and the steps did change it
  }
}

TEST_F(ReplayTest, BadInputExitsTwoNamingTheProblemAndWritesNothing) {
  const std::vector<int64_t> shape = {6, 4};
  ASSERT_OK(WriteNpyFloat32(Path("p.npy"), shape, Random(24, 3)));
  ASSERT_OK(WriteNpyFloat32(Path("g.npy"), {2, 6, 4}, Random(48, 4)));
  ASSERT_OK(WriteNpyFloat32(Path("g_wrong.npy"), {2, 4, 6}, Random(48, 5)));
  ASSERT_OK(WriteNpyFloat32(Path("p1d.npy"), {24}, Random(24, 6)));
  {
    std::ofstream text(Path("text.npy"));
    text << "hello";
  }
  const std::string good_inputs =
      absl::StrCat(" --param ", Path("p.npy"), " --grads ", Path("g.npy"));
  const std::string out = absl::StrCat(" --out ", Path("never.npy"));
  struct Case {
    std::string args;
    std::string message;
  } cases[] = {
      {"replay --optimizer muon --param " + Path("missing.npy") + " --grads " +
           Path("g.npy") + out,
       "missing.npy"},
      {"replay --optimizer muon --param " + Path("text.npy") + " --grads " +
           Path("g.npy") + out,
       "text.npy"},
      {"replay --optimizer muon --param " + Path("p.npy") + " --grads " +
           Path("g_wrong.npy") + out,
       "g_wrong.npy"},
      {"replay --optimizer muon --param " + Path("p1d.npy") + " --grads " +
           Path("g.npy") + out,
       "needs a matrix (2-D, 3-D stacked"},
      {"replay --optimizer lion" + good_inputs + out, "lion"},
      {"replay --optimizer muon --set lr=0.02,betta=0.9" + good_inputs + out,
       "betta"},
      {"replay --optimizer muon --set momentum=fast" + good_inputs + out,
       "momentum"},
      {"replay --optimizer adamw --set lr=-1" + good_inputs + out, "lr"},
      {"replay --optimizer muon --set ns_coefficients=cubic" + good_inputs +
           out,
       "ns_coefficients"},
      {"replay --optimizer muon --set ns_algorithm=syrk" + good_inputs + out,
       "ns_algorithm"},
      {"replay --optimizer muon" + good_inputs, "--out"},
      {"replay --optimizer muon --backend tpu" + good_inputs + out, "tpu"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    RunResult run = RunCanzonactl(c.args);
    EXPECT_EQ(run.exit_code, 2);
    EXPECT_THAT(run.stderr_text, HasSubstr(c.message));
    // One line: the message ends with the only newline.
    EXPECT_EQ(run.stderr_text.find('\n'), run.stderr_text.size() - 1);
    EXPECT_FALSE(Exists(Path("never.npy")));
  }
}

}  // namespace
}  // namespace canzona
