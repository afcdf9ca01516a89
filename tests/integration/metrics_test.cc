// A live daemon's /metrics after a short job across two real canzonad
// processes: the contract's families (server/metrics/README.md) carry the
// job's steps, phases, comm bytes and RPCs, the HTTP answer has the exact
// Prometheus Content-Type, and `promtool check metrics` accepts the text.
// This process forks trainers, so it talks plain-socket HTTP, not gRPC.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/lib/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/daemons.h"
#include "tests/integration/trainer_process.h"
#include "tests/matchers/exposed_samples.h"
#include "tests/unit/engine/engine_test_util.h"

namespace canzona {
namespace {

using ::testing::HasSubstr;

// GET http://127.0.0.1:<port><path> over a plain socket: the whole
// response, headers included (empty when the connection fails).
std::string HttpGet(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request =
        absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    if (::send(fd, request.data(), request.size(), 0) ==
        static_cast<ssize_t>(request.size())) {
      char buf[8192];
      ssize_t n;
      while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) response.append(buf, n);
    }
  }
  ::close(fd);
  return response;
}

// One trainer process: register, `steps` steps, deregister. Exit 0 on
// success.
[[noreturn]] void RunTrainer(const Daemons& daemons,
                             const engine_test::JobConfig& config, int global,
                             int steps) {
  auto owned = std::make_unique<engine_test::TrainerRank>(config, global);
  engine_test::TrainerRank& rank = *owned;
  if (!rank.Init().ok()) ExitTrainer(owned, 10);
  Client::Options options;
  options.job_token = config.token;
  options.step_timeout = absl::Seconds(60);
  auto client = Client::Connect(daemons.Target(rank.engine_index()), options);
  if (!client.ok()) ExitTrainer(owned, 11);
  if (!(*client)->Register(rank.MakeRegister()).ok()) ExitTrainer(owned, 12);
  for (int s = 1; s <= steps; ++s) {
    rank.WriteGrads(s);
    if (!(*client)->Step(rank.MakeStep(s)).ok()) ExitTrainer(owned, 13);
  }
  (void)(*client)->Deregister(config.job_id, rank.MakeStep(1).rank());
  ExitTrainer(owned, 0);
}

TEST(MetricsIntegrationTest, LiveDaemonExportsTheContractAndPassesPromtool) {
  Daemons daemons;
  ASSERT_GT(daemons.MetricsPort(0), 0);
  ASSERT_GT(daemons.MetricsPort(1), 0);
  engine_test::JobConfig config;
  config.job_id = engine_test::UniqueJobId("metrics");
  config.dp = 2;
  config.tp = 2;  // TP micro groups, all-to-all and overlap
  config.strategy = "cost";
  config.params = engine_test::MegatronModel();
  constexpr int kSteps = 3;
  std::vector<pid_t> pids;
  for (int g = 0; g < config.world(); ++g) {
    const pid_t pid = ::fork();
    if (pid == 0) RunTrainer(daemons, config, g, kSteps);
    pids.push_back(pid);
  }
  for (size_t g = 0; g < pids.size(); ++g) {
    EXPECT_EQ(WaitExit(pids[g]), 0) << "rank " << g;
  }

  // The coordinator serves ranks 0 and 1 (the first half of the world).
  const std::string response = HttpGet(daemons.MetricsPort(0), "/metrics");
  ASSERT_THAT(response, ::testing::StartsWith("HTTP/1.1 200 OK\r\n"))
      << response;
  EXPECT_THAT(response,
              HasSubstr("\r\nContent-Type: text/plain; version=0.0.4; "
                        "charset=utf-8\r\n"));
  const size_t at = response.find("\r\n\r\n");
  ASSERT_NE(at, std::string::npos);
  const std::string text = response.substr(at + 4);
  const std::map<std::string, double> samples = ExposedSamples(text);
  auto value = [&](const std::string& key) {
    auto it = samples.find(key);
    EXPECT_NE(it, samples.end()) << key << " missing in\n" << text;
    return it == samples.end() ? -1.0 : it->second;
  };
  const std::string job = absl::StrCat("job=\"", config.job_id, "\"");
  for (const char* rank : {"0", "1"}) {
    const std::string jr = absl::StrCat(job, ",rank=\"", rank, "\"");
    EXPECT_EQ(value(absl::StrCat("canzona_steps_total{", jr, "}")), kSteps);
    EXPECT_EQ(value(absl::StrCat("canzona_steps_skipped_total{", jr, "}")), 0);
    // At least the sums' wait per step (the cpu backend counts where a GPU
    // would wait).
    EXPECT_GE(value(absl::StrCat("canzona_step_host_waits_total{", jr, "}")),
              kSteps);
    // Host memory on both sides: no copy meets a GPU.
    EXPECT_EQ(
        value(absl::StrCat("canzona_step_pageable_copies_total{", jr, "}")), 0);
    EXPECT_EQ(value(absl::StrCat("canzona_rank_pageable_host_bytes{", jr, "}")),
              0);
    for (const char* phase :
         {"reduce_scatter", "world_reduce", "local_compute", "tp_gather",
          "tp_compute", "tp_scatter", "all_gather", "wait", "total"}) {
      EXPECT_EQ(value(absl::StrCat("canzona_step_phase_seconds_count{", jr,
                                   ",phase=\"", phase, "\"}")),
                kSteps)
          << phase;
    }
    EXPECT_GT(value(absl::StrCat("canzona_step_phase_seconds_sum{", jr,
                                 ",phase=\"total\"}")),
              0);
    EXPECT_EQ(value(absl::StrCat("canzona_step_phase_seconds_bucket{", jr,
                                 ",phase=\"total\",le=\"+Inf\"}")),
              kSteps);
    for (const char* kind :
         {"reduce_scatter", "all_gather", "all_reduce", "tp_all_to_all"}) {
      EXPECT_GT(value(absl::StrCat("canzona_comm_sent_bytes_total{", jr,
                                   ",kind=\"", kind, "\"}")),
                0)
          << kind;
    }
    EXPECT_GT(value(absl::StrCat("canzona_rank_compute_flops{", jr, "}")), 0);
    EXPECT_GT(value(absl::StrCat("canzona_optimizer_state_bytes{", jr, "}")),
              0);
    const double overlap =
        value(absl::StrCat("canzona_tp_overlap_ratio{", jr, "}"));
    EXPECT_GE(overlap, 0);
    EXPECT_LE(overlap, 1);
  }
  EXPECT_GE(value(absl::StrCat("canzona_plan_max_over_mean{", job, "}")), 1);
  EXPECT_GE(value(absl::StrCat("canzona_plan_makespan_over_lb{", job, "}")), 1);
  EXPECT_EQ(value(absl::StrCat("canzona_registered_parameters{", job, "}")),
            static_cast<double>(config.params.size()));
  EXPECT_EQ(value("canzona_rpc_requests_total{method=\"Step\",code=\"OK\"}"),
            2 * kSteps);
  EXPECT_EQ(
      value("canzona_rpc_requests_total{method=\"Register\",code=\"OK\"}"), 2);
  EXPECT_EQ(value("canzona_build_info{version=\"0.1.0\",backend=\"cpu\","
                  "comm=\"gloo\"}"),
            1);
  EXPECT_GT(value("process_resident_memory_bytes"), 0);
  EXPECT_GT(value("process_open_fds"), 0);
  EXPECT_GT(value("process_start_time_seconds"), 1.6e9);
  EXPECT_GE(value("process_cpu_seconds_total"), 0);
  // The other daemon has ranks 2 and 3.
  EXPECT_THAT(HttpGet(daemons.MetricsPort(1), "/metrics"),
              HasSubstr(absl::StrCat("canzona_steps_total{", job,
                                     ",rank=\"3\"} ", kSteps, "\n")));
  EXPECT_THAT(HttpGet(daemons.MetricsPort(0), "/"),
              ::testing::StartsWith("HTTP/1.1 404"));

  // promtool (Debian package prometheus, installed by tests/run.sh): the
  // text parses and passes its lint. Missing promtool fails the test.
  const std::string file =
      absl::StrCat(::testing::TempDir(), "/metrics_", ::getpid(), ".txt");
  {
    std::ofstream out(file);
    out << text;
  }
  const std::string log = file + ".promtool";
  const std::string command = absl::StrCat(PROMTOOL_PATH, " check metrics < ",
                                           file, " > ", log, " 2>&1");
  EXPECT_EQ(std::system(command.c_str()), 0) << command << "\n"
                                             << ReadFile(log) << "\n"
                                             << text;
}

}  // namespace
}  // namespace canzona
