// canzonactl status: what a daemon is doing: its jobs, their local ranks,
// steps done and the last step's latency per phase.
//
//   canzonactl status [--target unix:/run/user/1000/canzona/canzonad.sock]
#include <cstdio>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/ctl/commands.h"
#include "client/lib/client.h"
#include "proto/names/step_phases.h"

namespace canzona::ctl {
namespace {

// A phase's column: its name and "_ms", at least 9 wide.
int ColumnWidth(const StepPhase& phase) {
  const int named = static_cast<int>(std::string(phase.name).size()) + 3;
  return named > 9 ? named : 9;
}

}  // namespace

ConnectFlags& GlobalConnectFlags() {
  static ConnectFlags flags;
  return flags;
}

void AddConnectFlags(CLI::App* cmd) {
  cmd->add_option("--token", GlobalConnectFlags().token,
                  "job token for TCP targets (sent as a bearer token)")
      ->envname("CANZONA_JOB_TOKEN");
  cmd->add_option("--tls-ca", GlobalConnectFlags().tls_ca,
                  "CA (PEM file) of a TLS target")
      ->envname("CANZONA_TLS_CA");
}

std::unique_ptr<Client> ConnectOrExit(const std::string& target) {
  Client::Options options;
  options.connect_timeout = absl::Seconds(3);
  options.job_token = GlobalConnectFlags().token;
  options.tls_ca = GlobalConnectFlags().tls_ca;
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(target.empty() ? DefaultTarget() : target, options);
  if (!client.ok())
    throw CanzonactlExit(1, std::string(client.status().message()));
  return *std::move(client);
}

void AddStatusCommand(CLI::App& app) {
  auto target = std::make_shared<std::string>();
  CLI::App* cmd =
      app.add_subcommand("status", "Jobs, ranks and step latency of a daemon");
  AddConnectFlags(cmd);
  cmd->add_option("--target", *target,
                  "daemon address (default: the local daemon's unix socket)");
  cmd->callback([target] {
    std::unique_ptr<Client> client = ConnectOrExit(*target);
    absl::StatusOr<canzona::v1::GetStatusResponse> status = client->GetStatus();
    if (!status.ok()) {
      throw CanzonactlExit(1,
                           absl::StrCat("status: ", status.status().message()));
    }
    std::printf("canzonad %s at %s  backend %s  comm %s  jobs %d\n",
                status->version().c_str(), client->target().c_str(),
                status->backend().c_str(), status->comm().c_str(),
                status->jobs_size());
    for (const auto& job : status->jobs()) {
      std::printf(
          "job %s  PP%d x DP%d x TP%d  strategy %s  %s  ranks %d  plan %s\n",
          job.job_id().c_str(), job.layout().pp(), job.layout().dp(),
          job.layout().tp(), job.strategy().c_str(), job.state().c_str(),
          job.registered_ranks(), job.plan_digest().c_str());
      // One column per phase of kStepPhases, in milliseconds.
      std::string header = absl::StrFormat("  %-10s %6s", "rank", "steps");
      for (const StepPhase& phase : kStepPhases) {
        absl::StrAppendFormat(&header, " %*s", ColumnWidth(phase),
                              absl::StrCat(phase.name, "_ms"));
      }
      std::printf("%s\n", header.c_str());
      for (const auto& rank : job.local_ranks()) {
        const auto& s = rank.last_step_seconds();
        std::string line = absl::StrFormat(
            "  %-10s %6d",
            absl::StrCat(rank.rank().pp_rank(), ".", rank.rank().dp_rank(), ".",
                         rank.rank().tp_rank()),
            rank.steps_done());
        for (const StepPhase& phase : kStepPhases) {
          absl::StrAppendFormat(&line, " %*.3f", ColumnWidth(phase),
                                1e3 * (s.*phase.seconds)());
        }
        std::printf("%s\n", line.c_str());
        if (rank.pageable_host_bytes() > 0 || rank.pageable_copies() > 0) {
          std::printf(
              "    warning: %lld bytes of host memory the GPU copies to and "
              "from are not page-locked, %lld copies through them so far: "
              "raise canzonad's memlock limit (LimitMEMLOCK=infinity)\n",
              static_cast<long long>(rank.pageable_host_bytes()),
              static_cast<long long>(rank.pageable_copies()));
        }
      }
    }
  });
}

}  // namespace canzona::ctl
