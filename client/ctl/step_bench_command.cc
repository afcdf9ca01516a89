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
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/ctl/commands.h"
#include "client/ctl/daemon_memory.h"
#include "client/ctl/model_shapes.h"
#include "client/lib/client.h"
#include "kernels/base/dtype.h"
#include "kernels/base/status_macros.h"
#include "nlohmann/json.hpp"
#include "proto/names/step_phases.h"
#include "server/plan/cost_model.h"
#include "server/plan/model_config.h"
#include "server/plan/parameter.h"

namespace canzona::ctl {
namespace {

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

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Seconds(absl::Time since) {
  return absl::ToDoubleSeconds(absl::Now() - since);
}

// Simulated trainer compute.
void Compute(double ms, bool busy) {
  if (ms <= 0) return;
  const absl::Duration d = absl::Microseconds(ms * 1e3);
  if (!busy) {
    absl::SleepFor(d);
    return;
  }
  const absl::Time end = absl::Now() + d;
  while (absl::Now() < end) {
  }
}

// Deterministic values in [-scale, scale) (xorshift64), written as
// `dtype` elements at `out`.
void FillPseudoRandom(uint64_t seed, float scale, DType dtype, void* out,
                      int64_t n) {
  std::vector<float> values(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 0x2545F4914F6CDD1DULL;
  for (int64_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const float unit = static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
    values[i] = scale * (2.0f * unit - 1.0f);
  }
  RoundFromFloat(values.data(), n, dtype, out);
}

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

absl::Status RunIterations(const StepBenchOptions& o, const Mode& mode,
                           const std::string& job_id,
                           const v1::RankCoordinates& rank, int buckets,
                           Client& client, RankResult& out) {
  for (int k = 1; k <= o.warmup + o.steps; ++k) {
    Sample s;
    const absl::Time start = absl::Now();
    v1::StepRequest request;
    request.set_job_id(job_id);
    *request.mutable_rank() = rank;
    request.set_step(k);
    const bool overlap = mode.overlap && buckets > 0;
    if (!overlap) {
      Compute(o.backward_ms, o.busy);
    } else {
      // Backward fills the buckets in order; each is handed over as soon
      // as it is done.
      for (int b = 0; b < buckets; ++b) {
        Compute(o.backward_ms / buckets, o.busy);
        const int list[] = {b};
        absl::Status ready = client.GradReady(job_id, rank, k, list);
        if (!ready.ok()) {
          return absl::Status(ready.code(),
                              absl::StrCat("GradReady step ", k, " bucket ", b,
                                           ": ", ready.message()));
        }
      }
    }
    request.set_async_params(overlap);
    const absl::Time step_start = absl::Now();
    absl::StatusOr<v1::StepResponse> response = client.Step(request);
    if (!response.ok()) {
      return absl::Status(
          response.status().code(),
          absl::StrCat("step ", k, ": ", response.status().message()));
    }
    s.step = Seconds(step_start);
    const v1::PhaseTimes& t = response->seconds();
    s.dp_comm = t.dp_comm();
    s.dp_comm_exposed = t.dp_comm_exposed();
    for (int p = 0; p < kPhases; ++p) {
      s.phases[p] = (t.*kStepPhases[p].seconds)();
    }
    s.host_waits = response->host_waits();
    s.pageable_copies = response->pageable_copies();
    if (!overlap) {
      Compute(o.forward_ms, o.busy);
    } else {
      // Forward needs the last bucket's parameters first.
      for (int b = buckets - 1; b >= 0; --b) {
        const absl::Time wait_start = absl::Now();
        absl::StatusOr<v1::WaitParamsResponse> waited =
            client.WaitParams(job_id, rank, k, b);
        if (!waited.ok()) {
          return absl::Status(waited.status().code(),
                              absl::StrCat("WaitParams step ", k, " bucket ", b,
                                           ": ", waited.status().message()));
        }
        s.wait += Seconds(wait_start);
        Compute(o.forward_ms / buckets, o.busy);
      }
    }
    s.wall = Seconds(start);
    if (k > o.warmup) out.samples.push_back(s);
  }
  return absl::OkStatus();
}

// One rank of one mode: allocate and fill the buffers, register, run the
// iterations, deregister.
absl::Status RunRank(const StepBenchOptions& o, const Mode& mode,
                     const std::string& job_id,
                     const std::vector<LocalParam>& params, int64_t bucket_size,
                     Client& client, int dp_rank, int tp_rank,
                     DaemonMemoryProbe& probe, RankResult& out) {
  const int64_t global = static_cast<int64_t>(dp_rank) * o.tp + tp_rank;
  CANZONA_ASSIGN_OR_RETURN(const DType dtype, ParseDType(o.dtype));
  const int unit = DTypeBytes(dtype);
  int64_t total = 0;
  for (const LocalParam& p : params) total += p.fragment_numel;
  // Float-sized shared tensors holding `total` elements of the dtype.
  const int64_t floats = (total * unit + 3) / 4;
  CANZONA_ASSIGN_OR_RETURN(SharedTensor param_memory,
                           client.AllocateTensor(job_id, global, {floats}));
  CANZONA_ASSIGN_OR_RETURN(SharedTensor grad_memory,
                           client.AllocateTensor(job_id, global, {floats}));
  auto* params_at = reinterpret_cast<char*>(param_memory.data());
  auto* grads_at = reinterpret_cast<char*>(grad_memory.data());

  v1::RegisterRequest request;
  request.set_job_id(job_id);
  request.mutable_layout()->set_pp(1);
  request.mutable_layout()->set_dp(o.dp);
  request.mutable_layout()->set_tp(o.tp);
  request.mutable_rank()->set_pp_rank(0);
  request.mutable_rank()->set_dp_rank(dp_rank);
  request.mutable_rank()->set_tp_rank(tp_rank);
  request.set_strategy(o.strategy);
  request.set_bucket_size(bucket_size);
  request.set_shard_group_size(mode.shard_group_size);
  std::vector<std::string> groups = {o.optimizer};
  if (o.optimizer != "adamw") groups.push_back("adamw");
  for (const std::string& g : groups) {
    v1::OptimizerGroup* group = request.add_groups();
    group->set_name(g);
    group->set_optimizer(g);
  }
  // Parameters and gradients each laid out in reverse order, the order
  // backward fills the buckets (as Megatron and canzona.torch do): the
  // daemons' collectives then use the buffers in place.
  std::vector<int64_t> offsets(params.size());
  int64_t at = 0;
  for (size_t i = params.size(); i-- > 0;) {
    offsets[i] = at;
    at += params[i].fragment_numel;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const LocalParam& p = params[i];
    const int64_t offset = offsets[i];
    // Parameters are the same on every DP replica of a TP position;
    // gradients differ per rank.
    FillPseudoRandom(1000003 * (i + 1) + tp_rank, 0.02f, dtype,
                     params_at + offset * unit, p.fragment_numel);
    FillPseudoRandom(7919 * (i + 1) + 104729 * (global + 1), 1e-3f, dtype,
                     grads_at + offset * unit, p.fragment_numel);
    v1::Parameter* q = request.add_parameters();
    q->set_name(p.name);
    for (int64_t d : p.shape) q->add_shape(d);
    q->set_dtype(dtype == DType::kBFloat16  ? v1::DTYPE_BFLOAT16
                 : dtype == DType::kFloat16 ? v1::DTYPE_FLOAT16
                                            : v1::DTYPE_FLOAT32);
    q->set_tp_split_dim(p.split_dim);
    q->set_group(p.group);
    const uint64_t bytes = static_cast<uint64_t>(p.fragment_numel) * unit;
    *q->mutable_param() = param_memory.buffer_ref();
    q->mutable_param()->mutable_shm()->set_offset(
        static_cast<uint64_t>(offset) * unit);
    q->mutable_param()->mutable_shm()->set_bytes(bytes);
    *q->mutable_grad() = grad_memory.buffer_ref();
    q->mutable_grad()->mutable_shm()->set_offset(static_cast<uint64_t>(offset) *
                                                 unit);
    q->mutable_grad()->mutable_shm()->set_bytes(bytes);
  }
  absl::StatusOr<v1::RegisterResponse> registered = client.Register(request);
  if (!registered.ok()) {
    probe.Arrive();  // the others must not wait for this rank
    return absl::Status(
        registered.status().code(),
        absl::StrCat("register: ", registered.status().message()));
  }
  out.buckets = registered->buckets_size();
  out.registered = *registered;
  absl::Status status = absl::OkStatus();
  if (mode.doorbell) {
    status = client.AttachStepDoorbell(job_id, request.rank());
    if (!status.ok()) {
      status = absl::Status(
          status.code(), absl::StrCat("attach doorbell: ", status.message()));
    }
  }
  if (status.ok()) {
    status = RunIterations(o, mode, job_id, request.rank(), out.buckets, client,
                           out);
  }
  probe.Arrive();
  absl::Status left = client.Deregister(job_id, request.rank());
  if (status.ok() && !left.ok()) {
    return absl::Status(left.code(),
                        absl::StrCat("deregister: ", left.message()));
  }
  return status;
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

ModeResult Summarize(const Mode& mode, const std::vector<RankResult>& ranks) {
  ModeResult r;
  r.mode = mode;
  r.buckets = ranks.front().buckets;
  for (const RankResult& rank : ranks) {
    const v1::RegisterResponse& reg = rank.registered;
    if (reg.master_bytes() + reg.state_bytes() + reg.buffer_bytes() >
        r.master_bytes + r.state_bytes + r.buffer_bytes) {
      r.master_bytes = reg.master_bytes();
      r.state_bytes = reg.state_bytes();
      r.buffer_bytes = reg.buffer_bytes();
    }
  }
  const size_t n = ranks.front().samples.size();
  std::vector<double> wall, step, wait, waits;
  double comm = 0, exposed = 0;
  for (size_t i = 0; i < n; ++i) {
    double w = 0, s = 0, p = 0, h = 0;
    for (const RankResult& rank : ranks) {
      const Sample& x = rank.samples[i];
      w = std::max(w, x.wall);
      s = std::max(s, x.step);
      p = std::max(p, x.wait);
      h = std::max(h, static_cast<double>(x.host_waits));
      r.pageable_copies += x.pageable_copies;
      comm += x.dp_comm;
      exposed += x.dp_comm_exposed;
    }
    wall.push_back(w);
    step.push_back(s);
    wait.push_back(p);
    waits.push_back(h);
  }
  r.median_host_waits = Median(waits);
  for (int p = 0; p < kPhases; ++p) {
    std::vector<double> slowest;
    for (size_t i = 0; i < n; ++i) {
      double m = 0;
      for (const RankResult& rank : ranks) {
        m = std::max(m, rank.samples[i].phases[p]);
      }
      slowest.push_back(m);
    }
    r.median_phase_ms[p] = 1e3 * Median(slowest);
  }
  r.median_iteration_ms = 1e3 * Median(wall);
  r.median_step_ms = 1e3 * Median(step);
  r.median_wait_ms = 1e3 * Median(wait);
  const double per = static_cast<double>(n * ranks.size());
  r.dp_comm_ms_per_step = per > 0 ? 1e3 * comm / per : 0;
  r.exposed_ms_per_step = per > 0 ? 1e3 * exposed / per : 0;
  r.exposed_over_total = comm > 0 ? exposed / comm : 0;
  return r;
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

void PrintJson(const StepBenchOptions& o, const std::vector<LocalParam>& params,
               int64_t total, int64_t bucket_size,
               const std::vector<ModeResult>& results) {
  const double first = results.front().median_iteration_ms;
  nlohmann::json out = {{"model", o.model},
                        {"layers", o.layers},
                        {"vocab", o.vocab},
                        {"layout", o.layout},
                        {"parameters", params.size()},
                        {"elements_per_rank", total},
                        {"dp", o.dp},
                        {"tp", o.tp},
                        {"targets", o.targets},
                        {"optimizer", o.optimizer},
                        {"dtype", o.dtype},
                        {"strategy", o.strategy},
                        {"bucket_size", bucket_size},
                        {"steps", o.steps},
                        {"warmup", o.warmup},
                        {"backward_ms", o.backward_ms},
                        {"forward_ms", o.forward_ms},
                        {"busy", o.busy},
                        {"modes", nlohmann::json::array()}};
  for (const ModeResult& r : results) {
    nlohmann::json phases = nlohmann::json::object();
    for (int p = 0; p < kPhases; ++p) {
      phases[kStepPhases[p].name] = r.median_phase_ms[p];
    }
    out["modes"].push_back(
        {{"mode", r.mode.name},
         {"median_phase_ms", std::move(phases)},
         {"shard_group_size", r.mode.shard_group_size},
         {"overlap", r.mode.overlap},
         {"doorbell", r.mode.doorbell},
         {"buckets", r.buckets},
         {"median_iteration_ms", r.median_iteration_ms},
         {"median_step_ms", r.median_step_ms},
         {"median_wait_params_ms", r.median_wait_ms},
         {"median_host_waits", r.median_host_waits},
         {"pageable_copies", r.pageable_copies},
         {"dp_comm_ms_per_step", r.dp_comm_ms_per_step},
         {"dp_comm_exposed_ms_per_step", r.exposed_ms_per_step},
         {"exposed_over_total_comm", r.exposed_over_total},
         {"iteration_vs_first", first > 0 ? r.median_iteration_ms / first : 0},
         {"param_bytes_per_rank", r.param_bytes},
         {"master_bytes", r.master_bytes},
         {"state_bytes", r.state_bytes},
         {"buffer_bytes", r.buffer_bytes},
         {"daemon_private_bytes_per_rank", r.daemon_bytes_per_rank},
         {"daemon_over_param_bytes",
          r.daemon_bytes_per_rank >= 0 ? r.daemon_bytes_per_rank / r.param_bytes
                                       : -1.0}});
  }
  std::printf("%s\n", out.dump(2).c_str());
}

void PrintTables(const std::vector<ModeResult>& results) {
  const double first = results.front().median_iteration_ms;
  std::printf("%-21s %7s %10s %9s %9s %12s %12s %10s %9s\n", "mode", "buckets",
              "iter ms", "step ms", "wait ms", "dp_comm ms", "exposed ms",
              "exp/total", "vs first");
  for (const ModeResult& r : results) {
    std::printf("%-21s %7d %10.3f %9.3f %9.1f %12.1f %12.1f %10.3f %8.3fx\n",
                r.mode.name.c_str(), r.buckets, r.median_iteration_ms,
                r.median_step_ms, r.median_wait_ms, r.dp_comm_ms_per_step,
                r.exposed_ms_per_step, r.exposed_over_total,
                first > 0 ? r.median_iteration_ms / first : 0);
  }
  std::printf(
      "iter: iteration wall time; step / wait: blocked in Step / WaitParams; "
      "dp_comm, exposed: per rank and step; exp/total: sum exposed / sum "
      "dp_comm; vs first: iteration time / the first mode's\n");
  constexpr double kMiB = 1024.0 * 1024.0;
  std::printf("\n%-21s %10s %10s %10s %10s %12s %12s\n", "mode", "params MiB",
              "master MiB", "state MiB", "buffers MiB", "daemon MiB",
              "daemon/params");
  for (const ModeResult& r : results) {
    std::printf("%-21s %10.2f %10.2f %10.2f %11.2f", r.mode.name.c_str(),
                r.param_bytes / kMiB, r.master_bytes / kMiB,
                r.state_bytes / kMiB, r.buffer_bytes / kMiB);
    if (r.daemon_bytes_per_rank >= 0) {
      std::printf(" %12.2f %12.3fx\n", r.daemon_bytes_per_rank / kMiB,
                  r.daemon_bytes_per_rank / r.param_bytes);
    } else {
      std::printf(" %12s %13s\n", "-", "-");
    }
  }
  std::printf(
      "per rank (the largest): params: the rank's parameter bytes; master, "
      "state, buffers: what Register reported; daemon: the local daemons' "
      "private memory growth over the mode (SO_PEERCRED + smaps_rollup) per "
      "rank\n");
  std::printf("daemon phases (ms; per step the slowest rank, median):\n");
  std::printf("%-21s", "mode");
  for (const StepPhase& phase : kStepPhases) {
    std::printf(" %14s", phase.name);
  }
  std::printf("\n");
  for (const ModeResult& r : results) {
    std::printf("%-21s", r.mode.name.c_str());
    for (double ms : r.median_phase_ms) std::printf(" %14.1f", ms);
    std::printf("\n");
  }
  std::printf(
      "daemon host round trips per step (StepResponse.host_waits; the most "
      "of any rank, median):");
  for (const ModeResult& r : results) {
    std::printf(" %s %.0f", r.mode.name.c_str(), r.median_host_waits);
  }
  std::printf("\n");
  std::printf(
      "daemon copies from or to pageable host memory (StepResponse."
      "pageable_copies; all ranks and steps):");
  for (const ModeResult& r : results) {
    std::printf(" %s %lld", r.mode.name.c_str(),
                static_cast<long long>(r.pageable_copies));
  }
  std::printf("\n");
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
