// canzona-bridge: the C++ client as a child process speaking
// newline-delimited JSON on stdin / stdout (json_bridge.h), for the Python
// package where grpcio and protobuf are not installed.
//
//   canzona-bridge [--target unix:/run/user/1000/canzona/canzonad.sock]
//       [--connect-timeout 10] [--register-timeout 600] [--step-timeout 600]
//       [--checkpoint-timeout 1800] [--job-token T] [--tls-ca ca.pem]
//
// The target defaults to $CANZONA_TARGET, else the local daemon's socket;
// the token and CA to $CANZONA_JOB_TOKEN and $CANZONA_TLS_CA (what the
// Python client passes them in). The first line out (id 0) says whether the
// daemon answered: {"id":0,"response":{"target":...}}, or an error line and
// exit status 1. Then every request line gets its answer line. At the end of
// stdin the bridge answers what is in flight and exits 0; when its parent
// dies it exits at once, whether or not its stdin ends (a trainer killed
// mid-step, whose forked workers still hold the pipe, must not leave a
// bridge holding its rank: the daemon watches this process's pid). Bad
// flags: one line on stderr, exit status 2.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/bridge/json_bridge.h"
#include "client/lib/client.h"

namespace canzona {
namespace {

void WriteLine(std::string_view line) {
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

// Exits the process when its parent is gone (re-parented: getppid changes),
// even while requests block in the daemon. The parent is
// $CANZONA_BRIDGE_PARENT_PID when set (the Python client sets it: a parent
// that dies while this process still starts up is then noticed too), else
// the parent at startup.
void ExitWithParent() {
  pid_t parent = ::getppid();
  if (const char* pid = std::getenv("CANZONA_BRIDGE_PARENT_PID");
      pid != nullptr && *pid != '\0') {
    int value = 0;
    if (absl::SimpleAtoi(pid, &value)) parent = value;
  }
  std::thread([parent] {
    while (::getppid() == parent) absl::SleepFor(absl::Milliseconds(200));
    std::_Exit(1);
  }).detach();
}

}  // namespace
}  // namespace canzona

int main(int argc, char** argv) {
  std::string target;
  double connect_timeout = 10, register_timeout = 600, step_timeout = 600,
         checkpoint_timeout = 1800;
  canzona::Client::Options options;
  CLI::App app{
      "Canzona's C++ client as newline-delimited JSON on stdin/stdout"};
  app.add_option("--target", target,
                 "daemon address (default: the local daemon's unix socket)")
      ->envname("CANZONA_TARGET");
  // Seconds > 0 (CLI11's own range check prints DBL_MAX in full).
  const CLI::Validator seconds(
      [](std::string& value) -> std::string {
        double d = 0;
        if (absl::SimpleAtod(value, &d) && d > 0) return "";
        return "must be a number of seconds > 0, got '" + value + "'";
      },
      "SECONDS > 0");
  app.add_option("--connect-timeout", connect_timeout, "seconds")
      ->capture_default_str()
      ->check(seconds);
  app.add_option("--register-timeout", register_timeout, "seconds")
      ->capture_default_str()
      ->check(seconds);
  app.add_option("--step-timeout", step_timeout, "seconds")
      ->capture_default_str()
      ->check(seconds);
  app.add_option("--checkpoint-timeout", checkpoint_timeout, "seconds")
      ->capture_default_str()
      ->check(seconds);
  app.add_option("--job-token", options.job_token,
                 "job token for TCP targets (sent as a bearer token)")
      ->envname("CANZONA_JOB_TOKEN");
  app.add_option("--tls-ca", options.tls_ca, "CA (PEM file) of a TLS target")
      ->envname("CANZONA_TLS_CA");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // Usage errors: one line naming the flag, status 2 (as canzonactl).
    std::fprintf(stderr, "canzona-bridge: %s\n", e.what());
    return 2;
  }
  if (target.empty()) target = canzona::DefaultTarget();
  options.connect_timeout = absl::Seconds(connect_timeout);
  options.register_timeout = absl::Seconds(register_timeout);
  options.step_timeout = absl::Seconds(step_timeout);
  options.checkpoint_timeout = absl::Seconds(checkpoint_timeout);

  canzona::ExitWithParent();
  absl::StatusOr<std::unique_ptr<canzona::Client>> client =
      canzona::Client::Connect(target, options);
  canzona::WriteLine(canzona::JsonBridge::HelloLine(client.status(), target));
  if (!client.ok()) return 1;
  {
    canzona::JsonBridge bridge(**client, canzona::WriteLine);
    std::ios::sync_with_stdio(false);
    std::string line;
    while (std::getline(std::cin, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty()) continue;
      bridge.Submit(line);
    }
    bridge.Drain();
  }
  return 0;
}
