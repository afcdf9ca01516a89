// canzonactl status: what a daemon is doing: its jobs, their local ranks,
// steps done and the last step's latency per phase.
//
//   canzonactl status [--target unix:/run/user/1000/canzona/canzonad.sock]
#include <cstdio>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/ctl/commands.h"
#include "client/lib/client.h"

namespace canzona::ctl {

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
      std::printf("  %-10s %6s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n", "rank",
                  "steps", "rs_ms", "world_ms", "local_ms", "gather_ms",
                  "tp_ms", "scatter_ms", "ag_ms", "wait_ms", "total_ms");
      for (const auto& rank : job.local_ranks()) {
        const auto& s = rank.last_step_seconds();
        std::printf(
            "  %-10s %6lld %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f "
            "%9.3f\n",
            absl::StrCat(rank.rank().pp_rank(), ".", rank.rank().dp_rank(), ".",
                         rank.rank().tp_rank())
                .c_str(),
            static_cast<long long>(rank.steps_done()), 1e3 * s.reduce_scatter(),
            1e3 * s.world_reduce(), 1e3 * s.local_compute(),
            1e3 * s.tp_gather(), 1e3 * s.tp_compute(), 1e3 * s.tp_scatter(),
            1e3 * s.all_gather(), 1e3 * s.wait(), 1e3 * s.total());
      }
    }
  });
}

}  // namespace canzona::ctl
