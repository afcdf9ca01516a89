// canzonactl bench step: a synthetic trainer against running daemons that
// measures, side by side in one run, how much DP communication the overlap
// (GradReady / async Step / WaitParams) hides, what hierarchical sharding
// (shard_group_size) does to the step latency, and the daemons' memory per
// rank (what Register reports by kind, and the private memory the local
// daemons grew by, next to the rank's parameter bytes), and with --doorbell
// the step calls over gRPC against the step doorbell (mode doorbell, and
// with --overlap mode overlap_doorbell).
//
//   canzonactl bench step [--target unix:/a.sock --target unix:/b.sock]
//       [--model qwen3-0.6b --layers 2 --vocab 4096] [--dp 2 --tp 1]
//       [--backward-ms 20 --forward-ms 10] [--overlap] [--doorbell]
//       [--shard-group-size S] [--steps 10 --warmup 2] [--json]
//
// Ranks are threads of this process, each with its own Client to the daemon
// that serves it (contiguous blocks of world / #targets global ranks per
// target) and its own shared buffers. Trainer compute is simulated: sleeps
// (GPU work does not use the host CPU) or, with --busy, spins. Modes run one
// after the other, each as a fresh job.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/ctl/commands.h"
#include "client/ctl/daemon_memory.h"
#include "client/ctl/model_shapes.h"
#include "client/ctl/step_bench.h"
#include "client/lib/client.h"
#include "kernels/base/dtype.h"
#include "kernels/base/status_macros.h"
#include "server/plan/cost_model.h"
#include "server/plan/model_config.h"
#include "server/plan/parameter.h"

namespace canzona::ctl {
namespace {

using step_bench::LocalParam;
using step_bench::Mode;
using step_bench::ModeResult;
using step_bench::PrintJson;
using step_bench::PrintTables;
using step_bench::RankResult;
using step_bench::RunRank;
using step_bench::StepBenchOptions;
using step_bench::Summarize;

// The bucket count the planner forms over these local sizes: filled in
// reverse parameter order, closed once they reach bucket_size elements.
int CountBuckets(const std::vector<LocalParam>& params, int64_t bucket_size) {
  int buckets = 0;
  int64_t filled = 0;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    filled += it->fragment_numel;
    if (filled >= bucket_size) {
      ++buckets;
      filled = 0;
    }
  }
  return buckets + (filled > 0 ? 1 : 0);
}

// The largest power-of-two fraction of the model that still gives >= 4
// buckets (or one bucket per parameter when there are fewer than 4).
int64_t DefaultBucketSize(const std::vector<LocalParam>& params) {
  int64_t total = 0;
  for (const LocalParam& p : params) total += p.fragment_numel;
  int64_t size = std::max<int64_t>(1, total / 4);
  const int want = std::min<int>(4, static_cast<int>(params.size()));
  while (size > 1 && CountBuckets(params, size) < want) size /= 2;
  return size;
}

absl::StatusOr<std::vector<LocalParam>> ModelParams(const StepBenchOptions& o) {
  CANZONA_ASSIGN_OR_RETURN(
      plan::ModelConfig config,
      plan::LoadModelConfig(ResolveModelsDir(o.models_dir), o.model));
  CANZONA_ASSIGN_OR_RETURN(plan::ModelLayout layout,
                           plan::ParseModelLayout(o.layout));
  CANZONA_ASSIGN_OR_RETURN(plan::OptimizerKind matrix,
                           plan::ParseOptimizerKind(o.optimizer));
  // A few layers and a small vocabulary of the real model's shapes.
  config.num_hidden_layers = o.layers;
  config.vocab_size = o.vocab;
  CANZONA_ASSIGN_OR_RETURN(
      std::vector<plan::ParamSpec> specs,
      plan::BuildModelParameters(config, layout, matrix, {1, o.dp, o.tp},
                                 plan::DType::kFloat32));
  std::vector<LocalParam> params;
  for (const plan::ParamSpec& spec : specs) {
    LocalParam p;
    p.name = spec.name;
    p.shape = spec.shape;
    p.split_dim = spec.tp_split_dim;
    p.group =
        spec.optimizer == plan::OptimizerKind::kAdamW ? "adamw" : o.optimizer;
    p.fragment_numel = plan::LocalNumel(spec, o.tp);
    params.push_back(std::move(p));
  }
  return params;
}

void Fail(int code, const std::string& message) {
  throw CanzonactlExit(code, absl::StrCat("bench step: ", message));
}

// --require-page-locked: after the output, exit 1 when any step copied
// between a GPU and pageable host memory, which measures a machine whose
// memlock limit refused cudaHostRegister rather than the daemon.
void CheckPageLocked(const StepBenchOptions& o,
                     const std::vector<ModeResult>& results) {
  int64_t copies = 0;
  for (const ModeResult& r : results) copies += r.pageable_copies;
  if (o.require_page_locked && copies > 0) {
    Fail(1, absl::StrCat(copies,
                         " copies between a GPU and pageable host memory "
                         "(StepResponse.pageable_copies; the daemon's "
                         "memlock limit refused cudaHostRegister) with "
                         "--require-page-locked"));
  }
}

// The modes to run, one after the other: plain, then with the doorbell and
// with the overlap where asked, flat and with the shard group size.
std::vector<Mode> BenchModes(const StepBenchOptions& o) {
  std::vector<Mode> modes;
  std::vector<int> shard_sizes = {0};
  if (o.shard_group_size != 0) shard_sizes.push_back(o.shard_group_size);
  for (int s : shard_sizes) {
    const std::string shard = o.shard_group_size == 0 ? ""
                              : s == 0                ? "flat/"
                                       : absl::StrCat("S=", s, "/");
    modes.push_back({absl::StrCat(shard, "plain"), s, false});
    if (o.doorbell) {
      modes.push_back({absl::StrCat(shard, "doorbell"), s, false, true});
    }
    if (o.overlap) modes.push_back({absl::StrCat(shard, "overlap"), s, true});
    if (o.overlap && o.doorbell) {
      modes.push_back({absl::StrCat(shard, "overlap_doorbell"), s, true, true});
    }
  }
  return modes;
}

// One client per rank, to the daemon serving its block of ranks.
std::vector<std::unique_ptr<Client>> ConnectClients(const StepBenchOptions& o,
                                                    int world) {
  const int targets = static_cast<int>(o.targets.size());
  Client::Options client_options;
  client_options.connect_timeout = absl::Seconds(10);
  client_options.job_token = GlobalConnectFlags().token;
  client_options.tls_ca = GlobalConnectFlags().tls_ca;
  client_options.register_timeout = absl::Seconds(o.timeout_s);
  client_options.step_timeout = absl::Seconds(o.timeout_s);
  std::vector<std::unique_ptr<Client>> clients;
  for (int g = 0; g < world; ++g) {
    const std::string& target = o.targets[g / (world / targets)];
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(target, client_options);
    if (!client.ok()) Fail(1, std::string(client.status().message()));
    clients.push_back(*std::move(client));
  }
  return clients;
}

// What the local daemons' memory probe needs: their pids and the ranks
// they serve.
struct LocalDaemons {
  std::vector<pid_t> pids;
  int ranks = 0;
};

// Runs one mode as a fresh job on every rank (a thread each); exits 1
// naming the rank whose failure is most likely the cause.
ModeResult RunMode(const StepBenchOptions& o, const Mode& mode,
                   const std::string& run_id,
                   const std::vector<LocalParam>& params, int64_t bucket_size,
                   int64_t param_bytes,
                   const std::vector<std::unique_ptr<Client>>& clients,
                   const LocalDaemons& local) {
  const int world = o.dp * o.tp;
  std::string tag = mode.name;
  std::replace(tag.begin(), tag.end(), '/', '-');
  tag.erase(std::remove(tag.begin(), tag.end(), '='), tag.end());
  const std::string job_id = absl::StrCat("bench-", run_id, "-", tag);
  std::vector<RankResult> ranks(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  DaemonMemoryProbe probe(world, local.pids);
  const int64_t before = probe.Read();
  for (int g = 0; g < world; ++g) {
    threads.emplace_back([&, g] {
      ranks[g].status =
          RunRank(o, mode, job_id, params, bucket_size, *clients[g], g / o.tp,
                  g % o.tp, probe, ranks[g]);
    });
  }
  for (std::thread& t : threads) t.join();
  // The first failure in time is usually the cause; a peer's timeout
  // follows from it. Prefer a status that is not DEADLINE_EXCEEDED.
  int failed = -1;
  for (int g = 0; g < world; ++g) {
    if (ranks[g].status.ok()) continue;
    if (failed < 0 ||
        (ranks[failed].status.code() == absl::StatusCode::kDeadlineExceeded &&
         ranks[g].status.code() != absl::StatusCode::kDeadlineExceeded)) {
      failed = g;
    }
  }
  if (failed >= 0) {
    Fail(1, absl::StrCat("mode ", mode.name, ": rank ", failed, " (",
                         clients[failed]->target(),
                         "): ", ranks[failed].status.message()));
  }
  ModeResult result = Summarize(mode, ranks);
  result.param_bytes = param_bytes;
  if (before >= 0 && probe.after() >= 0 && local.ranks > 0) {
    result.daemon_bytes_per_rank =
        static_cast<double>(probe.after() - before) / local.ranks;
  }
  if (!o.json) {
    std::fprintf(stderr, "mode %s done: median iteration %.1f ms\n",
                 mode.name.c_str(), result.median_iteration_ms);
  }
  return result;
}

void RunStepBench(StepBenchOptions o) {
  if (o.targets.empty()) o.targets.push_back(DefaultTarget());
  const int world = o.dp * o.tp;
  const int targets = static_cast<int>(o.targets.size());
  if (world % targets != 0) {
    Fail(2, absl::StrCat("dp x tp = ", world, " ranks cannot be dealt evenly ",
                         "to ", targets, " targets"));
  }
  if (o.shard_group_size != 0 &&
      (o.dp % o.shard_group_size != 0 || o.shard_group_size >= o.dp)) {
    Fail(2,
         absl::StrCat("--shard-group-size ", o.shard_group_size,
                      " must be a divisor of --dp ", o.dp, " smaller than it"));
  }
  if (!ParseDType(o.dtype).ok()) {
    Fail(2, absl::StrCat("--dtype: '", o.dtype, "' is not fp32, bf16 or fp16"));
  }
  absl::StatusOr<std::vector<LocalParam>> params = ModelParams(o);
  if (!params.ok()) Fail(2, std::string(params.status().message()));
  const int64_t bucket_size =
      o.bucket_size > 0 ? o.bucket_size : DefaultBucketSize(*params);
  int64_t total = 0;
  for (const LocalParam& p : *params) total += p.fragment_numel;

  const std::vector<std::unique_ptr<Client>> clients = ConnectClients(o, world);
  if (!o.json) {
    std::printf(
        "%s (%d layers, vocab %d, %s layout): %zu parameters, %.1f M "
        "elements per rank (%s); DP%d x TP%d on %d daemon(s), %s, strategy "
        "%s, bucket size %lld\n",
        o.model.c_str(), o.layers, o.vocab, o.layout.c_str(), params->size(),
        total / 1e6, o.dtype.c_str(), o.dp, o.tp, targets, o.optimizer.c_str(),
        o.strategy.c_str(), static_cast<long long>(bucket_size));
    std::printf(
        "trainer: backward %.1f ms, forward %.1f ms (%s); %d steps after %d "
        "warm-up; medians over steps of the slowest rank\n",
        o.backward_ms, o.forward_ms, o.busy ? "spinning" : "sleeping", o.steps,
        o.warmup);
    std::fflush(stdout);
  }

  // The local daemons (unix sockets), whose private memory is sampled.
  LocalDaemons local;
  for (const std::string& target : o.targets) {
    absl::StatusOr<pid_t> pid = DaemonPid(target);
    if (pid.ok()) local.pids.push_back(*pid);
  }
  local.ranks = static_cast<int>(local.pids.size()) * (world / targets);
  const int64_t param_bytes =
      total * DTypeBytes(ParseDType(o.dtype).value_or(DType::kFloat32));

  const std::string run_id =
      absl::StrCat(::getpid(), "-", absl::ToUnixMillis(absl::Now()) % 100000);
  std::vector<ModeResult> results;
  for (const Mode& mode : BenchModes(o)) {
    results.push_back(RunMode(o, mode, run_id, *params, bucket_size,
                              param_bytes, clients, local));
  }
  if (o.json) {
    PrintJson(o, *params, total, bucket_size, results);
  } else {
    PrintTables(results);
  }
  CheckPageLocked(o, results);
}

}  // namespace

void AddBenchStepCommand(CLI::App* bench) {
  auto o = std::make_shared<StepBenchOptions>();
  CLI::App* cmd = bench->add_subcommand(
      "step",
      "Overlap and hierarchical sharding against running daemons: a "
      "synthetic trainer, modes side by side");
  AddConnectFlags(cmd);
  cmd->add_option("--target", o->targets,
                  "daemon address, repeatable: ranks are dealt to targets in "
                  "contiguous blocks (default: the local daemon's unix "
                  "socket)");
  cmd->add_option("--model", o->model,
                  "model name in the models directory, or a .json path")
      ->capture_default_str();
  cmd->add_option("--models-dir", o->models_dir, kModelsDirHelp);
  cmd->add_option("--layers", o->layers, "layers kept of the model")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--vocab", o->vocab, "vocabulary size it is cut to")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--layout", o->layout, "megatron | hf")
      ->capture_default_str();
  cmd->add_option("--dp", o->dp, "data-parallel size")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--tp", o->tp, "tensor-parallel size")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--optimizer", o->optimizer,
                  "matrix optimizer: muon | shampoo | soap | adamw")
      ->capture_default_str();
  cmd->add_option("--strategy", o->strategy,
                  "sc | layerwise | start_anchored | alpha | cost")
      ->capture_default_str();
  cmd->add_option("--bucket-size", o->bucket_size,
                  "gradient bucket size in elements (default: the largest "
                  "power-of-two fraction of the model giving >= 4 buckets)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--steps", o->steps, "measured steps per mode")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--warmup", o->warmup, "steps left out of the statistics")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--backward-ms", o->backward_ms,
                  "simulated backward per iteration, spread over the buckets")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--forward-ms", o->forward_ms,
                  "simulated forward per iteration, spread over the buckets")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--busy", o->busy,
                "spin during simulated compute instead of sleeping");
  cmd->add_flag("--doorbell", o->doorbell,
                "after mode plain, run mode doorbell: the same Steps through "
                "each rank's step doorbell (shared memory, no gRPC; "
                "unix-socket targets); with --overlap also mode "
                "overlap_doorbell (GradReady, Step, WaitParams through it)");
  cmd->add_flag("--overlap", o->overlap,
                "run mode plain, then mode overlap (GradReady per bucket, "
                "async Step, WaitParams per bucket)");
  cmd->add_option("--shard-group-size", o->shard_group_size,
                  "also run hierarchical sharding with groups of S DP ranks "
                  "(after flat)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--timeout", o->timeout_s,
                  "deadline of Register and Step calls, seconds")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--dtype", o->dtype,
                  "trainer parameters and gradients: fp32 | bf16 | fp16 "
                  "(mixed precision: fp32 master weights in the daemon)")
      ->capture_default_str();
  cmd->add_flag("--json", o->json, "JSON output");
  cmd->add_flag("--require-page-locked", o->require_page_locked,
                "exit 1 after the output if any step copied between a GPU "
                "and pageable host memory (StepResponse.pageable_copies: a "
                "memlock limit that refused cudaHostRegister)");
  cmd->callback([o] { RunStepBench(*o); });
}

}  // namespace canzona::ctl