// canzonactl checkpoint: save, load and inspect optimizer checkpoints.
//
//   canzonactl checkpoint inspect /ckpt/step-1000 [--json]
//   canzonactl checkpoint save --job J --dir /ckpt/step-1000 --step 1000 \
//       [--target unix:/run/.../canzonad.sock --target host:7070 ...]
//   canzonactl checkpoint load --job J --dir /ckpt/step-1000 [--target ...]
//
// save and load are collective over the job: canzonactl finds every rank of
// the job on each --target daemon (all of the job's daemons must be given)
// and calls the RPC for all of them at once. A save of a running job names
// the step after which it happens (--step), so every rank saves between
// the same two steps; load is meant for a job that has just registered.
// inspect reads the directory directly and validates every checksum.
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/ctl/commands.h"
#include "client/lib/client.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/checkpoint.h"
#include "server/optim/optimizer_config.h"

namespace canzona::ctl {
namespace {

struct RankCall {
  Client* client;
  canzona::v1::RankCoordinates rank;
  absl::Status status;
  std::string summary;
};

// Every rank of `job` on the targets; exits 1 unless they are all there
// (save and load are collective).
std::vector<RankCall> FindRanks(
    const std::vector<std::unique_ptr<Client>>& clients,
    const std::string& job) {
  int world = 0;
  std::vector<RankCall> calls;
  for (const auto& client : clients) {
    auto status = client->GetStatus();
    if (!status.ok()) {
      throw CanzonactlExit(
          1, absl::StrCat(client->target(), ": ", status.status().message()));
    }
    for (const auto& j : status->jobs()) {
      if (j.job_id() != job) continue;
      world = j.layout().pp() * j.layout().dp() * j.layout().tp();
      for (const auto& r : j.local_ranks()) {
        calls.push_back({client.get(), r.rank(), absl::OkStatus(), ""});
      }
    }
  }
  if (calls.empty()) {
    throw CanzonactlExit(
        1, absl::StrCat("job '", job, "' is not registered on any target"));
  }
  if (static_cast<int>(calls.size()) != world) {
    throw CanzonactlExit(
        1, absl::StrCat("found ", calls.size(), " of the job's ", world,
                        " ranks: give every daemon of the job as --target"));
  }
  return calls;
}

// Runs `call` for every rank at once (the RPCs are collective) and exits 1
// naming the first failure.
template <typename Fn>
void CallAll(std::vector<RankCall>& calls, Fn call) {
  std::vector<std::thread> threads;
  for (RankCall& c : calls) threads.emplace_back([&c, &call] { call(c); });
  for (auto& t : threads) t.join();
  for (const RankCall& c : calls) {
    const auto& r = c.rank;
    if (!c.status.ok()) {
      throw CanzonactlExit(
          1, absl::StrCat("rank pp", r.pp_rank(), ".dp", r.dp_rank(), ".tp",
                          r.tp_rank(), " at ", c.client->target(), ": ",
                          absl::StatusCodeToString(c.status.code()), ": ",
                          c.status.message()));
    }
  }
}

std::vector<std::unique_ptr<Client>> Connect(
    const std::vector<std::string>& targets) {
  std::vector<std::unique_ptr<Client>> clients;
  if (targets.empty()) clients.push_back(ConnectOrExit(""));
  for (const std::string& t : targets) clients.push_back(ConnectOrExit(t));
  return clients;
}

void PrintSummary(const CheckpointSummary& s, const std::string& dir) {
  const CheckpointManifest& m = s.manifest;
  std::printf(
      "checkpoint %s  format v%u  step %lld  layout PP%lld x DP%lld x TP%lld  "
      "strategy %s  plan %s\n",
      dir.c_str(), m.format_version, static_cast<long long>(m.step),
      static_cast<long long>(m.layout.pp), static_cast<long long>(m.layout.dp),
      static_cast<long long>(m.layout.tp), m.strategy.c_str(),
      m.plan_digest.c_str());
  std::printf("shards %zu  files %llu bytes  state %lld bytes  params %zu\n",
              m.shards.size(),
              static_cast<unsigned long long>(s.total_file_bytes),
              static_cast<long long>(s.total_state_bytes), s.params.size());
  for (const auto& [kind, count] : s.kinds) {
    std::printf("  %-8s %lld parameters\n", kind.c_str(),
                static_cast<long long>(count));
  }
  std::printf("%-56s %-8s %6s %7s %12s  %s\n", "parameter", "kind", "step",
              "tensors", "state_bytes", "file");
  for (const auto& p : s.params) {
    std::printf("%-56s %-8s %6lld %7lld %12lld  %s\n", p.name.c_str(),
                std::string(OptimizerKindName(p.kind)).c_str(),
                static_cast<long long>(p.step),
                static_cast<long long>(p.tensors),
                static_cast<long long>(p.state_bytes), p.file.c_str());
  }
}

nlohmann::json SummaryJson(const CheckpointSummary& s) {
  nlohmann::json j = nlohmann::json::parse(ManifestToJson(s.manifest));
  j["total_file_bytes"] = s.total_file_bytes;
  j["total_state_bytes"] = s.total_state_bytes;
  j["min_step"] = s.min_step;
  j["max_step"] = s.max_step;
  j["kinds"] = s.kinds;
  nlohmann::json params = nlohmann::json::array();
  for (const auto& p : s.params) {
    params.push_back({{"name", p.name},
                      {"kind", std::string(OptimizerKindName(p.kind))},
                      {"step", p.step},
                      {"tensors", p.tensors},
                      {"state_bytes", p.state_bytes},
                      {"file", p.file}});
  }
  j["params"] = std::move(params);
  return j;
}

}  // namespace

void AddCheckpointCommand(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "checkpoint", "Save, load or inspect optimizer checkpoints");
  cmd->require_subcommand(1);

  struct Args {
    std::string dir, job;
    std::vector<std::string> targets;
    int64_t step = 0;
    bool json = false;
    bool allow_missing = false;
  };
  auto args = std::make_shared<Args>();

  CLI::App* inspect =
      cmd->add_subcommand("inspect", "Validate a checkpoint and list it");
  inspect->add_option("dir", args->dir, "checkpoint directory")->required();
  inspect->add_flag("--json", args->json, "machine-readable output");
  inspect->callback([args] {
    auto reader = CheckpointReader::Open(args->dir);
    if (!reader.ok()) {
      throw CanzonactlExit(
          1, absl::StrCat(absl::StatusCodeToString(reader.status().code()),
                          ": ", reader.status().message()));
    }
    if (args->json) {
      std::printf("%s\n", SummaryJson((*reader)->Inspect()).dump(2).c_str());
    } else {
      PrintSummary((*reader)->Inspect(), args->dir);
    }
  });

  CLI::App* save = cmd->add_subcommand(
      "save", "Save a job's optimizer state (every rank, collectively)");
  CLI::App* load = cmd->add_subcommand(
      "load", "Load a checkpoint into a registered job (every rank)");
  for (CLI::App* sub : {save, load}) {
    AddConnectFlags(sub);
    sub->add_option("--job", args->job, "job id")->required();
    sub->add_option("--dir", args->dir,
                    "checkpoint directory (absolute, reachable by every "
                    "daemon)")
        ->required();
    sub->add_option("--target", args->targets,
                    "every daemon of the job (repeat; default: the local "
                    "daemon's unix socket)");
  }
  save->add_option("--step", args->step,
                   "save right after this step on every rank (0: now; "
                   "only for a job whose trainers are idle)")
      ->check(CLI::NonNegativeNumber);
  save->callback([args] {
    auto clients = Connect(args->targets);
    std::vector<RankCall> calls = FindRanks(clients, args->job);
    CallAll(calls, [&](RankCall& c) {
      auto r =
          c.client->SaveCheckpoint(args->job, c.rank, args->dir, args->step);
      c.status = r.status();
      if (r.ok()) {
        c.summary = absl::StrFormat("%d records, %d bytes, %.3f s",
                                    r->records(), r->bytes(), r->seconds());
      }
    });
    std::printf("saved job %s to %s (%zu ranks)\n", args->job.c_str(),
                args->dir.c_str(), calls.size());
  });
  load->add_flag("--allow-missing", args->allow_missing,
                 "parameters the checkpoint has no record of keep their "
                 "state and values (a layer unfrozen or added since)");
  load->callback([args] {
    auto clients = Connect(args->targets);
    std::vector<RankCall> calls = FindRanks(clients, args->job);
    int64_t step = 0;
    std::set<std::string> missing;  // over every stage
    absl::Mutex mu;
    CallAll(calls, [&](RankCall& c) {
      auto r = c.client->LoadCheckpoint(args->job, c.rank, args->dir,
                                        args->allow_missing);
      c.status = r.status();
      if (!r.ok()) return;
      absl::MutexLock lock(&mu);
      step = r->step();
      missing.insert(r->missing().begin(), r->missing().end());
    });
    std::printf("loaded %s into job %s (%zu ranks); next step is %lld\n",
                args->dir.c_str(), args->job.c_str(), calls.size(),
                static_cast<long long>(step + 1));
    if (!missing.empty()) {
      std::printf("not in the checkpoint (state and values kept): %s\n",
                  absl::StrJoin(missing, ", ").c_str());
    }
  });
}

}  // namespace canzona::ctl
