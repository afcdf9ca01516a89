// Two real canzonad daemons on loopback for the integration tests: A
// coordinates (TCP on a free port), B joins it; both serve /metrics on a
// free loopback port. SIGTERM at destruction, which must exit 0.
//
//   Daemons daemons;                       // or Daemons(3, {"--flag", "v"})
//   Client::Connect(daemons.Target(0), ...);  // in a forked trainer
//   int port = daemons.MetricsPort(0);
//
// Thread-safety: for the test thread only. Needs CANZONAD_PATH.
#ifndef CANZONA_TESTS_INTEGRATION_DAEMONS_H_
#define CANZONA_TESTS_INTEGRATION_DAEMONS_H_

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace canzona {

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class Daemons {
 public:
  // `extra_flags` go to both daemons. Each serves /metrics on a free
  // loopback port (MetricsPort).
  explicit Daemons(double step_timeout_s = 20,
                   std::vector<std::string> extra_flags = {}) {
    dir_ =
        absl::StrCat(::testing::TempDir(), "/xproc_", getpid(), "_", ++count_);
    ::mkdir(dir_.c_str(), 0755);
    // A reused pid finds an earlier run's files: stale ready files would
    // name dead daemons' ports.
    for (const char* name : {"/a.ready", "/b.ready"}) {
      ::unlink((dir_ + name).c_str());
    }
    auto with_extra = [&](std::vector<std::string> args) {
      args.insert(args.end(), {"--metrics-address", "127.0.0.1:0"});
      args.insert(args.end(), extra_flags.begin(), extra_flags.end());
      return args;
    };
    a_ =
        Spawn(with_extra({"--unix-socket", Socket(0), "--listen", "127.0.0.1:0",
                          "--daemon-id", "a", "--ready-file", dir_ + "/a.ready",
                          "--step-timeout", std::to_string(step_timeout_s),
                          "--register-timeout", "30", "--backend", "cpu"}),
              dir_ + "/a.log");
    const std::string ready = WaitReady(dir_ + "/a.ready");
    port_ = JsonInt(ready, "tcp_port");
    metrics_port_[0] = JsonInt(ready, "metrics_port");
    b_args_ = with_extra({"--unix-socket", Socket(1), "--coordinator",
                          absl::StrCat("127.0.0.1:", port_), "--daemon-id",
                          "b", "--ready-file", dir_ + "/b.ready",
                          "--step-timeout", std::to_string(step_timeout_s),
                          "--register-timeout", "30", "--backend", "cpu"});
    StartB();
  }

  // SIGKILL daemon i (0: the coordinator) and reap it: a crash.
  void Kill(int i) {
    pid_t& pid = i == 0 ? a_ : b_;
    if (pid <= 0) return;
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    pid = -1;
  }
  // Starts daemon B again (after Kill(1)), joining the same coordinator.
  void StartB() {
    ::unlink((dir_ + "/b.ready").c_str());
    b_ = Spawn(b_args_, dir_ + "/b.log");
    metrics_port_[1] = JsonInt(WaitReady(dir_ + "/b.ready"), "metrics_port");
  }
  const std::string& dir() const { return dir_; }
  ~Daemons() {
    for (pid_t pid : {a_, b_}) {
      if (pid > 0) ::kill(pid, SIGTERM);
    }
    for (pid_t pid : {a_, b_}) {
      int status = 0;
      if (pid > 0) ::waitpid(pid, &status, 0);
      // A clean SIGTERM shutdown exits 0.
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
          << "daemon " << pid << " status " << status << "\n"
          << ReadFile(dir_ + "/a.log") << ReadFile(dir_ + "/b.log");
    }
  }
  std::string Socket(int i) const {
    return absl::StrCat(dir_, i == 0 ? "/a.sock" : "/b.sock");
  }
  std::string Target(int i) const { return "unix:" + Socket(i); }
  std::string Tcp() const { return absl::StrCat("127.0.0.1:", port_); }
  bool Alive() const { return ::kill(a_, 0) == 0 && ::kill(b_, 0) == 0; }
  // The /metrics port of daemon i (0: the coordinator).
  int MetricsPort(int i) const { return metrics_port_[i]; }
  std::string Log(int i) const {
    return ReadFile(dir_ + (i == 0 ? "/a.log" : "/b.log"));
  }

 private:
  pid_t Spawn(std::vector<std::string> args, const std::string& log) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      FILE* out = std::freopen(log.c_str(), "w", stderr);
      (void)out;
      std::vector<char*> argv;
      std::string path = CANZONAD_PATH;
      argv.push_back(path.data());
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::setenv("OPENBLAS_NUM_THREADS", "1", 1);
      ::execv(path.c_str(), argv.data());
      ::_exit(127);
    }
    return pid;
  }
  // `"key": <int>` of the ready file's JSON; 0 when absent.
  static int JsonInt(const std::string& json, const std::string& key) {
    const size_t at = json.find(absl::StrCat("\"", key, "\": "));
    if (at == std::string::npos) return 0;
    return std::atoi(json.c_str() + at + key.size() + 4);
  }
  std::string WaitReady(const std::string& path) {
    for (int i = 0; i < 200; ++i) {
      std::string text = ReadFile(path);
      if (!text.empty()) return text;
      absl::SleepFor(absl::Milliseconds(50));
    }
    ADD_FAILURE() << "daemon not ready: " << path;
    return "{\"tcp_port\": 0}";
  }

  static inline int count_ = 0;
  std::string dir_;
  pid_t a_ = -1, b_ = -1;
  std::vector<std::string> b_args_;
  int port_ = 0;
  int metrics_port_[2] = {0, 0};
};

}  // namespace canzona

#endif  // CANZONA_TESTS_INTEGRATION_DAEMONS_H_
