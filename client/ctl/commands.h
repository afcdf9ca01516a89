// canzonactl subcommands. Each Add*Command registers one subcommand (its
// options and a callback) on the top-level CLI11 app. Callbacks report a
// usage or input problem by throwing CanzonactlExit(2, "one line naming the
// problem"); main() prints it and exits with that code, so nothing is written
// on bad input.
//
// Thread-safety: single-threaded command-line code.
#ifndef CANZONA_CLIENT_CTL_COMMANDS_H_
#define CANZONA_CLIENT_CTL_COMMANDS_H_

#include <memory>
#include <stdexcept>
#include <string>

#include "CLI/CLI.hpp"
#include "client/lib/client.h"

namespace canzona::ctl {

// Thrown by a subcommand callback to end the program with `code`.
class CanzonactlExit : public std::runtime_error {
 public:
  CanzonactlExit(int code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

void AddPlanCommand(CLI::App& app);
void AddReplayCommand(CLI::App& app);
void AddBenchCommand(CLI::App& app);
// `canzonactl bench step` (step_bench_command.cc), under `bench`.
void AddBenchStepCommand(CLI::App* bench);
void AddStatusCommand(CLI::App& app);
void AddCheckpointCommand(CLI::App& app);
// `canzonactl simulate` (simulate_command.cc), `canzonactl calibrate`
// (calibrate_command.cc).
void AddSimulateCommand(CLI::App& app);
void AddCalibrateCommand(CLI::App& app);

// How subcommands that talk to a daemon authenticate on TCP targets: the
// job token (sent as a bearer token) and the CA of a TLS listener.
struct ConnectFlags {
  std::string token;
  std::string tls_ca;
};
ConnectFlags& GlobalConnectFlags();
// Adds --token ($CANZONA_JOB_TOKEN) and --tls-ca ($CANZONA_TLS_CA) to `cmd`.
void AddConnectFlags(CLI::App* cmd);

// A client connected to `target` (empty: DefaultTarget(), the local
// daemon's unix socket) or CanzonactlExit(1, "cannot reach canzonad at ...").
std::unique_ptr<Client> ConnectOrExit(const std::string& target);

}  // namespace canzona::ctl

#endif  // CANZONA_CLIENT_CTL_COMMANDS_H_
