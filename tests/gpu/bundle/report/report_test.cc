// The bundle report writer (canzona-bundle-report) on report directories
// written here the way the runner writes them: record parsing, each kind's
// outcome, the Newton-Schulz comparison's arithmetic, the assembled report
// and its Markdown, the optimizer step benchmark's table and goals.
#include "tests/gpu/bundle/report/report.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/gpu/bundle/report/check_record.h"
#include "tests/gpu/bundle/report/check_result.h"
#include "tests/gpu/bundle/report/kernel_comparison.h"
#include "tests/gpu/bundle/report/torch_step_comparison.h"
#include "tests/matchers/status_matchers.h"

namespace canzona::bundle {
namespace {

using ::canzona::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;
using json = nlohmann::json;

class ReportDir : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/canzona-report-test.XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
    std::filesystem::create_directories(dir_ / "checks");
    std::filesystem::create_directories(dir_ / "logs");
    std::filesystem::create_directories(dir_ / "data");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void Write(const std::string& relative, const std::string& text) {
    std::ofstream(dir_ / relative) << text;
  }
  // The torch-step-bench check (the NCCL plane's) as run.sh records it,
  // having written `data`.
  void WriteTorchStepBench(const std::string& data) {
    Write("checks/01-bench.rec",
          "name=torch-step-bench\nkind=torch_step_bench\nstate=ran\n"
          "exit_code=0\nlog=logs/bench.log\ndata=data/bench.json\n");
    Write("logs/bench.log", "");
    Write("data/bench.json", data);
  }
  // A check that ran: its record, log and JSON output.
  CheckRecord Ran(const std::string& name, const std::string& kind,
                  const std::string& log, const std::string& data,
                  int exit_code = 0) {
    CheckRecord r;
    r.name = name;
    r.kind = kind;
    r.ran = true;
    r.exit_code = exit_code;
    r.limit_s = 60;
    r.log = "logs/" + name + ".log";
    Write(r.log, log);
    if (!data.empty()) {
      r.data = "data/" + name + ".json";
      Write(r.data, data);
    }
    return r;
  }

  std::filesystem::path dir_;
  std::mt19937 rng_{std::random_device{}()};
};

json GtestJson(const std::vector<std::string>& results) {
  json suite = {{"name", "Suite"}, {"testsuite", json::array()}};
  for (size_t i = 0; i < results.size(); ++i) {
    json test = {{"name", "T" + std::to_string(i)},
                 {"status", "RUN"},
                 {"result", results[i] == "SKIPPED" ? "SKIPPED" : "COMPLETED"}};
    if (results[i] == "FAILED") {
      test["failures"] = {{{"failure", "x.cc:1\nExpected equality"}}};
    }
    suite["testsuite"].push_back(test);
  }
  return {{"tests", results.size()}, {"testsuites", {suite}}};
}

constexpr char kSkipLog[] =
    "[ RUN      ] Suite.T0\n"
    "tests/gpu/x.cc:75: Skipped\n"
    "no CUDA device\n"
    "[  SKIPPED ] Suite.T0 (0 ms)\n";

TEST(KeyValuesTest, ParsesLinesAndNamesTheBadOne) {
  ASSERT_OK_AND_ASSIGN(KeyValues values,
                       ParseKeyValues("# c\na=1\n\nb=x=y\n", "env.txt"));
  EXPECT_EQ(values.at("a"), "1");
  EXPECT_EQ(values.at("b"), "x=y");
  EXPECT_THAT(
      ParseKeyValues("a=1\nbroken\n", "env.txt"),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("env.txt:2")));
}

TEST(CheckRecordTest, NamesTheMissingOrBadField) {
  EXPECT_THAT(
      ParseCheckRecord({{"state", "ran"}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"name\"")));
  EXPECT_THAT(
      ParseCheckRecord({{"name", "a"}, {"state", "maybe"}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"state\"")));
  EXPECT_THAT(
      ParseCheckRecord({{"name", "a"}, {"state", "skipped"}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("reason")));
  EXPECT_THAT(
      ParseCheckRecord({{"name", "a"}, {"state", "ran"}, {"exit_code", "x"}}),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exit_code")));
  ASSERT_OK_AND_ASSIGN(CheckRecord r,
                       ParseCheckRecord({{"name", "a"},
                                         {"state", "ran"},
                                         {"exit_code", "3"},
                                         {"timed_out", "1"},
                                         {"duration_s", "1.5"}}));
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_TRUE(r.timed_out);
  EXPECT_DOUBLE_EQ(r.duration_s, 1.5);
}

TEST_F(ReportDir, GtestAllSkippedIsSkippedWithTheMessage) {
  CheckResult r =
      EvaluateCheck(Ran("g", "gtest", kSkipLog,
                        GtestJson({"SKIPPED", "SKIPPED", "SKIPPED"}).dump()),
                    dir_);
  EXPECT_EQ(r.outcome, Outcome::kSkipped);
  EXPECT_THAT(r.reason, HasSubstr("all 3 skipped: no CUDA device"));
  EXPECT_EQ(r.figures["tests"], 3);
  EXPECT_EQ(r.figures["skipped"], 3);
}

TEST_F(ReportDir, GtestFailureNamesTheTest) {
  CheckResult r = EvaluateCheck(
      Ran("g", "gtest", "", GtestJson({"OK", "FAILED", "SKIPPED"}).dump(), 1),
      dir_);
  EXPECT_EQ(r.outcome, Outcome::kFailed);
  EXPECT_THAT(r.reason, HasSubstr("1 of 3 tests failed: Suite.T1"));
  EXPECT_EQ(r.figures["passed"], 1);
}

TEST_F(ReportDir, GtestSomeSkippedPasses) {
  CheckResult r = EvaluateCheck(
      Ran("g", "gtest", kSkipLog, GtestJson({"OK", "OK", "SKIPPED"}).dump()),
      dir_);
  EXPECT_EQ(r.outcome, Outcome::kPassed);
  EXPECT_EQ(r.reason, "2 passed, 1 skipped: no CUDA device");
}

TEST_F(ReportDir, CrashWithoutOutputAndTimeoutFail) {
  CheckResult crash = EvaluateCheck(
      Ran("g", "gtest", "loading...\nSegmentation fault\n", "", 139), dir_);
  EXPECT_EQ(crash.outcome, Outcome::kFailed);
  EXPECT_EQ(crash.reason, "exit code 139: Segmentation fault");
  CheckRecord slow = Ran("k", "kernels", "", "", 124);
  slow.timed_out = true;
  CheckResult timeout = EvaluateCheck(slow, dir_);
  EXPECT_EQ(timeout.outcome, Outcome::kFailed);
  EXPECT_THAT(timeout.reason, HasSubstr("timed out after 60 s"));
}

TEST_F(ReportDir, TrainerLossMustFall) {
  std::uniform_real_distribution<double> loss(1.0, 10.0);
  const double a = loss(rng_), b = loss(rng_);
  const double hi = std::max(a, b), lo = std::min(a, b);
  auto log = [](double first, double last) {
    return "step    1  loss " + std::to_string(first) + "\nstep   50  loss " +
           std::to_string(last) + "\n";
  };
  CheckResult falling =
      EvaluateCheck(Ran("t", "trainer", log(hi, lo), ""), dir_);
  EXPECT_EQ(falling.outcome, Outcome::kPassed);
  EXPECT_NEAR(falling.figures["last_loss"].get<double>(), lo, 1e-5);
  CheckResult rising =
      EvaluateCheck(Ran("t", "trainer", log(lo, hi), ""), dir_);
  EXPECT_EQ(rising.outcome, Outcome::kFailed);
  EXPECT_THAT(rising.reason, HasSubstr("loss did not fall"));
}

TEST_F(ReportDir, SelfJudgedScriptsKeepTheirStatus) {
  CheckResult skipped = EvaluateCheck(
      Ran("c", "torch_check", "",
          R"({"status": "skipped", "reason": "torch 2.5 has no Muon"})"),
      dir_);
  EXPECT_EQ(skipped.outcome, Outcome::kSkipped);
  EXPECT_EQ(skipped.reason, "torch 2.5 has no Muon");
  CheckResult passed_then_crashed = EvaluateCheck(
      Ran("c", "torch_check", "boom", R"({"status": "passed"})", 134), dir_);
  EXPECT_EQ(passed_then_crashed.outcome, Outcome::kFailed);
  CheckResult no_json = EvaluateCheck(Ran("c", "torch_ns", "", ""), dir_);
  EXPECT_EQ(no_json.outcome, Outcome::kFailed);
}

TEST_F(ReportDir, CanzonactlJsonIsTheFigures) {
  CheckResult step =
      EvaluateCheck(Ran("s", "step", "",
                        R"({"dp": 2, "tp": 1, "modes": [{"mode": "plain"},
              {"mode": "overlap"}]})"),
                    dir_);
  EXPECT_EQ(step.outcome, Outcome::kPassed);
  EXPECT_EQ(step.reason, "2 modes, DP2 x TP1");
  EXPECT_EQ(step.figures["modes"][1]["mode"], "overlap");
  CheckResult kernels = EvaluateCheck(
      Ran("k", "kernels", "",
          R"({"ns_precision": "bf16", "device": "H100", "shapes": [{}]})"),
      dir_);
  EXPECT_EQ(kernels.reason, "1 shapes, bf16, on H100");
  CheckResult no_json = EvaluateCheck(Ran("k", "kernels", "", ""), dir_);
  EXPECT_EQ(no_json.outcome, Outcome::kFailed);
  EXPECT_THAT(no_json.reason, HasSubstr("no JSON output"));
}

// The step benchmarks' table: per mode the iteration, the step, DP
// communication and the daemon's host round trips (– where the JSON has
// none, as an older canzonactl's).
TEST_F(ReportDir, StepTableShowsHostRoundTrips) {
  Write("env.txt", "gpu_present=1\ngpu_name=NVIDIA H100\n");
  Write("checks/01-step.rec",
        "name=step-cuda-nccl-ws1\nkind=step\nstate=ran\n"
        "exit_code=0\nlog=logs/step.log\ndata=data/step.json\n");
  Write("logs/step.log", "");
  Write("data/step.json", R"({"dp": 1, "tp": 1, "modes": [
      {"mode": "flat/plain", "median_iteration_ms": 12.5,
       "median_step_ms": 3.25, "dp_comm_ms_per_step": 0.5,
       "exposed_over_total_comm": 1.0, "median_host_waits": 5,
       "pageable_copies": 0},
      {"mode": "flat/overlap", "median_iteration_ms": 11.0,
       "median_step_ms": 2.0, "dp_comm_ms_per_step": 0.5,
       "exposed_over_total_comm": 0.25}]})");
  ASSERT_OK_AND_ASSIGN(json report, BuildReport(dir_));
  const std::string md = RenderMarkdown(report);
  EXPECT_THAT(md, HasSubstr("| exposed / total | host round trips | "
                            "pageable copies |\n"));
  EXPECT_THAT(md, HasSubstr("| step-cuda-nccl-ws1 | DP1 x TP1 | flat/plain | "
                            "12.50 | 3.25 | 0.50 | 1.00 | 5 | 0 |\n"));
  EXPECT_THAT(md, HasSubstr("| flat/overlap | 11.00 | 2.00 | 0.50 | 0.25 | "
                            "– | – |\n"));
}

TEST_F(ReportDir, NotRunIsSkippedWithTheRunnersReason) {
  CheckRecord r;
  r.name = "bench";
  r.reason = "no GPU (no nvidia-smi)";
  CheckResult result = EvaluateCheck(r, dir_);
  EXPECT_EQ(result.outcome, Outcome::kSkipped);
  EXPECT_EQ(result.reason, "no GPU (no nvidia-smi)");
}

TEST_F(ReportDir, KernelComparisonArithmetic) {
  std::uniform_real_distribution<double> ms(0.5, 50.0), rate(1e3, 9e5);
  const double ours_bf16 = ms(rng_), ours_fp32 = ms(rng_);
  const double torch_bf16 = ms(rng_), torch_addmm = ms(rng_),
               torch_fp32 = ms(rng_);
  const double ours_gflops = rate(rng_), our_gemm = rate(rng_),
               torch_gemm_bf16 = rate(rng_);
  auto ours = [&](const char* precision, double ms) {
    return json{{"ns_precision", precision},
                {"shapes",
                 {{{"rows", 1024},
                   {"cols", 5120},
                   {"ns_seconds", ms / 1e3},
                   {"full_products_seconds", 1.25 * ms / 1e3},
                   {"ns_gflops", ours_gflops},
                   {"gemm_gflops", our_gemm}}}}};
  };
  std::vector<CheckResult> results(3);
  results[0].record.kind = "kernels";
  results[0].outcome = Outcome::kPassed;
  results[0].figures = ours("bf16", ours_bf16);
  results[1].record.kind = "kernels";
  results[1].outcome = Outcome::kPassed;
  results[1].figures = ours("fp32", ours_fp32);
  // A bench from before the full-products column.
  results[1].figures["shapes"][0].erase("full_products_seconds");
  results[2].record.kind = "torch_ns";
  results[2].outcome = Outcome::kPassed;
  results[2].figures = {{"shapes",
                         {{{"precision", "bf16"},
                           {"rows", 1024},
                           {"cols", 5120},
                           {"ns_ms", torch_bf16},
                           {"ns_addmm_ms", torch_addmm},
                           {"gemm_gflops", torch_gemm_bf16}},
                          {{"precision", "fp32"},
                           {"rows", 1024},
                           {"cols", 5120},
                           {"ns_ms", torch_fp32},
                           {"ns_addmm_ms", nullptr}},
                          // Another shape: matched to nothing.
                          {{"precision", "fp32"},
                           {"rows", 5120},
                           {"cols", 1024},
                           {"ns_ms", 1}}}}};
  json rows = CompareKernels(results);
  ASSERT_EQ(rows.size(), 2u);
  const json& bf16 = rows[0];
  EXPECT_NEAR(bf16["full_products_ms"].get<double>(), 1.25 * ours_bf16, 1e-9);
  EXPECT_NEAR(bf16["symmetric_speedup"].get<double>(), 1.25, 1e-9);
  EXPECT_NEAR(bf16["speedup"].get<double>(),
              std::min(torch_bf16, torch_addmm) / ours_bf16, 1e-9);
  EXPECT_EQ(bf16["speedup_goal_met"].get<bool>(),
            std::min(torch_bf16, torch_addmm) / ours_bf16 >= kSpeedupGoal);
  EXPECT_NEAR(bf16["fraction_of_gemm"].get<double>(),
              ours_gflops / torch_gemm_bf16, 1e-9);
  EXPECT_EQ(bf16["gemm_reference"], "torch bf16 GEMM");
  const json& fp32 = rows[1];
  EXPECT_TRUE(fp32["full_products_ms"].is_null());
  EXPECT_TRUE(fp32["symmetric_speedup"].is_null());
  EXPECT_NEAR(fp32["speedup"].get<double>(), torch_fp32 / ours_fp32, 1e-9);
  EXPECT_NEAR(fp32["fraction_of_gemm"].get<double>(), ours_gflops / our_gemm,
              1e-9);
  EXPECT_EQ(fp32["gemm_goal_met"].get<bool>(),
            ours_gflops / our_gemm >= kGemmFractionGoal);
  // Counted in the goals line under the summary: two goals per row.
  int met = 0;
  for (const json& r : rows) {
    met += r["speedup_goal_met"].get<bool>() + r["gemm_goal_met"].get<bool>();
  }
  Write("env.txt", "gpu_present=1\n");
  ASSERT_OK_AND_ASSIGN(json report, BuildReport(dir_));
  report["newton_schulz"] = rows;
  EXPECT_THAT(RenderMarkdown(report),
              HasSubstr(absl::StrCat("**Goals:** Newton-Schulz ", met,
                                     " of 4 shape goals met.\n")));
  // Torch's run cut at its limit: the rows it wrote still count.
  results[2].outcome = Outcome::kFailed;
  EXPECT_EQ(CompareKernels(results), rows);
  // Without torch: no speedup, and bf16 has no GEMM reference.
  results.pop_back();
  rows = CompareKernels(results);
  EXPECT_TRUE(rows[0]["speedup"].is_null());
  EXPECT_TRUE(rows[0]["fraction_of_gemm"].is_null());
  EXPECT_FALSE(rows[1]["fraction_of_gemm"].is_null());
}

TEST_F(ReportDir, BuildsTheReportAndItsMarkdown) {
  Write("env.txt",
        "bundle_commit=abc123\nmachine_os=Debian GNU/Linux 12\n"
        "gpu_present=0\ngpu_reason=no nvidia-smi\n"
        "cudalib.libcublas.so.13.path=/x/libcublas.so.13\n"
        "cudalib.libcublas.so.13.version=13.0\nrun_budget_s=480\n"
        "run_cuda_missing=libnccl.so.2\n");
  Write("checks/01-cpu.rec",
        "name=cpu-step\nkind=trainer\nstate=ran\nexit_code=0\n"
        "log=logs/cpu.log\n");
  Write("logs/cpu.log", "step 1  loss 3.0\nstep 2  loss 2.0\n");
  Write("checks/02-gpu.rec",
        "name=gpu-test-x\nkind=gtest\nstate=ran\nexit_code=0\n"
        "log=logs/gpu.log\ndata=data/gpu.json\n");
  Write("logs/gpu.log", kSkipLog);
  Write("data/gpu.json", GtestJson({"SKIPPED"}).dump());
  Write("checks/03-k.rec",
        "name=bench-kernels-bf16\nkind=kernels\nstate=skipped\n"
        "reason=no GPU (no nvidia-smi)\n");
  ASSERT_OK_AND_ASSIGN(json report, BuildReport(dir_));
  EXPECT_EQ(report["summary"]["passed"], 1);
  EXPECT_EQ(report["summary"]["skipped"], 2);
  EXPECT_EQ(report["summary"]["failed"], 0);
  EXPECT_FALSE(report["gpu"]["present"].get<bool>());
  EXPECT_EQ(report["machine"]["os"], "Debian GNU/Linux 12");
  ASSERT_EQ(report["cuda_libraries"].size(), 1u);
  EXPECT_EQ(report["cuda_libraries"][0]["soname"], "libcublas.so.13");
  EXPECT_EQ(report["cuda_libraries"][0]["version"], "13.0");
  const std::string md = RenderMarkdown(report);
  EXPECT_THAT(md, HasSubstr("**1 passed, 0 failed, 2 skipped**"));
  EXPECT_THAT(md, HasSubstr("No GPU: no nvidia-smi"));
  EXPECT_THAT(md, HasSubstr("| libcublas.so.13 | /x/libcublas.so.13 | 13.0"));
  EXPECT_THAT(md, HasSubstr("| 3 | bench-kernels-bf16 | **skipped**"));
  EXPECT_THAT(md, HasSubstr("stand-ins were used): libnccl.so.2"));

  Write("checks/04-bad.rec", "name=x\n");
  EXPECT_THAT(BuildReport(dir_), StatusIs(absl::StatusCode::kInvalidArgument,
                                          HasSubstr("04-bad.rec")));
}

// torch_step_bench.py's JSON: five rows, one skipped for memory; the
// script's own ratio in the first row is wrong on purpose (the report
// computes its ratios from the medians).
constexpr char kTorchStepBench[] = R"({
  "status": "passed", "reason": "8b fp32: out of memory: torch side: ...",
  "torch": "2.9.0+cu130", "device": "NVIDIA H200",
  "reference": "torch.optim.Muon + torch.optim.AdamW",
  "rows": [
    {"size": "100m", "dtype": "fp32", "status": "measured", "reason": "",
     "params": 105000000, "canzona_step_ms": 2, "torch_step_ms": 5,
     "step_ratio": 99, "canzona_iteration_ms": 10, "torch_iteration_ms": 14,
     "canzona_daemon": {"phases_ms": {"reduce_scatter": 0.01,
                                      "local_compute": 1.25, "total": 1.5},
                        "host_waits": 5, "pageable_copies": 0}},
    {"size": "0.6b", "dtype": "fp32", "status": "measured", "reason": "",
     "params": 751632384, "canzona_step_ms": 4, "torch_step_ms": 14,
     "canzona_iteration_ms": 20, "torch_iteration_ms": 28},
    {"size": "0.6b", "dtype": "bf16", "status": "measured", "reason": "",
     "params": 751632384, "canzona_step_ms": 5, "torch_step_ms": 10,
     "canzona_iteration_ms": 20, "torch_iteration_ms": 32},
    {"size": "8b", "dtype": "fp32", "status": "skipped",
     "reason": "out of memory: torch side: OutOfMemoryError: CUDA oom",
     "params": 8190735360, "canzona_step_ms": 120, "torch_step_ms": null},
    {"size": "8b", "dtype": "bf16", "status": "measured", "reason": "",
     "params": 8190735360, "canzona_step_ms": 100, "torch_step_ms": 160,
     "canzona_iteration_ms": 900, "torch_iteration_ms": 960}]})";

TEST_F(ReportDir, TorchStepBenchTableAndGoals) {
  Write("env.txt", "gpu_present=1\ngpu_name=NVIDIA H200\n");
  WriteTorchStepBench(kTorchStepBench);
  ASSERT_OK_AND_ASSIGN(json report, BuildReport(dir_));
  EXPECT_EQ(report["checks"][0]["status"], "passed");
  const json& bench = report["torch_step_bench"];
  EXPECT_EQ(bench["device"], "NVIDIA H200");
  ASSERT_EQ(bench["rows"].size(), 5u);
  EXPECT_NEAR(bench["rows"][0]["step_ratio"].get<double>(), 2.5, 1e-12);
  EXPECT_NEAR(bench["rows"][0]["iteration_ratio"].get<double>(), 1.4, 1e-12);
  EXPECT_TRUE(bench["rows"][3]["step_ratio"].is_null());
  EXPECT_EQ(bench["rows"][3]["status"], "skipped");
  // Three goals, each for fp32 and bf16.
  ASSERT_EQ(bench["goals"].size(), 6u);
  auto goal = [&](const char* measure, const char* size, const char* dtype) {
    for (const json& g : bench["goals"]) {
      if (g["measure"] == measure && g["size"] == size && g["dtype"] == dtype) {
        return g;
      }
    }
    return json();
  };
  EXPECT_EQ(goal("step", "0.6b", "fp32")["status"], "met");
  EXPECT_EQ(goal("step", "0.6b", "bf16")["status"], "not met");
  EXPECT_EQ(goal("step", "8b", "fp32")["status"], "not measured");
  EXPECT_EQ(goal("step", "8b", "bf16")["status"], "met");
  EXPECT_EQ(goal("iteration", "0.6b", "fp32")["status"], "not met");
  EXPECT_EQ(goal("iteration", "0.6b", "bf16")["status"], "met");
  EXPECT_NEAR(goal("iteration", "0.6b", "bf16")["ratio"].get<double>(), 1.6,
              1e-12);

  const std::string md = RenderMarkdown(report);
  // The goals at a glance under the summary.
  EXPECT_THAT(md, HasSubstr(" checks.\n\n**Goals:** optimizer step 3 met, "
                            "2 not met, 1 not measured.\n"));
  EXPECT_THAT(md, HasSubstr("## Optimizer step (--comm nccl, DP1): "
                            "canzona.torch vs torch.optim.Muon + AdamW\n\nOn "
                            "**NVIDIA H200**"));
  EXPECT_THAT(md, HasSubstr("| 100m | fp32 | 105.0 M | 2.000 | 5.000 | 2.50x | "
                            "10.000 | 14.000 | 1.40x | measured |\n"));
  EXPECT_THAT(md, HasSubstr("| 0.6b | fp32 | 751.6 M | 4.000 | 14.000 | 3.50x "
                            "| 20.000 | 28.000 | 1.40x | measured |\n"));
  EXPECT_THAT(md, HasSubstr("| 8b | fp32 | 8190.7 M | 120.000 | – | – | – | – "
                            "| – | skipped: out of memory: torch side: "
                            "OutOfMemoryError: CUDA oom |\n"));
  EXPECT_THAT(md, HasSubstr("- step >= 3.0x faster than torch at 0.6b, fp32: "
                            "**met** (3.50x)\n"));
  // The daemon's breakdown of the rows that have one (phases under 0.05
  // ms left out).
  EXPECT_THAT(md, HasSubstr("- 100m fp32: local_compute 1.25 total 1.50; "
                            "host round trips 5; pageable copies 0\n"));
  EXPECT_THAT(md, Not(HasSubstr("reduce_scatter 0.01")));
  EXPECT_THAT(md, Not(HasSubstr("- 0.6b fp32:")));
  EXPECT_THAT(md, HasSubstr("- step >= 3.0x faster than torch at 0.6b, bf16: "
                            "**not met** (2.00x)\n"));
  EXPECT_THAT(md, HasSubstr("- step >= 1.5x faster than torch at 8b, fp32: "
                            "**not measured** (skipped: out of memory: torch "
                            "side: OutOfMemoryError: CUDA oom)\n"));
  EXPECT_THAT(md, HasSubstr("- step >= 1.5x faster than torch at 8b, bf16: "
                            "**met** (1.60x)\n"));
  EXPECT_THAT(md, HasSubstr("- iteration >= 1.5x faster than torch at 0.6b, "
                            "fp32: **not met** (1.40x)\n"));
  EXPECT_THAT(md, HasSubstr("- iteration >= 1.5x faster than torch at 0.6b, "
                            "bf16: **met** (1.60x)\n"));
}

// Fast and wrong is no goal met: where torch-check (the updates against
// torch's on the GPU) failed, every goal the times meet is "met,
// unverified", saying why; the goals not met stay so.
TEST_F(ReportDir, GoalsMetStayUnverifiedWhenTheTorchCheckFailed) {
  Write("env.txt", "gpu_present=1\ngpu_name=NVIDIA H200\n");
  WriteTorchStepBench(kTorchStepBench);
  Write("checks/02-check.rec",
        "name=torch-check\nkind=torch_check\nstate=ran\nexit_code=1\n"
        "log=logs/check.log\ndata=data/check.json\n");
  Write("logs/check.log", "");
  Write("data/check.json",
        R"({"status": "failed", "reason": "bf16: matrix update error 0.3"})");
  ASSERT_OK_AND_ASSIGN(json report, BuildReport(dir_));
  int unverified = 0;
  for (const json& g : report["torch_step_bench"]["goals"]) {
    EXPECT_NE(g["status"], "met");
    if (g["status"] == "met, unverified") {
      ++unverified;
      EXPECT_THAT(g["reason"].get<std::string>(),
                  HasSubstr("torch-check failed: bf16: matrix update error"));
    }
  }
  EXPECT_EQ(unverified, 3);
  const std::string md = RenderMarkdown(report);
  EXPECT_THAT(md, HasSubstr("**Goals:** optimizer step 0 met, 2 not met, 1 "
                            "not measured, 3 met but unverified (torch-check "
                            "failed).\n"));
  EXPECT_THAT(md, HasSubstr("- step >= 3.0x faster than torch at 0.6b, fp32: "
                            "**met, unverified** (3.50x; torch-check failed: "
                            "bf16: matrix update error 0.3)\n"));
  EXPECT_THAT(md, HasSubstr("- step >= 3.0x faster than torch at 0.6b, bf16: "
                            "**not met** (2.00x)\n"));
}

TEST_F(ReportDir, TorchStepBenchNotRunLeavesEveryGoalNotMeasured) {
  Write("checks/01-bench.rec",
        "name=torch-step-bench\nkind=torch_step_bench\nstate=skipped\n"
        "reason=no GPU (no nvidia-smi)\n");
  ASSERT_OK_AND_ASSIGN(json report, BuildReport(dir_));
  const json& bench = report["torch_step_bench"];
  EXPECT_TRUE(bench["rows"].empty());
  ASSERT_EQ(bench["goals"].size(), 6u);
  for (const json& g : bench["goals"]) {
    EXPECT_EQ(g["status"], "not measured");
    EXPECT_EQ(g["reason"], "check skipped: no GPU (no nvidia-smi)");
  }
  const std::string md = RenderMarkdown(report);
  EXPECT_THAT(md, HasSubstr("Nothing measured: skipped (no GPU (no "
                            "nvidia-smi))."));
  EXPECT_THAT(md, HasSubstr("- step >= 3.0x faster than torch at 0.6b, fp32: "
                            "**not measured** (check skipped: no GPU"));
  EXPECT_THAT(md, HasSubstr("**Goals:** optimizer step 0 met, 0 not met, 6 "
                            "not measured.\n"));
  // Without the check there is no section.
  std::filesystem::remove(dir_ / "checks/01-bench.rec");
  ASSERT_OK_AND_ASSIGN(report, BuildReport(dir_));
  EXPECT_TRUE(report["torch_step_bench"].is_null());
  EXPECT_THAT(RenderMarkdown(report),
              ::testing::Not(HasSubstr("Optimizer step")));
}

// The Gloo plane's run is its own check with its own goal (within 3x of
// torch at 100m), judged beside the NCCL plane's.
TEST_F(ReportDir, TorchStepBenchOnTheGlooPlaneHasItsOwnGoal) {
  Write("checks/01-bench.rec",
        "name=torch-step-bench\nkind=torch_step_bench\nstate=ran\n"
        "exit_code=0\nlog=logs/bench.log\ndata=data/bench.json\n");
  Write("checks/02-gloo.rec",
        "name=torch-step-bench-gloo\nkind=torch_step_bench\nstate=ran\n"
        "exit_code=0\nlog=logs/bench.log\ndata=data/gloo.json\n");
  Write("logs/bench.log", "");
  Write("data/bench.json", kTorchStepBench);
  Write("data/gloo.json",
        R"({"status": "passed", "device": "NVIDIA H100", "rows": [
            {"size": "100m", "dtype": "fp32", "status": "measured",
             "params": 105000000, "canzona_step_ms": 80, "torch_step_ms": 33,
             "canzona_iteration_ms": 150, "torch_iteration_ms": 100},
            {"size": "100m", "dtype": "bf16", "status": "measured",
             "params": 105000000, "canzona_step_ms": 120, "torch_step_ms": 30,
             "canzona_iteration_ms": 190, "torch_iteration_ms": 100}]})");
  ASSERT_OK_AND_ASSIGN(json report, BuildReport(dir_));
  EXPECT_EQ(report["torch_step_bench"]["goals"].size(), 6u);
  const json& gloo = report["torch_step_bench_gloo"];
  ASSERT_FALSE(gloo.is_null());
  EXPECT_EQ(gloo["plane"], "--backend cuda --comm gloo, DP1");
  ASSERT_EQ(gloo["goals"].size(), 2u);
  EXPECT_EQ(gloo["goals"][0]["dtype"], "fp32");
  EXPECT_EQ(gloo["goals"][0]["status"], "met");      // 33 / 80 >= 1 / 3
  EXPECT_EQ(gloo["goals"][1]["status"], "not met");  // 30 / 120 < 1 / 3
  const std::string md = RenderMarkdown(report);
  EXPECT_THAT(md, HasSubstr("## Optimizer step (--backend cuda --comm gloo, "
                            "DP1): canzona.torch vs torch.optim.Muon + AdamW"));
  EXPECT_THAT(md, HasSubstr("- step within 3.0x of torch at 100m, fp32: "
                            "**met** (0.41x)\n"));
  EXPECT_THAT(md, HasSubstr("- step within 3.0x of torch at 100m, bf16: "
                            "**not met** (0.25x)\n"));
  // The NCCL plane's section is still there, with its own goals.
  EXPECT_THAT(md, HasSubstr("- step >= 3.0x faster than torch at 0.6b, fp32: "
                            "**met** (3.50x)\n"));
  // The daemon's breakdown of the rows that have one (phases under 0.05
  // ms left out).
  EXPECT_THAT(md, HasSubstr("- 100m fp32: local_compute 1.25 total 1.50; "
                            "host round trips 5; pageable copies 0\n"));
  EXPECT_THAT(md, Not(HasSubstr("reduce_scatter 0.01")));
  EXPECT_THAT(md, Not(HasSubstr("- 0.6b fp32:")));
}

TEST_F(ReportDir, TorchStepBenchSmokeShapesJudgeNoGoal) {
  WriteTorchStepBench(
      R"({"status": "passed", "device": "cpu", "rows": [
            {"size": "0.6b", "dtype": "fp32", "status": "measured",
             "shapes_overridden": true, "params": 69856,
             "canzona_step_ms": 1.0, "torch_step_ms": 9.0,
             "canzona_iteration_ms": 2.0, "torch_iteration_ms": 9.0}]})");
  ASSERT_OK_AND_ASSIGN(json report, BuildReport(dir_));
  const json& bench = report["torch_step_bench"];
  EXPECT_NEAR(bench["rows"][0]["step_ratio"].get<double>(), 9.0, 1e-12);
  for (const json& g : bench["goals"]) {
    EXPECT_EQ(g["status"], "not measured");
  }
  const std::string md = RenderMarkdown(report);
  EXPECT_THAT(md, HasSubstr("| 4.50x | measured (shapes overridden) |\n"));
  EXPECT_THAT(md, HasSubstr("- step >= 3.0x faster than torch at 0.6b, fp32: "
                            "**not measured** (shapes overridden"));
}

}  // namespace
}  // namespace canzona::bundle
