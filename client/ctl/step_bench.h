// The pieces of `canzonactl bench step` (step_bench_command.cc): its
// options, the modes it runs, one rank's synthetic trainer
// (step_bench_rank.cc) and the summary and output of what the ranks
// measured (step_bench_report.cc). Everything here runs on the rank threads
// or the command's thread that owns it; nothing is shared between ranks but
// the DaemonMemoryProbe, which synchronizes itself.
#ifndef CANZONA_CLIENT_CTL_STEP_BENCH_H_
#define CANZONA_CLIENT_CTL_STEP_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/ctl/daemon_memory.h"
#include "client/lib/client.h"
#include "proto/names/step_phases.h"

namespace canzona::ctl::step_bench {

struct StepBenchOptions {
  std::vector<std::string> targets;
  std::string model = "qwen3-0.6b";
  std::string models_dir;
  std::string layout = "megatron";
  int layers = 2;
  int vocab = 4096;
  int dp = 2;
  int tp = 1;
  std::string optimizer = "muon";
  std::string strategy = "cost";
  int64_t bucket_size = 0;  // 0: the largest that gives >= 4 buckets
  int steps = 10;
  int warmup = 2;
  double backward_ms = 20;
  double forward_ms = 10;
  bool busy = false;
  bool overlap = false;
  bool doorbell = false;
  int shard_group_size = 0;  // 0: flat only
  double timeout_s = 300;
  bool json = false;
  // Exit 1 after the output when any step copied between a GPU and
  // pageable host memory (the GPU bundle's checks).
  bool require_page_locked = false;
  // The trainer's parameters and gradients: fp32, or bf16 / fp16 (mixed
  // precision: the daemon keeps the fp32 masters).
  std::string dtype = "fp32";
};

struct Mode {
  std::string name;
  int shard_group_size = 0;  // 0: flat
  bool overlap = false;
  bool doorbell = false;  // step calls through the rank's step doorbell
};

// One parameter as every rank of a TP position holds it.
struct LocalParam {
  std::string name;
  std::vector<int64_t> shape;  // global
  int split_dim = -1;
  std::string group;
  int64_t fragment_numel = 0;
};

// The daemon's phase times this bench reports (kStepPhases).
constexpr int kPhases = static_cast<int>(kStepPhases.size());

// One measured iteration of one rank, in seconds.
struct Sample {
  double wall = 0;
  double step = 0;  // blocked in Step
  double wait = 0;  // blocked in WaitParams
  double dp_comm = 0;
  double dp_comm_exposed = 0;
  double phases[kPhases] = {};  // the response's PhaseTimes
  int64_t host_waits = 0;       // the response's
  int64_t pageable_copies = 0;  // the response's
};

struct RankResult {
  absl::Status status;
  std::vector<Sample> samples;
  int buckets = 0;
  v1::RegisterResponse registered;
};

struct ModeResult {
  Mode mode;
  int buckets = 0;
  double median_iteration_ms = 0;
  double median_step_ms = 0;
  double median_wait_ms = 0;
  double dp_comm_ms_per_step = 0;  // mean over ranks
  double exposed_ms_per_step = 0;
  double exposed_over_total = 0;
  // Per rank, the largest of any rank: what Register reported by kind;
  // the local daemons' private memory growth over the mode, per rank
  // (-1: no local daemon); the rank's parameter bytes.
  int64_t master_bytes = 0, state_bytes = 0, buffer_bytes = 0;
  double daemon_bytes_per_rank = -1;
  int64_t param_bytes = 0;
  // Per phase: the slowest rank's time in each step, median over steps
  // (as canzona_step_bench reports them).
  double median_phase_ms[kPhases] = {};
  // The daemon's host round trips per step (StepResponse.host_waits): the
  // most of any rank, median over steps.
  double median_host_waits = 0;
  // The daemon's copies between the GPU and pageable host memory
  // (StepResponse.pageable_copies), all ranks, all steps: 0 unless the
  // driver refused to page-lock.
  int64_t pageable_copies = 0;
};

// One rank of one mode: allocates and fills its shared buffers, registers,
// runs the warm-up and measured iterations (backward, Step, forward, with
// GradReady and WaitParams per bucket in an overlap mode) into `out`,
// deregisters. Arrives at `probe` once its iterations are done.
absl::Status RunRank(const StepBenchOptions& o, const Mode& mode,
                     const std::string& job_id,
                     const std::vector<LocalParam>& params, int64_t bucket_size,
                     Client& client, int dp_rank, int tp_rank,
                     DaemonMemoryProbe& probe, RankResult& out);

// The mode's medians over steps of the slowest rank, its communication per
// rank and step, and the largest memory any rank registered.
ModeResult Summarize(const Mode& mode, const std::vector<RankResult>& ranks);

// The results as JSON (`total` elements per rank), or as tables.
void PrintJson(const StepBenchOptions& o, const std::vector<LocalParam>& params,
               int64_t total, int64_t bucket_size,
               const std::vector<ModeResult>& results);
void PrintTables(const std::vector<ModeResult>& results);

}  // namespace canzona::ctl::step_bench

#endif  // CANZONA_CLIENT_CTL_STEP_BENCH_H_
