#include "server/engine/engine_impl.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/shm/shared_memory.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "kernels/cuda/cuda_backend.h"
#include "nlohmann/json.hpp"
#include "server/checkpoint/checkpoint.h"
#include "server/comm/gloo_communicator.h"
#include "server/comm/nccl_communicator.h"
#include "server/engine/bucket_pipeline.h"
#include "server/engine/cuda_ipc_registry.h"
#include "server/engine/local_communicator.h"
#include "server/engine/stage_copier.h"
#include "server/metrics/canzona_metrics.h"
#include "server/optim/optimizer_config.h"
#include "server/optim/update_rule.h"
#include "server/plan/plan_json.h"
#include "server/plan/planner.h"
#include "spdlog/spdlog.h"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;

constexpr char kVersion[] = "0.1.0";
// Control-plane waits are sliced so that shutdown and job failure interrupt
// them promptly instead of after the whole register timeout.
constexpr absl::Duration kWaitSlice = absl::Milliseconds(100);

std::string JobPrefix(const std::string& job_id) {
  return absl::StrCat("canzona/job/", job_id, "/");
}

std::string RankString(const v1::RankCoordinates& r) {
  return absl::StrCat("(pp ", r.pp_rank(), ", dp ", r.dp_rank(), ", tp ",
                      r.tp_rank(), ")");
}

double Seconds(absl::Time from, absl::Time to) {
  return absl::ToDoubleSeconds(to - from);
}

// Splits text into lines and reports the first that differs, so that
// disagreement errors name the field or parameter.
std::string FirstDifference(const std::string& mine, const std::string& theirs,
                            absl::string_view what) {
  std::vector<std::string> a = absl::StrSplit(mine, '\n');
  std::vector<std::string> b = absl::StrSplit(theirs, '\n');
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    const std::string x = i < a.size() ? a[i] : "<none>";
    const std::string y = i < b.size() ? b[i] : "<none>";
    if (x != y) {
      return absl::StrCat(what, "[", i, "]: '", x, "' (this rank) vs '", y,
                          "' (the job's other ranks)");
    }
  }
  return std::string(what);
}

// ---------------------------------------------------------------------------
// Worker: one thread per local rank (the "device worker"), running queued
// tasks in order. Tasks not yet started when the worker stops are cancelled
// (their `cancel` runs on the stopping thread) so every RPC finishes.
class Worker {
 public:
  struct Task {
    std::function<void()> run;
    std::function<void()> cancel;
  };

  Worker() {
    thread_ = std::thread([this] { Loop(); });
  }
  ~Worker() { StopAndJoin(); }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // False (and `task` untouched) when the worker is stopping.
  bool Post(Task& task) {
    absl::MutexLock lock(&mu_);
    if (stopping_) return false;
    queue_.push_back(std::move(task));
    return true;
  }

  void StopAndJoin() {
    std::deque<Task> pending;
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      pending.swap(queue_);
    }
    for (Task& task : pending) {
      if (task.cancel) task.cancel();
    }
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
      thread_.join();
    }
  }

 private:
  void Loop() {
    while (true) {
      Task task;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](Worker* w) { return w->stopping_ || !w->queue_.empty(); },
            this));
        if (queue_.empty()) return;  // stopping
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task.run();
    }
  }

  absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// ---------------------------------------------------------------------------
// Job-level data.

// One parameter of the job (all stages), in plan order.
struct ParamMeta {
  std::string name;
  std::vector<int64_t> shape;
  int split = -1;
  std::string group;
  int stage = 0;
  int64_t numel = 0;
  int64_t local_numel = 0;
  std::vector<int64_t> local_shape;
};

// The plan and what every rank derives from it; immutable once built.
struct JobPlan {
  plan::Plan plan;
  std::vector<ParamMeta> params;
  std::vector<int> stage_first;  // first param index of each stage
  int64_t total_numel = 0;
};

enum class Mode { kLocal, kHosted, kRedundant };

struct RankMetrics;
class CountingCommunicator;

// CUDA events of the NCCL data plane, created at setup and destroyed with
// the rank (through the NcclApi that made them).
class NcclEvents {
 public:
  NcclEvents() = default;
  NcclEvents(const NcclEvents&) = delete;
  NcclEvents& operator=(const NcclEvents&) = delete;
  ~NcclEvents() {
    if (api_ == nullptr) return;
    (void)api_->SetDevice(device_);
    for (NcclEvent e : events_) (void)api_->EventDestroy(e);
  }
  absl::Status Create(NcclApi* api, int device, size_t count) {
    api_ = api;
    device_ = device;
    CANZONA_RETURN_IF_ERROR(api->SetDevice(device));
    for (size_t i = 0; i < count; ++i) {
      CANZONA_ASSIGN_OR_RETURN(NcclEvent e, api->EventCreate());
      events_.push_back(e);
    }
    return absl::OkStatus();
  }
  NcclEvent operator[](size_t i) const { return events_[i]; }

 private:
  NcclApi* api_ = nullptr;
  int device_ = 0;
  std::vector<NcclEvent> events_;
};

// What the worker of one rank owns: backend, communicators, rule state and
// staging buffers. Touched only by that worker thread (comms also by Abort;
// the DP communicators, dp_copier and the comm_* buffers by the
// communication thread; tp and tp_copier by one thread at a time).
//
// Staging is where the communicators read and write. The Gloo data plane
// stages in host memory (`staging` is a cpu backend); the NCCL data plane
// (`resident`) stages in the rank's GPU memory (`staging` is the compute
// backend itself), so trainer buffers, collectives and updates never pass
// through the host. The step code is the same for both: the worker moves
// staging data through `staging` (Backend calls), the other threads
// through their StageCopier, and every collective on a copier's stream.
// Handoffs between threads: a communicator's call returns with its work
// done, a copier's Finish() drains its stream, and the worker
// Synchronize()s `staging` before another thread reads what it wrote.
struct RankRuntime {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Backend> host_backend;  // cpu, when `backend` is not
  Backend* host = nullptr;                // a cpu backend (worker only)
  Backend* staging = nullptr;             // host, or backend when resident
  // cuda compute with host (Gloo) staging: each update copies its
  // parameter and gradient through these device buffers, sized at setup
  // for the largest rule (no allocation in a step).
  DeviceBuffer device_param, device_grad;
  // The copiers, i.e. streams, of the communication thread (dp, cross),
  // the TP micro-group pipeline (tp) and the worker's world reductions.
  // Declared before the communicators, which are destroyed first.
  std::unique_ptr<StageCopier> dp_copier, tp_copier, world_copier;
  // dp: the DP ranks of my shard group (all of DP when flat); cross: the
  // ranks at my position in the other groups (hierarchical sharding).
  std::unique_ptr<Communicator> dp, tp, world, cross;
  // NCCL: the tp communicator itself (tp may wrap it for metrics), whose
  // asynchronous all-to-all the micro-group pipeline orders with events,
  // the metrics wrapper that counts those bytes (null without metrics),
  // the library and this rank's device; per micro group an event when
  // its gather landed and one when its compute finished, and one when
  // the local updates finished.
  NcclCommunicator* tp_nccl = nullptr;
  CountingCommunicator* tp_counting = nullptr;
  NcclApi* nccl_api = nullptr;  // set exactly on the NCCL data plane
  int device = 0;
  NcclEvents events;    // 2 per micro group, then local_done
  int shard_size = 1;   // S: DP ranks per shard group
  int shard_pos = 0;    // my position in the group: the plan's DP index
  int shard_group = 0;  // which group (0 writes the checkpoint records)
  int first = 0;        // plan index of my stage's first parameter

  std::vector<int> local_params;  // plan indices of my stage, trainer order
  std::vector<int64_t> offset;    // per plan index: offset in stage buffers
  std::vector<Mode> mode;         // per plan index
  std::vector<char> dp_owned;     // my DP rank owns (or sc: everyone)
  std::vector<char> counted;      // counted once in norms on this rank
  std::map<int, std::unique_ptr<UpdateRule>> rules;

  struct Bucket {
    int index = 0;  // into plan.buckets
    int64_t base = 0;
    int64_t elements = 0;
    std::vector<int64_t> counts;  // per DP rank (sliced strategies)
    int64_t my_start = 0;         // offset of my slice in the bucket
    // Unsliced: the even split of the bucket's all-reduce, my offset in it.
    std::vector<int64_t> even_counts;
    int64_t even_start = 0;
  };
  std::vector<Bucket> buckets;
  bool sliced = false;  // reduce-scatter / all-gather by plan cuts
  std::vector<const plan::MicroGroup*> groups;  // my (stage, dp) groups
  // Per micro group (the pipeline has two groups in flight besides the one
  // computing, so each needs its own buffers), sized at setup.
  struct GroupBuffers {
    int64_t hosted_here = 0;  // local elements of the params hosted here
    std::vector<int64_t> send_counts, recv_counts, back_send, back_recv;
    DeviceBuffer send, recv, back, back_in;
  };
  std::vector<GroupBuffers> group_buffers;
  std::vector<int> redundant;  // plan indices, redundant mode, dp-owned

  // All in staging memory, allocated at setup.
  DeviceBuffer gstage, pstage, pold;
  DeviceBuffer send, recv, full_g, full_p;  // redundant TP updates, groups
  DeviceBuffer scalars;                     // the world reductions' values
  // The communication thread's own scratch (layerwise: the packed owned
  // parameters and the gathered ones), and the order the next forward
  // needs the buckets in (the last bucket first).
  DeviceBuffer comm_tmp, comm_send, comm_recv;
  std::vector<int64_t> layerwise_counts;  // per DP rank, elements
  // NCCL, bucket-sliced: how the dp communicator runs each bucket's uneven
  // reduce-scatter-v and all-gather-v (per-root collectives or padding),
  // chosen by measurement. Round 0 (the first step) uses the cost model
  // and warms up; round 1 runs every bucket per-root, round 2 padded,
  // timing both; then the DP group sums the times (one all-reduce, so all
  // ranks choose alike) and each bucket keeps its faster way. A round ends
  // with a step's last gather. Communication thread only.
  struct UnevenCalibration {
    bool enabled = false;
    int round = 0;
    std::vector<double> seconds[2];  // per NcclUneven, per bucket
    std::vector<NcclUneven> chosen;  // per bucket, from round 3
    DeviceBuffer sums;               // the all-reduce's staging
  } uneven;
  // What the dp communicator's chooser answers for the current call
  // (empty: the cost model).
  std::optional<NcclUneven> dp_uneven;

  // The NCCL data plane: staging is device memory.
  bool resident() const { return nccl_api != nullptr; }
  std::vector<int> gather_order;
  int owned = 0;
  int64_t state_bytes = 0;
  // The last step's TP comm time of the micro-group pipeline and the part
  // of it hidden behind compute (canzona_tp_overlap_ratio).
  double tp_comm_s = 0, tp_hidden_s = 0;
  std::unique_ptr<RankMetrics> metrics;  // null without a registry
};

// The metric children of one rank (server/metrics/README.md), cached at
// setup so that the step records with atomics only.
struct RankMetrics {
  static constexpr int kPhases = 8;
  Histogram* phase[kPhases] = {};  // PhaseTimes order, then total
  Counter* steps = nullptr;
  Counter* skipped = nullptr;
  Gauge* overlap = nullptr;
  Counter* dp_comm = nullptr;
  Counter* dp_comm_exposed = nullptr;

  RankMetrics(const CanzonaMetrics& m, const std::string& job,
              const std::string& rank) {
    static constexpr const char* kNames[kPhases] = {
        "reduce_scatter", "local_compute", "tp_gather", "tp_compute",
        "tp_scatter",     "all_gather",    "wait",      "total"};
    for (int i = 0; i < kPhases; ++i) {
      phase[i] = m.step_phase_seconds->WithLabels({job, rank, kNames[i]});
    }
    steps = m.steps_total->WithLabels({job, rank});
    skipped = m.steps_skipped_total->WithLabels({job, rank});
    overlap = m.tp_overlap_ratio->WithLabels({job, rank});
    dp_comm = m.dp_comm_seconds_total->WithLabels({job, rank});
    dp_comm_exposed = m.dp_comm_exposed_seconds_total->WithLabels({job, rank});
  }
  void RecordStep(const v1::StepResponse& response, double tp_comm_s,
                  double tp_hidden_s) {
    const v1::PhaseTimes& t = response.seconds();
    const double values[kPhases] = {
        t.reduce_scatter(), t.local_compute(), t.tp_gather(), t.tp_compute(),
        t.tp_scatter(),     t.all_gather(),    t.wait(),      t.total()};
    for (int i = 0; i < kPhases; ++i) phase[i]->Observe(values[i]);
    steps->Increment();
    if (response.skipped_nonfinite()) skipped->Increment();
    overlap->Set(tp_comm_s > 0 ? tp_hidden_s / tp_comm_s : 0);
    dp_comm->Increment(t.dp_comm());
    dp_comm_exposed->Increment(t.dp_comm_exposed());
  }
};

// Counts the bytes this rank sends into canzona_comm_sent_bytes_total
// (conventions in server/metrics/README.md): the elements it sends to the
// other ranks for reduce-scatter, all-gather and all-to-all, and a ring's
// 2 (n-1)/n of the buffer for all-reduce. Broadcast and Barrier (setup
// only) are not counted.
class CountingCommunicator final : public Communicator {
 public:
  CountingCommunicator(std::unique_ptr<Communicator> inner,
                       const CanzonaMetrics& m, const std::string& job,
                       const std::string& rank)
      : inner_(std::move(inner)),
        reduce_scatter_(
            m.comm_sent_bytes_total->WithLabels({job, rank, "reduce_scatter"})),
        all_gather_(
            m.comm_sent_bytes_total->WithLabels({job, rank, "all_gather"})),
        all_reduce_(
            m.comm_sent_bytes_total->WithLabels({job, rank, "all_reduce"})),
        all_to_all_(
            m.comm_sent_bytes_total->WithLabels({job, rank, "tp_all_to_all"})) {
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Status ReduceScatterV(const float* send,
                              absl::Span<const int64_t> counts,
                              float* recv) override {
    CANZONA_RETURN_IF_ERROR(inner_->ReduceScatterV(send, counts, recv));
    reduce_scatter_->Increment(Bytes(Others(counts)));
    return absl::OkStatus();
  }
  absl::Status AllGatherV(const float* send, absl::Span<const int64_t> counts,
                          float* recv) override {
    CANZONA_RETURN_IF_ERROR(inner_->AllGatherV(send, counts, recv));
    if (rank() < static_cast<int>(counts.size())) {
      all_gather_->Increment(Bytes(counts[rank()] * (size() - 1)));
    }
    return absl::OkStatus();
  }
  absl::Status AllToAllV(const float* send,
                         absl::Span<const int64_t> send_counts, float* recv,
                         absl::Span<const int64_t> recv_counts) override {
    CANZONA_RETURN_IF_ERROR(
        inner_->AllToAllV(send, send_counts, recv, recv_counts));
    CountAllToAll(send_counts);
    return absl::OkStatus();
  }
  // For an all-to-all enqueued on the inner NCCL communicator directly.
  void CountAllToAll(absl::Span<const int64_t> send_counts) {
    all_to_all_->Increment(Bytes(Others(send_counts)));
  }
  absl::Status AllReduce(float* data, int64_t count) override {
    CANZONA_RETURN_IF_ERROR(inner_->AllReduce(data, count));
    const int n = size();
    if (n > 1) all_reduce_->Increment(2.0 * (n - 1) / n * Bytes(count));
    return absl::OkStatus();
  }
  absl::Status Broadcast(float* data, int64_t count, int root) override {
    return inner_->Broadcast(data, count, root);
  }
  absl::Status Barrier() override { return inner_->Barrier(); }
  void Abort() override { inner_->Abort(); }

 private:
  static double Bytes(int64_t elements) {
    return static_cast<double>(elements) * sizeof(float);
  }
  int64_t Others(absl::Span<const int64_t> counts) const {
    int64_t total = 0;
    for (size_t j = 0; j < counts.size(); ++j) {
      if (static_cast<int>(j) != rank()) total += counts[j];
    }
    return total;
  }

  std::unique_ptr<Communicator> inner_;
  Counter* reduce_scatter_;
  Counter* all_gather_;
  Counter* all_reduce_;
  Counter* all_to_all_;
};

struct LocalRank {
  ~LocalRank() {
    if (trainer_pidfd >= 0) ::close(trainer_pidfd);
    if (grad_event != nullptr) ipc->CloseEvent(grad_event, buffer_device);
  }
  v1::RankCoordinates coords;
  int global = 0;
  // The trainer process (SO_PEERCRED) and a pidfd that becomes readable
  // when it exits (-1: none, or a kernel without pidfd_open).
  std::optional<pid_t> trainer_pid;
  int trainer_pidfd = -1;
  std::vector<SharedMemory> maps;
  // GPU trainers: CUDA IPC buffers (device memory of `buffer_device`),
  // copied to and from host staging through `ipc` (Gloo) or on the
  // communication stream (NCCL), and the event the trainer records after
  // writing gradients (null: none).
  std::vector<CudaIpcRegistry::Mapping> ipc_maps;
  bool device_buffers = false;
  int buffer_device = 0;
  CudaIpcOpener* ipc = nullptr;
  void* grad_event = nullptr;
  std::vector<float*> param_buf;  // per stage parameter, trainer order
  std::vector<float*> grad_buf;
  int64_t mapped_bytes = 0;
  std::unique_ptr<Worker> worker;

  // Guarded by Job::mu.
  int64_t next_step = 1;  // next step number Step accepts
  int64_t steps_done = 0;
  // Work to run on the worker right after step N (guarded by Job::mu).
  std::map<int64_t, std::vector<Worker::Task>> after_step;
  // Checkpoint collectives this rank has run (worker-only): names their
  // control-plane keys, the same on every rank of the job.
  int64_t collective_seq = 0;
  v1::PhaseTimes last;
  bool setup_done = false;
  Callback<v1::RegisterResponse> register_done;
  v1::RegisterResponse response;

  // Worker-only, except the communicators that Abort() reaches through
  // comm_mu (another thread aborts on failure / shutdown).
  std::unique_ptr<RankRuntime> rt;
  // The DP bucket communication thread (GradReady, WaitParams); set at
  // setup (SetPipeline) before the job is ready and kept until the rank is
  // destroyed, so RPC threads may use it once they saw the job ready; other
  // threads reach it through FailPipeline. Declared after rt: it is
  // destroyed (and joined) first.
  std::unique_ptr<BucketPipeline> pipeline;
  absl::Mutex comm_mu;
  bool aborted ABSL_GUARDED_BY(comm_mu) = false;
  std::vector<Communicator*> comms ABSL_GUARDED_BY(comm_mu);

  void AddComm(Communicator* c) {
    absl::MutexLock lock(&comm_mu);
    comms.push_back(c);
    if (aborted) c->Abort();
  }
  void AbortComms() {
    absl::MutexLock lock(&comm_mu);
    aborted = true;
    for (Communicator* c : comms) c->Abort();
  }
  void SetPipeline(std::unique_ptr<BucketPipeline> p) {
    absl::MutexLock lock(&comm_mu);
    pipeline = std::move(p);
    if (aborted) pipeline->Fail(absl::AbortedError("the rank was aborted"));
  }
  void FailPipeline(const absl::Status& status) {
    absl::MutexLock lock(&comm_mu);
    if (pipeline) pipeline->Fail(status);
  }
};

enum class JobState { kRegistering, kReady, kFailed };

struct Job {
  std::string id;
  std::string token;
  std::string meta;  // canonical job settings (layout, strategy, groups)
  plan::Strategy strategy = plan::Strategy::kCost;
  std::string strategy_name;
  double alpha = 1.0;
  int64_t bucket_size = 0;
  int shard_group_size = 1;  // S (= DP when flat)
  v1::WorldLayout layout;
  int world = 1;
  std::map<std::string, OptimizerConfig> configs;

  absl::Mutex mu;
  absl::CondVar cv;  // arrivals, state changes
  JobState state ABSL_GUARDED_BY(mu) = JobState::kRegistering;
  std::string failure ABSL_GUARDED_BY(mu);
  bool barrier_passed ABSL_GUARDED_BY(mu) = false;
  std::map<int, std::string> stage_plist ABSL_GUARDED_BY(mu);
  std::map<int, std::shared_ptr<LocalRank>> ranks ABSL_GUARDED_BY(mu);
  int setup_done ABSL_GUARDED_BY(mu) = 0;
  std::map<int64_t, int> arrivals ABSL_GUARDED_BY(mu);
  std::map<int64_t, int> departures ABSL_GUARDED_BY(mu);
  int64_t mapped_bytes ABSL_GUARDED_BY(mu) = 0;
  std::shared_ptr<const JobPlan> plan ABSL_GUARDED_BY(mu);

  // Serializes plan building (it waits on the control plane).
  absl::Mutex plan_mu;

  bool failed() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    return state == JobState::kFailed;
  }
};

// Cancels what waited for a later step of a rank that is going away.
void CancelAfterStep(Job& job, LocalRank& rank) {
  std::vector<Worker::Task> tasks;
  {
    absl::MutexLock lock(&job.mu);
    for (auto& [k, list] : rank.after_step) {
      for (Worker::Task& task : list) tasks.push_back(std::move(task));
    }
    rank.after_step.clear();
  }
  for (Worker::Task& task : tasks) task.cancel();
}

std::string StateString(const Job& job) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  switch (job.state) {
    case JobState::kRegistering:
      return "registering";
    case JobState::kReady:
      return "ready";
    case JobState::kFailed:
      return absl::StrCat("failed: ", job.failure);
  }
  return "unknown";
}

// A validated Register request, its buffers mapped, before it touches any
// engine state.
struct Prepared {
  std::shared_ptr<LocalRank> rank;
  std::string meta;
  std::string plist;  // canonical parameter list of this rank's stage
  plan::Strategy strategy = plan::Strategy::kCost;
  std::string strategy_name;
  double alpha = 1.0;
  int64_t bucket_size = 0;
  int shard_group_size = 1;
  int world = 1;
  std::map<std::string, OptimizerConfig> configs;
};

bool ValidJobId(absl::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' ||
          c == '-')) {
      return false;
    }
  }
  return true;
}

std::string CanonicalParam(const v1::Parameter& p) {
  return absl::StrCat(p.name(), "|", absl::StrJoin(p.shape(), ","), "|",
                      p.tp_split_dim(), "|", p.group());
}

absl::StatusOr<ParamMeta> ParseParamLine(absl::string_view line, int stage,
                                         int tp) {
  std::vector<std::string> f = absl::StrSplit(line, '|');
  if (f.size() != 4) {
    return absl::InternalError(absl::StrCat("bad parameter line '", line, "'"));
  }
  ParamMeta m;
  m.name = f[0];
  for (absl::string_view d : absl::StrSplit(f[1], ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(d, &v)) {
      return absl::InternalError(absl::StrCat("bad shape in '", line, "'"));
    }
    m.shape.push_back(v);
  }
  if (!absl::SimpleAtoi(f[2], &m.split)) {
    return absl::InternalError(absl::StrCat("bad split in '", line, "'"));
  }
  m.group = f[3];
  m.stage = stage;
  m.numel = NumElements(m.shape);
  m.local_shape = m.shape;
  if (m.split >= 0) m.local_shape[m.split] /= tp;
  m.local_numel = NumElements(m.local_shape);
  return m;
}

plan::OptimizerKind PlanKind(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kMuon:
      return plan::OptimizerKind::kMuon;
    case OptimizerKind::kShampoo:
      return plan::OptimizerKind::kShampoo;
    case OptimizerKind::kSoap:
      return plan::OptimizerKind::kSoap;
    case OptimizerKind::kAdamW:
      return plan::OptimizerKind::kAdamW;
  }
  return plan::OptimizerKind::kAdamW;
}

bool IsMatrix(OptimizerKind kind) { return kind != OptimizerKind::kAdamW; }

// Copies fragment `j` of a [rows, cols] matrix split over `tp` along `dim`
// into (to_full) or out of the whole matrix, both in `b`'s memory. Dim 0
// fragments are row blocks (contiguous); dim 1 fragments are column blocks,
// so rows interleave (one strided copy).
absl::Status MoveFragment(Backend& b, const ParamMeta& m, int tp, int j,
                          float* frag, float* full, bool to_full) {
  if (m.split == 0 || m.shape.size() == 1) {
    float* at = full + j * m.local_numel;
    return to_full ? b.Copy(frag, m.local_numel, at)
                   : b.Copy(at, m.local_numel, frag);
  }
  const int64_t rows = m.shape[0], cols = m.shape[1], c = cols / tp;
  float* at = full + j * c;
  return to_full ? b.Copy2D(rows, c, frag, c, at, cols)
                 : b.Copy2D(rows, c, at, cols, frag, c);
}

// The node's CUDA devices (EngineOptions::cuda_devices overrides).
int NodeCudaDevices(const EngineOptions& options) {
  return options.cuda_devices >= 0 ? options.cuda_devices : CudaDeviceCount();
}

// ---------------------------------------------------------------------------

class EngineImpl final : public Engine {
 public:
  explicit EngineImpl(EngineOptions options)
      : options_(std::move(options)),
        cuda_ipc_(options_.cuda_ipc != nullptr ? options_.cuda_ipc
                                               : RealCudaIpcOpener()),
        ipc_registry_(std::make_unique<CudaIpcRegistry>(cuda_ipc_)) {
    watcher_ = std::thread([this] { WatchTrainers(); });
  }
  ~EngineImpl() override { Shutdown(); }

  void Register(const v1::RegisterRequest& request, const PeerInfo& peer,
                Callback<v1::RegisterResponse> done) override;
  void Step(const v1::StepRequest& request,
            Callback<v1::StepResponse> done) override;
  absl::StatusOr<v1::GetPlanResponse> GetPlan(
      const v1::GetPlanRequest& request) override;
  absl::Status Deregister(const v1::DeregisterRequest& request) override;
  v1::GetStatusResponse GetStatus() override;
  void SaveCheckpoint(const v1::SaveCheckpointRequest& request,
                      Callback<v1::SaveCheckpointResponse> done) override;
  void LoadCheckpoint(const v1::LoadCheckpointRequest& request,
                      Callback<v1::LoadCheckpointResponse> done) override;
  void ExportState(const v1::ExportStateRequest& request,
                   Callback<v1::ExportStateResponse> done) override;
  void ImportState(const v1::ImportStateRequest& request,
                   Callback<v1::ImportStateResponse> done) override;
  void GradReady(const v1::GradReadyRequest& request,
                 Callback<v1::GradReadyResponse> done) override;
  void WaitParams(const v1::WaitParamsRequest& request,
                  Callback<v1::WaitParamsResponse> done) override;
  void Shutdown() override;

 private:
  // The ready job and this daemon's rank `coords` of it, or the status a
  // call naming them gets (NOT_FOUND, INVALID_ARGUMENT,
  // FAILED_PRECONDITION).
  // With `after_failure`, a failed job's rank is returned too when its last
  // accepted step completed (its state is whole): exporting the state of a
  // job another rank has already left.
  absl::StatusOr<std::pair<std::shared_ptr<Job>, std::shared_ptr<LocalRank>>>
  FindReadyRank(const std::string& job_id, const v1::RankCoordinates& coords,
                bool after_failure = false);
  // Validates the job and rank, then runs `work` on the rank's worker (in
  // order with its steps) and hands its result to `done`.
  // With at_step > 0, `work` runs right after the rank's step at_step.
  template <typename Response>
  void RunOnRank(const std::string& job_id, const v1::RankCoordinates& coords,
                 Callback<Response> done,
                 std::function<absl::StatusOr<Response>(Job&, LocalRank&)> work,
                 int64_t at_step = 0, bool after_failure = false);
  // Runs (or, when the rank is gone, cancels) what waited for step k.
  void RunAfterStep(Job& job, LocalRank& rank, int64_t k);
  // INVALID_ARGUMENT / PERMISSION_DENIED for a checkpoint directory the
  // daemon must not use; the normalized path otherwise.
  absl::StatusOr<std::string> CheckpointDir(const std::string& dir) const;
  absl::StatusOr<v1::SaveCheckpointResponse> RunSave(Job& job, LocalRank& rank,
                                                     const std::string& dir);
  absl::StatusOr<v1::LoadCheckpointResponse> RunLoad(Job& job, LocalRank& rank,
                                                     const std::string& dir);
  // The job's ranks decide together through the control plane: every rank
  // publishes its `local` status with `payload` under the collective `key`;
  // global rank 0 takes the first failure ("rank g: ...") or else
  // decide(every rank's payload), publishes it, and every rank returns it.
  absl::Status Agree(
      Job& job, const LocalRank& rank, const std::string& key,
      const absl::Status& local, const std::string& payload,
      absl::Time deadline,
      const std::function<absl::Status(const std::vector<std::string>&)>&
          decide);
  // The job registered here under `job_id`, or NOT_FOUND naming it.
  absl::StatusOr<std::shared_ptr<Job>> FindJob(const std::string& job_id);
  absl::StatusOr<Prepared> Prepare(const v1::RegisterRequest& request,
                                   const PeerInfo& peer);
  absl::Status Admit(const v1::RegisterRequest& request, Prepared& prepared,
                     std::shared_ptr<Job>* job_out);

  // Worker tasks.
  void RunRegister(std::shared_ptr<Job> job, std::shared_ptr<LocalRank> rank,
                   std::string plist, Callback<v1::RegisterResponse> done);
  absl::Status CheckControlPlane(Job& job, const LocalRank& rank,
                                 const std::string& plist);
  absl::StatusOr<std::shared_ptr<const JobPlan>> EnsurePlan(Job& job);
  absl::Status CheckDigests(Job& job, const LocalRank& rank,
                            const std::string& digest);
  absl::Status SetupRank(Job& job, LocalRank& rank, const JobPlan& jp);
  void RunStep(std::shared_ptr<Job> job, std::shared_ptr<LocalRank> rank,
               v1::StepRequest request, Callback<v1::StepResponse> done);
  absl::Status Pipeline(Job& job, LocalRank& rank, const JobPlan& jp,
                        const v1::StepRequest& request,
                        v1::StepResponse* response);
  // The TP micro-group pipeline of this rank's (stage, DP rank).
  absl::Status RunMicroGroups(Job& job, LocalRank& rank, const JobPlan& jp,
                              const std::map<std::string, float>& lr,
                              v1::PhaseTimes* times);

  // Waits for a control-plane key in slices; fails early on shutdown or
  // when the job failed.
  absl::StatusOr<std::string> WaitGet(Job& job, const std::string& key,
                                      absl::Time deadline,
                                      absl::string_view what);
  // Marks the job failed (first reason wins), aborts its communicators and
  // fails pending Register callbacks.
  void FailJob(Job& job, const absl::Status& status);
  void RemoveRank(const std::shared_ptr<Job>& job,
                  const std::shared_ptr<LocalRank>& rank);
  int CudaDevices() const { return NodeCudaDevices(options_); }
  absl::Status Unavailable() const {
    return absl::UnavailableError("canzonad is shutting down");
  }
  // Takes local rank `global` out of `job` (its job fails with `reason`):
  // unblocks and joins its worker, fails what it had pending, and unmaps
  // its buffers. False when the rank is not (any more) registered here.
  //
  // `graceful` (Deregister between steps): the rank's communicators and
  // communication thread stay up for a while (the "linger", reaped by the
  // watcher) instead of being aborted, because peers may still be receiving
  // the last collective's data from them: a fast rank that leaves right
  // after its last all-gather must not cut off a slower peer's (closing
  // a Gloo pair drops what that peer has not read yet). Its optimizer
  // state is freed at once.
  bool RemoveLocalRank(const std::shared_ptr<Job>& job, int global,
                       const std::string& reason, bool graceful = false);
  // Watcher thread: releases the ranks whose trainer process exited
  // without deregistering (a crash, kill -9, OOM kill).
  void WatchTrainers();

  const EngineOptions options_;
  // CUDA IPC buffers of GPU trainers (opened once per allocation).
  CudaIpcOpener* const cuda_ipc_;
  const std::unique_ptr<CudaIpcRegistry> ipc_registry_;
  std::atomic<bool> shutting_down_{false};
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  // Workers of ranks removed from their own thread (failed registration):
  // joined at shutdown.
  std::vector<std::unique_ptr<Worker>> retired_ ABSL_GUARDED_BY(mu_);
  // Ranks that left gracefully, kept (communicators open) until the time
  // given; the watcher then aborts and destroys them.
  std::vector<std::pair<absl::Time, std::shared_ptr<LocalRank>>> lingering_
      ABSL_GUARDED_BY(mu_);
  // Jobs that failed and lost their last local rank (a dead trainer), kept
  // so that GetStatus and GetPlan still explain them; the newest 16.
  std::deque<std::shared_ptr<Job>> failed_jobs_ ABSL_GUARDED_BY(mu_);
  absl::CondVar watcher_cv_;  // with mu_: shutdown wakes the watcher
  std::thread watcher_;
};

// ---------------------------------------------------------------------------
// Register: validation (inline), then the worker's control-plane part.

absl::StatusOr<Prepared> EngineImpl::Prepare(const v1::RegisterRequest& request,
                                             const PeerInfo& peer) {
  Prepared out;
  if (!ValidJobId(request.job_id())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job_id '", request.job_id(), "' must match [A-Za-z0-9_-]{1,64}"));
  }
  if (!options_.required_token.empty() &&
      request.job_token() != options_.required_token) {
    return absl::UnauthenticatedError(
        "job_token does not match this daemon's token");
  }
  const v1::WorldLayout& l = request.layout();
  if (l.pp() < 1) return absl::InvalidArgumentError("layout.pp must be >= 1");
  if (l.dp() < 1) return absl::InvalidArgumentError("layout.dp must be >= 1");
  if (l.tp() < 1) return absl::InvalidArgumentError("layout.tp must be >= 1");
  constexpr int64_t kMaxWorld = int64_t{1} << 20;
  if (int64_t{l.pp()} * l.dp() * l.tp() > kMaxWorld) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout: pp x dp x tp = ", int64_t{l.pp()} * l.dp() * l.tp(),
        " ranks exceeds ", kMaxWorld));
  }
  const v1::RankCoordinates& r = request.rank();
  if (r.pp_rank() < 0 || r.pp_rank() >= l.pp()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank.pp_rank ", r.pp_rank(), " outside [0, ", l.pp(), ")"));
  }
  if (r.dp_rank() < 0 || r.dp_rank() >= l.dp()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank.dp_rank ", r.dp_rank(), " outside [0, ", l.dp(), ")"));
  }
  if (r.tp_rank() < 0 || r.tp_rank() >= l.tp()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank.tp_rank ", r.tp_rank(), " outside [0, ", l.tp(), ")"));
  }
  out.world = l.pp() * l.dp() * l.tp();
  out.strategy_name = request.strategy().empty() ? "cost" : request.strategy();
  {
    auto strategy = plan::ParseStrategy(out.strategy_name);
    if (!strategy.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("strategy: ", strategy.status().message()));
    }
    out.strategy = *strategy;
  }
  // proto3 cannot tell 0 from unset: 0 means the planner's default (1).
  out.alpha = request.alpha() == 0 ? 1.0 : request.alpha();
  if (!(out.alpha >= 0 && out.alpha <= 1)) {
    return absl::InvalidArgumentError("alpha must be in [0, 1]");
  }
  if (request.bucket_size() < 0) {
    return absl::InvalidArgumentError("bucket_size must be >= 0");
  }
  out.bucket_size =
      request.bucket_size() == 0 ? 400000000 : request.bucket_size();
  {
    const int S = request.shard_group_size();
    if (S < 0 || S > l.dp() || (S > 0 && l.dp() % S != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shard_group_size ", S, " must divide dp ", l.dp(), " (0: dp)"));
    }
    out.shard_group_size = S == 0 ? l.dp() : S;
    if (out.shard_group_size < l.dp() &&
        (out.strategy == plan::Strategy::kSc ||
         out.strategy == plan::Strategy::kLayerwise)) {
      return absl::InvalidArgumentError(
          absl::StrCat("shard_group_size ", S,
                       " < dp needs a bucket-sliced strategy "
                       "(start_anchored, alpha, cost), not ",
                       out.strategy_name));
    }
  }

  // Groups.
  std::string meta =
      absl::StrCat("layout=", l.pp(), ",", l.dp(), ",", l.tp(),
                   "\nstrategy=", out.strategy_name, "\nalpha=", out.alpha,
                   "\nbucket_size=", out.bucket_size,
                   "\nshard_group_size=", out.shard_group_size);
  if (request.groups().empty()) {
    return absl::InvalidArgumentError("groups: at least one optimizer group");
  }
  for (int g = 0; g < request.groups_size(); ++g) {
    const v1::OptimizerGroup& group = request.groups(g);
    const std::string where =
        absl::StrCat("groups[", g, "] '", group.name(), "'");
    if (group.name().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": empty name"));
    }
    // Group names go into the canonical parameter list ('|' separated
    // lines) the ranks compare and the planner parses.
    if (group.name().find_first_of("|\n") != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": name must not contain '|' or newlines"));
    }
    if (out.configs.count(group.name())) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": duplicate name"));
    }
    auto kind = ParseOptimizerKind(group.optimizer());
    if (!kind.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".optimizer: ", kind.status().message()));
    }
    std::vector<std::pair<std::string, std::string>> settings;
    for (const v1::Setting& s : group.settings()) {
      settings.emplace_back(s.key(), s.value());
    }
    auto config = MakeOptimizerConfig(*kind, settings);
    if (!config.ok()) {
      return absl::Status(
          config.status().code(),
          absl::StrCat(where, ".settings: ", config.status().message()));
    }
    std::vector<std::string> kv;
    for (const auto& [k, v] : ConfigSettings(*config)) {
      kv.push_back(absl::StrCat(k, "=", v));
    }
    absl::StrAppend(&meta, "\ngroup ", group.name(), " ",
                    OptimizerKindName(*kind), " ", absl::StrJoin(kv, ","));
    out.configs.emplace(group.name(), *std::move(config));
  }
  out.meta = std::move(meta);

  // Parameters and their buffers.
  if (request.parameters().empty()) {
    return absl::InvalidArgumentError("parameters: empty list");
  }
  if (request.parameters_size() > options_.max_parameters_per_job) {
    return absl::ResourceExhaustedError(
        absl::StrCat("parameters: ", request.parameters_size(),
                     " exceed this daemon's limit of ",
                     options_.max_parameters_per_job, " per job"));
  }
  auto rank = std::make_shared<LocalRank>();
  rank->coords = r;
  if (peer.pid.has_value() && *peer.pid > 0) {
    rank->trainer_pid = peer.pid;
    rank->trainer_pidfd =
        static_cast<int>(::syscall(SYS_pidfd_open, *peer.pid, 0));
  }
  rank->global = (r.pp_rank() * l.dp() + r.dp_rank()) * l.tp() + r.tp_rank();
  std::map<std::string, int> opened;  // shm name -> index into rank->maps
  const std::string name_prefix =
      absl::StrCat("/canzona.", request.job_id(), ".");
  auto map_buffer = [&](const std::string& where, const v1::BufferRef& ref,
                        int64_t numel) -> absl::StatusOr<float*> {
    const bool ipc = ref.has_cuda_ipc();
    if (!ipc && !ref.has_shm()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": no buffer (shm or cuda_ipc)"));
    }
    if (!rank->param_buf.empty() || !rank->grad_buf.empty() ||
        !rank->ipc_maps.empty()) {
      if (ipc != rank->device_buffers) {
        return absl::InvalidArgumentError(
            absl::StrCat(where,
                         ": every buffer of a rank must be shm, or every one "
                         "cuda_ipc"));
      }
    }
    if (ipc) {
      // Asked on demand: a cpu daemon without GPU trainers never starts CUDA.
      const int devices = CudaDevices();
      if (devices == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            where, ".cuda_ipc: this daemon has no usable CUDA device"));
      }
      const v1::CudaIpcBufferRef& r = ref.cuda_ipc();
      if (!rank->ipc_maps.empty() && r.device() != rank->buffer_device) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ".cuda_ipc.device: ", r.device(), ", the rank's other ",
            "buffers are on device ", rank->buffer_device));
      }
      CANZONA_ASSIGN_OR_RETURN(
          CudaIpcRegistry::Mapping m,
          ipc_registry_->Map(
              where, r, static_cast<uint64_t>(numel) * sizeof(float), devices));
      rank->device_buffers = true;
      rank->buffer_device = r.device();
      rank->ipc = cuda_ipc_;
      rank->mapped_bytes += static_cast<int64_t>(r.bytes());
      float* data = m.data();
      rank->ipc_maps.push_back(std::move(m));
      return data;
    }
    const v1::ShmBufferRef& shm = ref.shm();
    if (absl::Status s = ValidateShmName(shm.name()); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".shm.name: ", s.message()));
    }
    if (shm.name().rfind(name_prefix, 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".shm.name '", shm.name(), "' does not belong to job '",
          request.job_id(), "' (", name_prefix, "<rank>.<seq>)"));
    }
    const uint64_t need = static_cast<uint64_t>(numel) * sizeof(float);
    if (shm.bytes() < need) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": buffer too small: ", shm.bytes(),
                       " bytes, the local shard needs ", need));
    }
    if (shm.bytes() != need) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": buffer size ", shm.bytes(),
                       " bytes, the local shard needs exactly ", need));
    }
    auto it = opened.find(shm.name());
    if (it == opened.end()) {
      SharedMemory::OpenOptions open_options;
      open_options.expected_owner_uid = peer.uid;
      auto mapped = SharedMemory::Open(shm.name(), open_options);
      if (!mapped.ok()) {
        return absl::Status(
            mapped.status().code(),
            absl::StrCat(where, ".shm: ", mapped.status().message()));
      }
      rank->mapped_bytes += static_cast<int64_t>(mapped->size());
      rank->maps.push_back(*std::move(mapped));
      it = opened.emplace(shm.name(), rank->maps.size() - 1).first;
    }
    auto range = rank->maps[it->second].FloatRange(shm.offset(), shm.bytes());
    if (!range.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".shm: ", range.status().message()));
    }
    return *range;
  };

  std::set<std::string> names;
  std::string plist;
  std::string grad_event_handle;
  for (int j = 0; j < request.parameters_size(); ++j) {
    const v1::Parameter& p = request.parameters(j);
    const std::string where =
        absl::StrCat("parameters[", j, "] '", p.name(), "'");
    if (p.name().empty() ||
        p.name().find_first_of("|\n") != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": name must be non-empty without '|' or newlines"));
    }
    if (!names.insert(p.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": duplicate name"));
    }
    if (p.shape().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".shape: empty"));
    }
    // Bounded so that element and byte counts cannot overflow int64.
    constexpr int64_t kMaxElements = int64_t{1} << 40;
    int64_t elements = 1;
    for (int64_t d : p.shape()) {
      if (d < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".shape: dimension ", d, " < 1"));
      }
      if (d > kMaxElements / elements) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ".shape: more than ", kMaxElements, " elements"));
      }
      elements *= d;
    }
    if (p.dtype() != v1::DTYPE_FLOAT32) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".dtype: ", v1::DType_Name(p.dtype()),
          " is not supported on the CPU data plane (DTYPE_FLOAT32 only)"));
    }
    const int split = p.tp_split_dim();
    if (split < -1 || split > 1 || split >= p.shape_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".tp_split_dim: ", split,
                       " must be -1, 0 or 1 and < rank ", p.shape_size()));
    }
    if (split >= 0 && p.shape(split) % l.tp() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".tp_split_dim: tp ", l.tp(), " does not divide dimension ",
          split, " (", p.shape(split), ")"));
    }
    auto config = out.configs.find(p.group());
    if (config == out.configs.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".group: unknown group '", p.group(), "'"));
    }
    if (IsMatrix(config->second.kind) && p.shape_size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".shape: optimizer ", OptimizerKindName(config->second.kind),
          " needs a 2-D shape"));
    }
    std::vector<int64_t> local(p.shape().begin(), p.shape().end());
    if (split >= 0) local[split] /= l.tp();
    const int64_t numel = NumElements(local);
    CANZONA_ASSIGN_OR_RETURN(
        float* param,
        map_buffer(absl::StrCat(where, ".param"), p.param(), numel));
    CANZONA_ASSIGN_OR_RETURN(
        float* grad, map_buffer(absl::StrCat(where, ".grad"), p.grad(), numel));
    rank->param_buf.push_back(param);
    rank->grad_buf.push_back(grad);
    // The trainer's "gradients written" event: one per rank (every grad
    // buffer names the same one, or none).
    const std::string& event =
        p.grad().has_cuda_ipc() ? p.grad().cuda_ipc().event_handle() : "";
    if (!event.empty()) {
      if (grad_event_handle.empty()) {
        absl::StatusOr<void*> opened =
            cuda_ipc_->OpenEvent(event, rank->buffer_device);
        if (!opened.ok()) {
          return absl::Status(
              opened.status().code(),
              absl::StrCat(where, ".grad.cuda_ipc.event_handle: ",
                           opened.status().message()));
        }
        rank->grad_event = *opened;
        grad_event_handle = event;
      } else if (event != grad_event_handle) {
        return absl::InvalidArgumentError(
            absl::StrCat(where,
                         ".grad.cuda_ipc.event_handle: differs from the rank's "
                         "other gradients' (one event per rank)"));
      }
    }
    absl::StrAppend(&plist, j ? "\n" : "", CanonicalParam(p));
  }
  if (rank->mapped_bytes > options_.max_bytes_per_job) {
    return absl::ResourceExhaustedError(
        absl::StrCat("parameters: ", rank->mapped_bytes,
                     " mapped bytes exceed this daemon's limit of ",
                     options_.max_bytes_per_job, " per job"));
  }
  out.plist = std::move(plist);
  out.rank = std::move(rank);
  return out;
}

absl::Status EngineImpl::Admit(const v1::RegisterRequest& request,
                               Prepared& prepared,
                               std::shared_ptr<Job>* job_out) {
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return Unavailable();
  std::shared_ptr<Job>& slot = jobs_[request.job_id()];
  const bool created = slot == nullptr;
  if (created) {
    if (static_cast<int>(jobs_.size()) > options_.max_jobs) {
      jobs_.erase(request.job_id());
      return absl::ResourceExhaustedError(absl::StrCat(
          "job_id '", request.job_id(), "': this daemon serves at most ",
          options_.max_jobs, " jobs"));
    }
    auto job = std::make_shared<Job>();
    job->id = request.job_id();
    job->token = request.job_token();
    job->meta = prepared.meta;
    job->strategy = prepared.strategy;
    job->strategy_name = prepared.strategy_name;
    job->alpha = prepared.alpha;
    job->bucket_size = prepared.bucket_size;
    job->shard_group_size = prepared.shard_group_size;
    job->layout = request.layout();
    job->world = prepared.world;
    job->configs = prepared.configs;
    slot = job;
  }
  Job& job = *slot;
  LocalRank& rank = *prepared.rank;
  const int stage = rank.coords.pp_rank();
  {
    absl::MutexLock job_lock(&job.mu);
    if (!created) {
      if (request.job_token() != job.token) {
        return absl::UnauthenticatedError(
            absl::StrCat("job_token does not match job '", job.id, "'"));
      }
      if (job.state == JobState::kFailed) {
        return absl::FailedPreconditionError(
            absl::StrCat("job failed: ", job.failure));
      }
      if (prepared.meta != job.meta) {
        return absl::FailedPreconditionError(
            absl::StrCat("job settings disagree: ",
                         FirstDifference(prepared.meta, job.meta, "settings")));
      }
      auto plist = job.stage_plist.find(stage);
      if (plist != job.stage_plist.end() && plist->second != prepared.plist) {
        return absl::FailedPreconditionError(absl::StrCat(
            "parameter list disagrees with the job's other ranks: ",
            FirstDifference(prepared.plist, plist->second, "parameters")));
      }
      if (job.ranks.count(rank.global)) {
        return absl::AlreadyExistsError(absl::StrCat(
            "rank ", RankString(rank.coords), " (global ", rank.global,
            ") of job '", job.id, "' is already registered"));
      }
      if (job.barrier_passed) {
        return absl::AlreadyExistsError(
            absl::StrCat("job '", job.id, "' is complete: all ", job.world,
                         " ranks registered; rank ", RankString(rank.coords),
                         " is already registered elsewhere"));
      }
      if (job.mapped_bytes + rank.mapped_bytes > options_.max_bytes_per_job) {
        return absl::ResourceExhaustedError(
            absl::StrCat("job '", job.id, "': mapped bytes would exceed ",
                         options_.max_bytes_per_job));
      }
    }
    job.stage_plist.emplace(stage, prepared.plist);
    job.mapped_bytes += rank.mapped_bytes;
    job.ranks[rank.global] = prepared.rank;
  }
  rank.worker = std::make_unique<Worker>();
  *job_out = slot;
  return absl::OkStatus();
}

void EngineImpl::Register(const v1::RegisterRequest& request,
                          const PeerInfo& peer,
                          Callback<v1::RegisterResponse> done) {
  if (shutting_down_) return done(Unavailable());
  absl::StatusOr<Prepared> prepared = Prepare(request, peer);
  if (!prepared.ok()) {
    spdlog::warn("register rejected: job={} rank=({},{},{}) peer={}: {}",
                 request.job_id(), request.rank().pp_rank(),
                 request.rank().dp_rank(), request.rank().tp_rank(),
                 peer.address, prepared.status().ToString());
    return done(prepared.status());
  }
  std::shared_ptr<Job> job;
  if (absl::Status s = Admit(request, *prepared, &job); !s.ok()) {
    spdlog::warn("register rejected: job={} rank=({},{},{}): {}",
                 request.job_id(), request.rank().pp_rank(),
                 request.rank().dp_rank(), request.rank().tp_rank(),
                 s.ToString());
    return done(s);
  }
  std::shared_ptr<LocalRank> rank = prepared->rank;
  spdlog::info("rank registering: job={} rank={} global={} daemon={}", job->id,
               RankString(rank->coords), rank->global, options_.daemon_id);
  auto shared_done =
      std::make_shared<Callback<v1::RegisterResponse>>(std::move(done));
  Worker::Task task;
  task.run = [this, job, rank, plist = prepared->plist, shared_done]() {
    RunRegister(job, rank, plist, std::move(*shared_done));
  };
  task.cancel = [this, shared_done]() { (*shared_done)(Unavailable()); };
  if (!rank->worker->Post(task)) task.cancel();
}

absl::StatusOr<std::string> EngineImpl::WaitGet(Job& job,
                                                const std::string& key,
                                                absl::Time deadline,
                                                absl::string_view what) {
  while (true) {
    if (shutting_down_) return Unavailable();
    {
      absl::MutexLock lock(&job.mu);
      if (job.state == JobState::kFailed) {
        return absl::AbortedError(absl::StrCat("job failed: ", job.failure));
      }
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("timed out waiting for ", what, " (key ", key, ")"));
    }
    absl::StatusOr<std::string> value =
        options_.control->Get(key, std::min(kWaitSlice, deadline - now));
    if (value.ok() ||
        value.status().code() != absl::StatusCode::kDeadlineExceeded) {
      return value;
    }
  }
}

absl::Status EngineImpl::CheckControlPlane(Job& job, const LocalRank& rank,
                                           const std::string& plist) {
  KvStore* kv = options_.control;
  const std::string prefix = JobPrefix(job.id);
  const absl::Time deadline = absl::Now() + options_.register_timeout;
  // The first rank of the job (on any daemon) publishes the job settings
  // and a hash of the token; every other rank compares.
  // The data plane is the daemons' setting, but all must agree: Gloo and
  // NCCL ranks cannot form a group.
  const std::string meta = absl::StrCat(
      "token=", plan::Fnv1a64Hex(absl::StrCat("canzona-token:", job.token)),
      "\n", job.meta, "\ncomm=", options_.comm);
  CANZONA_ASSIGN_OR_RETURN(int64_t n, kv->Add(prefix + "meta_claim", 1));
  if (n == 1) {
    CANZONA_RETURN_IF_ERROR(kv->Set(prefix + "meta", meta));
  } else {
    CANZONA_ASSIGN_OR_RETURN(
        std::string theirs,
        WaitGet(job, prefix + "meta", deadline, "job settings"));
    if (theirs != meta) {
      if (theirs.substr(0, theirs.find('\n')) !=
          meta.substr(0, meta.find('\n'))) {
        return absl::UnauthenticatedError(
            absl::StrCat("job_token does not match job '", job.id, "'"));
      }
      return absl::FailedPreconditionError(
          absl::StrCat("job settings disagree: ",
                       FirstDifference(meta, theirs, "settings")));
    }
  }
  const int stage = rank.coords.pp_rank();
  const std::string plist_key = absl::StrCat(prefix, "plist/", stage);
  CANZONA_ASSIGN_OR_RETURN(
      n, kv->Add(absl::StrCat(prefix, "plist_claim/", stage), 1));
  if (n == 1) {
    CANZONA_RETURN_IF_ERROR(kv->Set(plist_key, plist));
  } else {
    CANZONA_ASSIGN_OR_RETURN(
        std::string theirs,
        WaitGet(job, plist_key, deadline, "the parameter list"));
    if (theirs != plist) {
      return absl::FailedPreconditionError(
          absl::StrCat("parameter list disagrees with the job's other ranks: ",
                       FirstDifference(plist, theirs, "parameters")));
    }
  }
  const std::string claim = absl::StrCat(prefix, "rank/", rank.global);
  CANZONA_ASSIGN_OR_RETURN(n, kv->Add(claim, 1));
  if (n != 1) {
    (void)kv->Add(claim, -1);
    return absl::AlreadyExistsError(
        absl::StrCat("rank ", RankString(rank.coords), " (global ", rank.global,
                     ") of job '", job.id, "' is already registered"));
  }
  return absl::OkStatus();
}

void EngineImpl::RemoveRank(const std::shared_ptr<Job>& job,
                            const std::shared_ptr<LocalRank>& rank) {
  absl::MutexLock lock(&mu_);
  bool empty = false;
  {
    absl::MutexLock job_lock(&job->mu);
    job->ranks.erase(rank->global);
    job->mapped_bytes -= rank->mapped_bytes;
    const int stage = rank->coords.pp_rank();
    bool stage_left = false;
    for (const auto& [g, r] : job->ranks) {
      if (r->coords.pp_rank() == stage) stage_left = true;
    }
    if (!stage_left) job->stage_plist.erase(stage);
    empty = job->ranks.empty();
  }
  if (empty) {
    auto it = jobs_.find(job->id);
    if (it != jobs_.end() && it->second == job) jobs_.erase(it);
  }
  // Called from the rank's own worker: it cannot join itself.
  if (rank->worker) retired_.push_back(std::move(rank->worker));
}

void EngineImpl::FailJob(Job& job, const absl::Status& status) {
  std::vector<Callback<v1::RegisterResponse>> pending;
  std::vector<std::shared_ptr<LocalRank>> ranks;
  {
    absl::MutexLock lock(&job.mu);
    if (job.state == JobState::kFailed) return;
    job.state = JobState::kFailed;
    job.failure = status.ToString();
    for (auto& [g, r] : job.ranks) {
      ranks.push_back(r);
      if (r->register_done) pending.push_back(std::move(r->register_done));
      r->register_done = nullptr;
    }
    job.cv.SignalAll();
  }
  spdlog::error("job failed: job={} daemon={}: {}", job.id, options_.daemon_id,
                status.ToString());
  // Breaks the groups so that peers blocked with these ranks fail promptly.
  for (auto& r : ranks) r->AbortComms();
  for (auto& r : ranks) {
    r->FailPipeline(
        absl::AbortedError(absl::StrCat("job failed: ", status.message())));
  }
  for (auto& cb : pending) {
    cb(absl::Status(status.code(),
                    absl::StrCat("job failed: ", status.message())));
  }
}

void EngineImpl::RunRegister(std::shared_ptr<Job> job,
                             std::shared_ptr<LocalRank> rank, std::string plist,
                             Callback<v1::RegisterResponse> done) {
  KvStore* kv = options_.control;
  const std::string prefix = JobPrefix(job->id);
  // 1. Agreement checks; a failure here undoes this rank's registration.
  if (absl::Status s = CheckControlPlane(*job, *rank, plist); !s.ok()) {
    spdlog::warn("register rejected: job={} rank={}: {}", job->id,
                 RankString(rank->coords), s.ToString());
    RemoveRank(job, rank);
    return done(s);
  }
  // 2. Global barrier: every rank of the job, on every daemon.
  absl::Status status = [&]() -> absl::Status {
    CANZONA_ASSIGN_OR_RETURN(int64_t n, kv->Add(prefix + "registered", 1));
    if (n == job->world)
      CANZONA_RETURN_IF_ERROR(kv->Set(prefix + "ready", "1"));
    CANZONA_RETURN_IF_ERROR(
        WaitGet(*job, prefix + "ready", absl::Now() + options_.register_timeout,
                absl::StrCat("all ", job->world, " ranks to register"))
            .status());
    {
      absl::MutexLock lock(&job->mu);
      job->barrier_passed = true;
    }
    // 3. Plan (once per job on this daemon), digests agreed by every rank.
    CANZONA_ASSIGN_OR_RETURN(std::shared_ptr<const JobPlan> jp,
                             EnsurePlan(*job));
    CANZONA_RETURN_IF_ERROR(CheckDigests(*job, *rank, jp->plan.digest));
    // 4. Communicators, rules, buffers.
    return SetupRank(*job, *rank, *jp);
  }();
  if (!status.ok()) {
    FailJob(*job, status);
    return done(status);
  }
  // 5. Ready when every local rank is set up: Register returns together, so
  // no trainer steps into a half-built job.
  std::vector<std::pair<Callback<v1::RegisterResponse>, v1::RegisterResponse>>
      fire;
  absl::Status failed;
  {
    absl::MutexLock lock(&job->mu);
    if (job->state == JobState::kFailed) {
      failed = absl::AbortedError(absl::StrCat("job failed: ", job->failure));
    } else {
      rank->setup_done = true;
      rank->register_done = std::move(done);
      ++job->setup_done;
      if (job->setup_done == static_cast<int>(job->ranks.size())) {
        job->state = JobState::kReady;
        for (auto& [g, r] : job->ranks) {
          fire.emplace_back(std::move(r->register_done), r->response);
          r->register_done = nullptr;
        }
        job->cv.SignalAll();
      }
    }
  }
  if (!failed.ok()) return done(failed);
  if (!fire.empty()) {
    spdlog::info("job ready: job={} daemon={} local_ranks={} digest={}",
                 job->id, options_.daemon_id, fire.size(),
                 rank->response.plan_digest());
    std::shared_ptr<const JobPlan> jp;
    {
      absl::MutexLock lock(&job->mu);
      jp = job->plan;
    }
    if (options_.metrics != nullptr && jp != nullptr) {
      const CanzonaMetrics m = CanzonaMetrics::Register(options_.metrics);
      m.plan_max_over_mean->WithLabels({job->id})->Set(
          jp->plan.max_over_mean());
      m.plan_makespan_over_lb->WithLabels({job->id})->Set(
          jp->plan.makespan_over_lb());
      m.registered_parameters->WithLabels({job->id})->Set(
          static_cast<double>(jp->params.size()));
    }
  }
  for (auto& [cb, response] : fire) cb(response);
}

absl::StatusOr<std::shared_ptr<const JobPlan>> EngineImpl::EnsurePlan(
    Job& job) {
  absl::MutexLock plan_lock(&job.plan_mu);
  {
    absl::MutexLock lock(&job.mu);
    if (job.plan) return job.plan;
  }
  const std::string prefix = JobPrefix(job.id);
  const absl::Time deadline = absl::Now() + options_.register_timeout;
  auto jp = std::make_shared<JobPlan>();
  plan::PlanRequest request;
  for (int s = 0; s < job.layout.pp(); ++s) {
    CANZONA_ASSIGN_OR_RETURN(
        std::string plist,
        WaitGet(job, absl::StrCat(prefix, "plist/", s), deadline,
                absl::StrCat("the parameter list of stage ", s)));
    jp->stage_first.push_back(static_cast<int>(jp->params.size()));
    for (absl::string_view line : absl::StrSplit(plist, '\n')) {
      CANZONA_ASSIGN_OR_RETURN(ParamMeta m,
                               ParseParamLine(line, s, job.layout.tp()));
      plan::ParamSpec spec;
      spec.name = m.name;
      spec.shape = m.shape;
      spec.dtype = plan::DType::kFloat32;
      spec.optimizer = PlanKind(job.configs.at(m.group).kind);
      spec.tp_split_dim = m.split;
      spec.pp_stage = s;
      request.parameters.push_back(std::move(spec));
      jp->total_numel += m.numel;
      jp->params.push_back(std::move(m));
    }
  }
  request.layout = {job.layout.pp(), job.layout.dp(), job.layout.tp()};
  request.bucket_size = job.bucket_size;
  request.shard_group_size = job.shard_group_size;
  request.strategy = job.strategy;
  request.alpha = job.alpha;
  absl::StatusOr<plan::Plan> built = plan::BuildPlan(request);
  if (!built.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("planner: ", built.status().message()));
  }
  jp->plan = *std::move(built);
  spdlog::info(
      "plan built: job={} daemon={} strategy={} params={} buckets={} "
      "micro_groups={} makespan/mean={:.3f} digest={}",
      job.id, options_.daemon_id, job.strategy_name, jp->params.size(),
      jp->plan.buckets.size(), jp->plan.micro_groups.size(),
      jp->plan.max_over_mean(), jp->plan.digest);
  absl::MutexLock lock(&job.mu);
  job.plan = jp;
  return std::shared_ptr<const JobPlan>(jp);
}

absl::Status EngineImpl::CheckDigests(Job& job, const LocalRank& rank,
                                      const std::string& digest) {
  KvStore* kv = options_.control;
  const std::string prefix = JobPrefix(job.id);
  CANZONA_RETURN_IF_ERROR(
      kv->Set(absl::StrCat(prefix, "digest/", rank.global), digest));
  const absl::Time deadline = absl::Now() + options_.register_timeout;
  for (int g = 0; g < job.world; ++g) {
    CANZONA_ASSIGN_OR_RETURN(
        std::string theirs,
        WaitGet(job, absl::StrCat(prefix, "digest/", g), deadline,
                absl::StrCat("the plan digest of rank ", g)));
    if (theirs != digest) {
      return absl::FailedPreconditionError(
          absl::StrCat("plan digest mismatch: rank ", g, " planned ", theirs,
                       ", this daemon ", digest));
    }
  }
  return absl::OkStatus();
}

namespace {

// Parameter i's update on `param` / `grad` in staging memory: in place
// when staging is the compute backend's memory (cpu, or the NCCL data
// plane); else (cuda compute, host staging) through the rank's device
// buffers (the copy back synchronizes, so `param` is final on return).
absl::Status StepRule(RankRuntime& rt, int i, float* param, const float* grad,
                      const StepOptions& options) {
  UpdateRule& rule = *rt.rules.at(i);
  if (rt.staging == rt.backend.get()) return rule.Step(param, grad, options);
  const int64_t n = NumElements(rule.shape());
  float* p = rt.device_param.data();
  float* g = rt.device_grad.data();
  CANZONA_RETURN_IF_ERROR(rt.backend->CopyFromHost(grad, n, g));
  CANZONA_RETURN_IF_ERROR(rt.backend->CopyFromHost(param, n, p));
  CANZONA_RETURN_IF_ERROR(rule.Step(p, g, options));
  return rt.backend->CopyToHost(p, n, param);
}

// The DP communication of one bucket, on the rank's communication thread
// (BucketPipeline). Only that thread touches the dp and cross
// communicators, dp_copier, the comm_* scratch and, between a step's
// reductions and its gathers, the bucket's staging slots; the worker reads
// them only after WaitReduced and writes them only before StartGathers
// (after synchronizing its staging backend).

// n floats between a trainer buffer (shm, or CUDA IPC device memory) and
// staging. Device staging copies either kind on the copier's stream; host
// staging copies a device buffer through the IPC layer.
absl::Status FromTrainer(const LocalRank& rank, const float* src, int64_t n,
                         float* dst) {
  if (rank.rt->resident() || !rank.device_buffers) {
    return rank.rt->dp_copier->Copy(dst, src, n * sizeof(float));
  }
  return rank.ipc->CopyToHost(rank.buffer_device, src, n * sizeof(float), dst);
}

absl::Status ToTrainer(const LocalRank& rank, const float* src, int64_t n,
                       float* dst) {
  if (rank.rt->resident() || !rank.device_buffers) {
    return rank.rt->dp_copier->Copy(dst, src, n * sizeof(float));
  }
  return rank.ipc->CopyFromHost(rank.buffer_device, src, n * sizeof(float),
                                dst);
}

// Bucket b's uneven strategy in the current calibration round (see
// RankRuntime::UnevenCalibration); empty: the cost model.
std::optional<NcclUneven> UnevenFor(const RankRuntime& rt, int b) {
  const RankRuntime::UnevenCalibration& u = rt.uneven;
  if (!u.enabled || u.round == 0) return std::nullopt;
  if (u.round == 1) return NcclUneven::kPerRoot;
  if (u.round == 2) return NcclUneven::kPadded;
  return u.chosen[b];
}

// Runs one of the dp communicator's uneven collectives for bucket b under
// the round's strategy, timing it for the calibration.
template <typename Collective>
absl::Status TimedDp(RankRuntime& rt, int b, Collective&& collective) {
  rt.dp_uneven = UnevenFor(rt, b);
  const absl::Time start = absl::Now();
  absl::Status status = collective();
  if (rt.uneven.enabled && (rt.uneven.round == 1 || rt.uneven.round == 2)) {
    rt.uneven.seconds[rt.uneven.round - 1][b] += Seconds(start, absl::Now());
  }
  return status;
}

// Ends a calibration round after a step's last gather; after round 2 the
// DP group agrees on every bucket's faster strategy.
absl::Status EndUnevenRound(LocalRank& rank) {
  RankRuntime& rt = *rank.rt;
  RankRuntime::UnevenCalibration& u = rt.uneven;
  if (!u.enabled || u.round >= 3) return absl::OkStatus();
  if (++u.round < 3) return absl::OkStatus();
  const int buckets = static_cast<int>(rt.buckets.size());
  std::vector<float> sums(2 * buckets);
  for (int b = 0; b < buckets; ++b) {
    sums[2 * b] = static_cast<float>(u.seconds[0][b]);
    sums[2 * b + 1] = static_cast<float>(u.seconds[1][b]);
  }
  StageCopier& copier = *rt.dp_copier;
  float* staged = u.sums.data();
  CANZONA_RETURN_IF_ERROR(
      copier.Copy(staged, sums.data(), sums.size() * sizeof(float)));
  CANZONA_RETURN_IF_ERROR(rt.dp->AllReduce(staged, 2 * buckets));
  CANZONA_RETURN_IF_ERROR(
      copier.Copy(sums.data(), staged, sums.size() * sizeof(float)));
  CANZONA_RETURN_IF_ERROR(copier.Finish());
  int padded = 0;
  double per_root_s = 0, padded_s = 0;
  u.chosen.resize(buckets);
  for (int b = 0; b < buckets; ++b) {
    per_root_s += sums[2 * b];
    padded_s += sums[2 * b + 1];
    u.chosen[b] = sums[2 * b + 1] < sums[2 * b] ? NcclUneven::kPadded
                                                : NcclUneven::kPerRoot;
    padded += u.chosen[b] == NcclUneven::kPadded;
  }
  spdlog::info(
      "uneven collectives measured: rank={} buckets={} padded={} "
      "per_root={} (DP-summed seconds per-root {:.6f}, padded {:.6f})",
      RankString(rank.coords), buckets, padded, buckets - padded, per_root_s,
      padded_s);
  return absl::OkStatus();
}

// Stages the bucket's gradients and parameters from the trainer's buffers
// and sums the gradients over DP, unscaled (Step knows grad_scale): my
// slice when bucket-sliced (reduce-scatter-v in the shard group, then the
// all-reduce of the slice across groups), else the whole bucket (an even
// reduce-scatter + all-gather: a ring all-reduce's bandwidth, but every
// element summed in DP rank order on one rank, so every strategy gets the
// same bits).
absl::Status ReduceBucket(LocalRank& rank, const JobPlan& jp, int b) {
  RankRuntime& rt = *rank.rt;
  StageCopier& copier = *rt.dp_copier;
  const RankRuntime::Bucket& bucket = rt.buckets[b];
  // A GPU trainer's gradients are final once its event completed (it
  // records the event after backward wrote them, before GradReady/Step):
  // on the device the copies wait for it on the stream, on the host path
  // the thread waits.
  if (rank.grad_event != nullptr) {
    if (rt.resident()) {
      CANZONA_RETURN_IF_ERROR(
          copier.WaitEvent(static_cast<NcclEvent>(rank.grad_event)));
    } else {
      CANZONA_RETURN_IF_ERROR(
          rank.ipc->WaitEvent(rank.grad_event, rank.buffer_device));
    }
  }
  for (int i : jp.plan.buckets[bucket.index].params) {
    const int j = i - rt.first;
    const int64_t n = jp.params[i].local_numel;
    if (n == 0) continue;
    CANZONA_RETURN_IF_ERROR(FromTrainer(rank, rank.grad_buf[j], n,
                                        rt.gstage.data() + rt.offset[i]));
    CANZONA_RETURN_IF_ERROR(FromTrainer(rank, rank.param_buf[j], n,
                                        rt.pstage.data() + rt.offset[i]));
  }
  float* g = rt.gstage.data() + bucket.base;
  const int d = rt.shard_pos;
  float* tmp = rt.comm_tmp.data();
  if (rt.sliced) {
    const int64_t mine = bucket.counts[d];
    CANZONA_RETURN_IF_ERROR(TimedDp(
        rt, b, [&] { return rt.dp->ReduceScatterV(g, bucket.counts, tmp); }));
    CANZONA_RETURN_IF_ERROR(
        copier.Copy(g + bucket.my_start, tmp, mine * sizeof(float)));
    if (rt.cross->size() > 1 && mine > 0) {
      CANZONA_RETURN_IF_ERROR(rt.cross->AllReduce(g + bucket.my_start, mine));
    }
  } else if (rt.dp->size() > 1) {
    const std::vector<int64_t>& counts = bucket.even_counts;
    CANZONA_RETURN_IF_ERROR(rt.dp->ReduceScatterV(g, counts, tmp));
    CANZONA_RETURN_IF_ERROR(
        copier.Copy(g + bucket.even_start, tmp, counts[d] * sizeof(float)));
    CANZONA_RETURN_IF_ERROR(
        rt.dp->AllGatherV(g + bucket.even_start, counts, g));
  }
  return copier.Finish();
}

// Brings the bucket's updated parameters to every DP rank of the shard
// group and publishes them into the trainer's buffers. Layerwise plans
// ignore buckets: the first gather moves every owned parameter at once.
absl::Status GatherBucket(LocalRank& rank, const JobPlan& jp, int b) {
  RankRuntime& rt = *rank.rt;
  StageCopier& copier = *rt.dp_copier;
  const RankRuntime::Bucket& bucket = rt.buckets[b];
  const int DP = rt.dp->size(), d = rt.shard_pos;
  if (rt.sliced) {
    float* p = rt.pstage.data() + bucket.base;
    CANZONA_RETURN_IF_ERROR(TimedDp(rt, b, [&] {
      return rt.dp->AllGatherV(p + bucket.my_start, bucket.counts, p);
    }));
  } else if (jp.plan.strategy == plan::Strategy::kLayerwise && DP > 1 &&
             b == rt.gather_order.front()) {
    // Each rank's owned parameters packed in stage order; one all-gather.
    const std::vector<int64_t>& counts = rt.layerwise_counts;
    float* packed = rt.comm_send.data();
    int64_t pos = 0;
    for (int i : rt.local_params) {
      if (jp.plan.dp_owner[i] != d) continue;
      const int64_t n = jp.params[i].local_numel;
      CANZONA_RETURN_IF_ERROR(copier.Copy(
          packed + pos, rt.pstage.data() + rt.offset[i], n * sizeof(float)));
      pos += n;
    }
    std::vector<int64_t> at(DP, 0);
    for (int r = 1; r < DP; ++r) at[r] = at[r - 1] + counts[r - 1];
    CANZONA_RETURN_IF_ERROR(
        rt.dp->AllGatherV(packed, counts, rt.comm_recv.data()));
    for (int i : rt.local_params) {
      const int owner = jp.plan.dp_owner[i];
      const int64_t n = jp.params[i].local_numel;
      CANZONA_RETURN_IF_ERROR(copier.Copy(rt.pstage.data() + rt.offset[i],
                                          rt.comm_recv.data() + at[owner],
                                          n * sizeof(float)));
      at[owner] += n;
    }
  }
  for (int i : jp.plan.buckets[bucket.index].params) {
    const int64_t n = jp.params[i].local_numel;
    if (n == 0) continue;
    CANZONA_RETURN_IF_ERROR(ToTrainer(rank, rt.pstage.data() + rt.offset[i], n,
                                      rank.param_buf[i - rt.first]));
  }
  CANZONA_RETURN_IF_ERROR(copier.Finish());
  return b == rt.gather_order.back() ? EndUnevenRound(rank) : absl::OkStatus();
}

// Sums `n` host floats over the job's ranks (the world communicator works
// on staging memory: device memory on the NCCL data plane).
absl::Status WorldSum(RankRuntime& rt, float* values, int n) {
  float* staged = rt.scalars.data();
  CANZONA_RETURN_IF_ERROR(rt.staging->CopyFromHost(values, n, staged));
  CANZONA_RETURN_IF_ERROR(rt.staging->Synchronize());
  CANZONA_RETURN_IF_ERROR(rt.world->AllReduce(staged, n));
  return rt.staging->CopyToHost(staged, n, values);
}

}  // namespace

absl::Status EngineImpl::SetupRank(Job& job, LocalRank& rank,
                                   const JobPlan& jp) {
  auto rt = std::make_unique<RankRuntime>();
  const plan::Plan& plan = jp.plan;
  const int pp = rank.coords.pp_rank(), t = rank.coords.tp_rank();
  const int DP = job.layout.dp(), TP = job.layout.tp();
  // Hierarchical sharding: the plan is one shard group's (its DP indices
  // are positions in the group); the groups hold replicas of it.
  const int S = job.shard_group_size;
  rt->shard_size = S;
  rt->shard_pos = rank.coords.dp_rank() % S;
  rt->shard_group = rank.coords.dp_rank() / S;
  const int d = rt->shard_pos;

  // cuda: the rank's GPU is its global rank modulo the devices present (a
  // node's trainers are its consecutive global ranks). With Gloo the
  // updates run there and the data plane stages in host memory; with NCCL
  // everything stays on it.
  const bool nccl = options_.comm == "nccl";
  const int devices = options_.backend == "cpu" ? 0 : CudaDevices();
  const int device = devices > 0 ? rank.global % devices : 0;
  CANZONA_ASSIGN_OR_RETURN(rt->backend,
                           CreateBackendByName(options_.backend, device));
  if (rt->backend->kind() == BackendKind::kCpu) {
    rt->host = rt->backend.get();
  } else {
    CANZONA_ASSIGN_OR_RETURN(rt->host_backend,
                             CreateBackend(BackendKind::kCpu));
    rt->host = rt->host_backend.get();
  }
  rt->staging = nccl ? rt->backend.get() : rt->host;
  rt->device = device;
  NcclApi* nccl_api = nullptr;
  if (nccl) {
    if (options_.nccl_api != nullptr) {
      nccl_api = options_.nccl_api;
    } else {
      CANZONA_ASSIGN_OR_RETURN(nccl_api, RealNcclApi());
      absl::MutexLock lock(&job.mu);
      // NCCL runs one rank of a communicator per GPU.
      if (static_cast<int>(job.ranks.size()) > devices) {
        return absl::FailedPreconditionError(absl::StrCat(
            "comm 'nccl' needs a GPU per local rank: job '", job.id, "' has ",
            job.ranks.size(), " ranks on this daemon and ", devices,
            " GPU(s); run the daemon with --comm=gloo to share GPUs"));
      }
    }
    rt->nccl_api = nccl_api;
    for (auto* copier : {&rt->dp_copier, &rt->tp_copier, &rt->world_copier}) {
      CANZONA_ASSIGN_OR_RETURN(
          *copier,
          CreateDeviceStageCopier(nccl_api, device, options_.step_timeout));
    }
  } else {
    rt->dp_copier = CreateHostStageCopier();
    rt->tp_copier = CreateHostStageCopier();
    rt->world_copier = CreateHostStageCopier();
  }

  // Parameters of my stage and their place in the stage buffers.
  const int n = static_cast<int>(jp.params.size());
  const int first = jp.stage_first[pp];
  const int count = static_cast<int>(rank.param_buf.size());
  rt->first = first;
  for (int j = 0; j < count; ++j) rt->local_params.push_back(first + j);
  rt->offset.assign(n, -1);
  rt->mode.assign(n, Mode::kLocal);
  rt->dp_owned.assign(n, 0);
  rt->counted.assign(n, 0);
  rt->sliced = plan.strategy != plan::Strategy::kSc &&
               plan.strategy != plan::Strategy::kLayerwise;
  int64_t base = 0;
  for (int b = 0; b < static_cast<int>(plan.buckets.size()); ++b) {
    const plan::BucketPlan& bp = plan.buckets[b];
    if (bp.stage != pp) continue;
    RankRuntime::Bucket bucket;
    bucket.index = b;
    bucket.base = base;
    std::vector<int64_t> param_start;
    for (int i : bp.params) {
      param_start.push_back(bucket.elements);
      rt->offset[i] = base + bucket.elements;
      bucket.elements += jp.params[i].local_numel;
    }
    param_start.push_back(bucket.elements);
    if (rt->sliced) {
      if (static_cast<int>(bp.cuts.size()) != S + 1) {
        return absl::InternalError(absl::StrCat("plan bucket ", b, " has ",
                                                bp.cuts.size(),
                                                " cuts, expected ", S + 1));
      }
      for (int r = 0; r < S; ++r) {
        bucket.counts.push_back(param_start[bp.cuts[r + 1]] -
                                param_start[bp.cuts[r]]);
      }
      bucket.my_start = param_start[bp.cuts[d]];
    }
    for (int r = 0; r < S; ++r) {
      bucket.even_counts.push_back(bucket.elements / S +
                                   (r < bucket.elements % S ? 1 : 0));
      if (r < d) bucket.even_start += bucket.even_counts.back();
    }
    base += bucket.elements;
    rt->buckets.push_back(std::move(bucket));
  }
  for (int i : rt->local_params) {
    if (rt->offset[i] < 0) {
      return absl::InternalError(absl::StrCat(
          "plan: parameter '", jp.params[i].name, "' is in no bucket"));
    }
  }
  // My largest bucket slice (comm_tmp), the layerwise gather's slices,
  // and the largest padded collective of the dp communicator (NCCL's
  // scratch, allocated with it).
  int64_t max_slice = 0, dp_scratch = 0, layerwise_total = 0;
  for (const RankRuntime::Bucket& b : rt->buckets) {
    const std::vector<int64_t>& counts = rt->sliced ? b.counts : b.even_counts;
    max_slice = std::max(max_slice, counts[d]);
    for (int64_t c : counts) dp_scratch = std::max(dp_scratch, S * c);
  }
  if (plan.strategy == plan::Strategy::kLayerwise && S > 1) {
    rt->layerwise_counts.assign(S, 0);
    for (int i : rt->local_params) {
      rt->layerwise_counts[plan.dp_owner[i]] += jp.params[i].local_numel;
      layerwise_total += jp.params[i].local_numel;
    }
    for (int64_t c : rt->layerwise_counts) {
      dp_scratch = std::max(dp_scratch, S * c);
    }
  }

  // Communicators: DP (same pp, tp), TP (same pp, dp), world. Every rank
  // creates them in this order, so the rendezvous cannot deadlock. NCCL
  // groups of one rank are NCCL communicators too (device memory), each on
  // the stream of the thread that drives it.
  GlooOptions gloo;
  gloo.hostname = options_.comm_host;
  gloo.timeout = options_.step_timeout;
  NcclOptions nccl_options;
  nccl_options.timeout = options_.step_timeout;
  const std::string prefix = JobPrefix(job.id);
  // What the last make() created besides the communicator it returns.
  CountingCommunicator* last_counting = nullptr;
  NcclCommunicator* last_nccl = nullptr;
  auto make = [&](const std::string& name, int r, int size,
                  const StageCopier& copier,
                  NcclUnevenChooser chooser = nullptr,
                  int64_t scratch_floats =
                      0) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    absl::StatusOr<std::unique_ptr<Communicator>> comm;
    if (nccl) {
      NcclOptions o = nccl_options;
      o.chooser = std::move(chooser);
      o.scratch_floats = scratch_floats;
      comm = CreateNcclCommunicator(
          options_.control, absl::StrCat(prefix, "nccl/", name), nccl_api,
          NcclLocalRank{r, device, copier.stream()}, size, o);
    } else if (size == 1) {
      return CreateLocalCommunicator();
    } else {
      comm = CreateGlooCommunicator(options_.control,
                                    absl::StrCat(prefix, "comm/", name, "/"), r,
                                    size, gloo);
    }
    if (!comm.ok()) {
      return absl::Status(comm.status().code(),
                          absl::StrCat("creating the ", name,
                                       " group: ", comm.status().message()));
    }
    NcclCommunicator* nccl_comm =
        nccl ? dynamic_cast<NcclCommunicator*>(comm->get()) : nullptr;
    if (options_.metrics != nullptr && size > 1) {
      auto counting = std::make_unique<CountingCommunicator>(
          *std::move(comm), CanzonaMetrics::Register(options_.metrics), job.id,
          std::to_string(rank.global));
      last_counting = counting.get();
      last_nccl = nccl_comm;
      return std::unique_ptr<Communicator>(std::move(counting));
    }
    last_counting = nullptr;
    last_nccl = nccl_comm;
    return comm;
  };
  const std::string dp_name =
      S == DP ? absl::StrCat("dp.", pp, ".", t)
              : absl::StrCat("dp.", pp, ".", t, ".g", rt->shard_group);
  RankRuntime* runtime = rt.get();
  const NcclCostModel cost = nccl_options.cost;
  CANZONA_ASSIGN_OR_RETURN(
      rt->dp,
      make(
          dp_name, d, S, *rt->dp_copier,
          [runtime, cost](absl::Span<const int64_t> counts) {
            return runtime->dp_uneven.value_or(ChooseUneven(counts, cost));
          },
          dp_scratch));
  rank.AddComm(rt->dp.get());
  CANZONA_ASSIGN_OR_RETURN(
      rt->tp, make(absl::StrCat("tp.", pp, ".", rank.coords.dp_rank()), t, TP,
                   *rt->tp_copier));
  rank.AddComm(rt->tp.get());
  rt->tp_nccl = last_nccl;
  rt->tp_counting = last_counting;
  CANZONA_ASSIGN_OR_RETURN(
      rt->world, make("world", rank.global, job.world, *rt->world_copier));
  rank.AddComm(rt->world.get());
  CANZONA_ASSIGN_OR_RETURN(rt->cross,
                           make(absl::StrCat("xdp.", pp, ".", t, ".p", d),
                                rt->shard_group, DP / S, *rt->dp_copier));
  rank.AddComm(rt->cross.get());

  Backend& staging = *rt->staging;
  CANZONA_ASSIGN_OR_RETURN(rt->gstage, staging.Allocate(base));
  CANZONA_ASSIGN_OR_RETURN(rt->pstage, staging.Allocate(base));
  CANZONA_ASSIGN_OR_RETURN(rt->pold, staging.Allocate(base));
  CANZONA_ASSIGN_OR_RETURN(rt->scalars, staging.Allocate(2));
  CANZONA_ASSIGN_OR_RETURN(rt->comm_tmp, staging.Allocate(max_slice));
  if (rt->resident() && rt->sliced && S > 1) {
    const size_t buckets = rt->buckets.size();
    rt->uneven.enabled = true;
    rt->uneven.seconds[0].assign(buckets, 0.0);
    rt->uneven.seconds[1].assign(buckets, 0.0);
    CANZONA_ASSIGN_OR_RETURN(rt->uneven.sums, staging.Allocate(2 * buckets));
  }
  if (!rt->layerwise_counts.empty()) {
    CANZONA_ASSIGN_OR_RETURN(rt->comm_send,
                             staging.Allocate(rt->layerwise_counts[d]));
    CANZONA_ASSIGN_OR_RETURN(rt->comm_recv, staging.Allocate(layerwise_total));
  }

  // Who updates what, and the rule state only where it is owned.
  int64_t max_full = 0;
  for (int i : rt->local_params) {
    const ParamMeta& m = jp.params[i];
    const OptimizerConfig& config = job.configs.at(m.group);
    const int owner = plan.dp_owner[i];
    const bool split = m.split >= 0 && TP > 1;
    if (split && IsMatrix(config.kind)) {
      rt->mode[i] = plan.tp_host[i] >= 0 ? Mode::kHosted : Mode::kRedundant;
    }
    rt->dp_owned[i] = owner < 0 || owner == d;
    rt->counted[i] = (owner < 0 ? d == 0 : owner == d) &&
                     rt->shard_group == 0 && (split || t == 0);
    if (!rt->dp_owned[i]) continue;
    std::vector<int64_t> shape;
    switch (rt->mode[i]) {
      case Mode::kLocal:
        shape = m.local_shape;
        break;
      case Mode::kHosted:
        if (plan.tp_host[i] == t) shape = m.shape;
        break;
      case Mode::kRedundant:
        shape = m.shape;
        rt->redundant.push_back(i);
        break;
    }
    if (shape.empty()) continue;
    max_full = std::max(max_full, NumElements(shape));
    absl::StatusOr<std::unique_ptr<UpdateRule>> rule =
        UpdateRule::Create(config, shape, rt->backend.get());
    if (!rule.ok()) {
      return absl::Status(
          rule.status().code(),
          absl::StrCat("parameter '", m.name, "': ", rule.status().message()));
    }
    rt->state_bytes += (*rule)->state_bytes();
    ++rt->owned;
    rt->rules.emplace(i, *std::move(rule));
  }
  for (const plan::MicroGroup& g : plan.micro_groups) {
    if (g.stage == pp && g.dp == d) rt->groups.push_back(&g);
  }
  // The micro groups' exchange counts and buffers, and the redundant
  // updates' all-gather buffers (the largest parameter).
  rt->group_buffers.resize(rt->groups.size());
  for (size_t k = 0; k < rt->groups.size(); ++k) {
    RankRuntime::GroupBuffers& b = rt->group_buffers[k];
    b.send_counts.assign(TP, 0);
    b.back_recv.assign(TP, 0);
    int64_t local = 0;
    for (int i : rt->groups[k]->params) {
      const int h = plan.tp_host[i];
      b.send_counts[h] += 2 * jp.params[i].local_numel;
      b.back_recv[h] += jp.params[i].local_numel;
      local += jp.params[i].local_numel;
      if (h == t) b.hosted_here += jp.params[i].local_numel;
    }
    b.recv_counts.assign(TP, 2 * b.hosted_here);
    b.back_send.assign(TP, b.hosted_here);
    CANZONA_ASSIGN_OR_RETURN(b.send, staging.Allocate(2 * local));
    CANZONA_ASSIGN_OR_RETURN(b.recv, staging.Allocate(2 * b.hosted_here * TP));
    CANZONA_ASSIGN_OR_RETURN(b.back, staging.Allocate(b.hosted_here * TP));
    CANZONA_ASSIGN_OR_RETURN(b.back_in, staging.Allocate(local));
  }
  if (rt->tp_nccl != nullptr) {
    CANZONA_RETURN_IF_ERROR(
        rt->events.Create(rt->nccl_api, device, 2 * rt->groups.size() + 1));
  }
  int64_t max_redundant = 0;
  for (int i : rt->redundant) {
    max_redundant = std::max(max_redundant, jp.params[i].local_numel);
  }
  CANZONA_ASSIGN_OR_RETURN(rt->send, staging.Allocate(2 * max_redundant));
  CANZONA_ASSIGN_OR_RETURN(rt->recv, staging.Allocate(2 * max_redundant * TP));
  CANZONA_ASSIGN_OR_RETURN(rt->full_g, staging.Allocate(max_full));
  CANZONA_ASSIGN_OR_RETURN(rt->full_p, staging.Allocate(max_full));
  if (rt->staging != rt->backend.get()) {
    CANZONA_ASSIGN_OR_RETURN(rt->device_param, rt->backend->Allocate(max_full));
    CANZONA_ASSIGN_OR_RETURN(rt->device_grad, rt->backend->Allocate(max_full));
    spdlog::info("rank {} updates on {}", RankString(rank.coords),
                 rt->backend->description());
  }

  if (options_.metrics != nullptr) {
    const CanzonaMetrics m = CanzonaMetrics::Register(options_.metrics);
    const std::string g = std::to_string(rank.global);
    rt->metrics = std::make_unique<RankMetrics>(m, job.id, g);
    const size_t at = (static_cast<size_t>(pp) * S + d) * TP + t;
    if (at < plan.per_gpu.size()) {
      m.rank_compute_flops->WithLabels({job.id, g})
          ->Set(plan.per_gpu[at].flops);
    }
    m.optimizer_state_bytes->WithLabels({job.id, g})
        ->Set(static_cast<double>(rt->state_bytes));
  }
  // The trainer's view of the buckets, and the DP communication thread.
  for (const RankRuntime::Bucket& b : rt->buckets) {
    v1::Bucket* out = rank.response.add_buckets();
    for (int i : plan.buckets[b.index].params) out->add_parameters(i - first);
    out->set_elements(b.elements);
  }
  for (int b = static_cast<int>(rt->buckets.size()) - 1; b >= 0; --b) {
    rt->gather_order.push_back(b);
  }
  std::shared_ptr<const JobPlan> plan_ref;
  {
    absl::MutexLock lock(&job.mu);
    plan_ref = job.plan;
  }
  LocalRank* r = &rank;
  rank.SetPipeline(std::make_unique<BucketPipeline>(
      static_cast<int>(rt->buckets.size()),
      [r, plan_ref](int64_t, int b) { return ReduceBucket(*r, *plan_ref, b); },
      [r, plan_ref](int64_t, int b) {
        return GatherBucket(*r, *plan_ref, b);
      }));
  rank.response.set_plan_digest(plan.digest);
  rank.response.set_owned_parameters(rt->owned);
  rank.response.set_state_bytes(rt->state_bytes);
  spdlog::info(
      "rank ready: job={} rank={} owned={} state_bytes={} "
      "micro_groups={}",
      job.id, RankString(rank.coords), rt->owned, rt->state_bytes,
      rt->groups.size());
  rank.rt = std::move(rt);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Job>> EngineImpl::FindJob(
    const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(
        absl::StrCat("job_id '", job_id, "' is not registered here"));
  }
  return it->second;
}

// ---------------------------------------------------------------------------
// Step.

void EngineImpl::Step(const v1::StepRequest& request,
                      Callback<v1::StepResponse> done) {
  if (shutting_down_) return done(Unavailable());
  absl::StatusOr<std::shared_ptr<Job>> found = FindJob(request.job_id());
  if (!found.ok()) return done(found.status());
  std::shared_ptr<Job> job = *std::move(found);
  std::shared_ptr<LocalRank> rank;
  absl::Status status = [&]() -> absl::Status {
    const v1::RankCoordinates& r = request.rank();
    const v1::WorldLayout& l = job->layout;
    if (r.pp_rank() < 0 || r.pp_rank() >= l.pp() || r.dp_rank() < 0 ||
        r.dp_rank() >= l.dp() || r.tp_rank() < 0 || r.tp_rank() >= l.tp()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", RankString(r), " outside the layout"));
    }
    if (!(request.grad_scale() >= 0) || !std::isfinite(request.grad_scale())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "grad_scale ", request.grad_scale(), " must be finite and >= 0"));
    }
    for (const auto& [group, lr] : request.lr()) {
      if (!job->configs.count(group)) {
        return absl::InvalidArgumentError(
            absl::StrCat("lr['", group, "']: unknown group"));
      }
      if (!(lr >= 0) || !std::isfinite(lr)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "lr['", group, "']: ", lr, " must be finite and >= 0"));
      }
    }
    const int global =
        (r.pp_rank() * l.dp() + r.dp_rank()) * l.tp() + r.tp_rank();
    absl::MutexLock lock(&job->mu);
    if (job->state == JobState::kFailed) {
      return absl::FailedPreconditionError(
          absl::StrCat("job failed: ", job->failure));
    }
    if (job->state != JobState::kReady) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", job->id, "' is not ready: ranks are still registering"));
    }
    auto it = job->ranks.find(global);
    if (it == job->ranks.end()) {
      return absl::NotFoundError(
          absl::StrCat("rank ", RankString(r), " of job '", job->id,
                       "' is not registered with this daemon"));
    }
    rank = it->second;
    if (request.step() != rank->next_step) {
      return absl::FailedPreconditionError(
          absl::StrCat("step out of order: expected step ", rank->next_step,
                       ", got ", request.step()));
    }
    ++rank->next_step;
    ++job->arrivals[request.step()];
    job->cv.SignalAll();
    // Every gradient is final now: reduce what GradReady did not start.
    // Under job->mu, so that a GradReady of the next step (accepted once
    // next_step moved) can never reach the pipeline first.
    rank->pipeline->MarkAllReady(request.step());
    return absl::OkStatus();
  }();
  if (!status.ok()) return done(status);

  auto shared_done =
      std::make_shared<Callback<v1::StepResponse>>(std::move(done));
  Worker::Task task;
  task.run = [this, job, rank, request, shared_done]() {
    RunStep(job, rank, request, std::move(*shared_done));
  };
  task.cancel = [this, shared_done]() { (*shared_done)(Unavailable()); };
  if (!rank->worker->Post(task)) task.cancel();
}

void EngineImpl::RunStep(std::shared_ptr<Job> job,
                         std::shared_ptr<LocalRank> rank,
                         v1::StepRequest request,
                         Callback<v1::StepResponse> done) {
  const absl::Time start = absl::Now();
  const int64_t k = request.step();
  std::shared_ptr<const JobPlan> jp;
  // Wait until every local rank of the job has called Step(k).
  absl::Status status = [&]() -> absl::Status {
    absl::MutexLock lock(&job->mu);
    jp = job->plan;
    const int local = static_cast<int>(job->ranks.size());
    const absl::Time deadline = start + options_.step_timeout;
    while (job->arrivals[k] < local && job->state == JobState::kReady &&
           !shutting_down_) {
      if (job->cv.WaitWithDeadline(&job->mu, deadline)) break;
    }
    const bool all = job->arrivals[k] >= local;
    if (++job->departures[k] >= local) {
      job->arrivals.erase(k);
      job->departures.erase(k);
    }
    if (shutting_down_) return Unavailable();
    if (job->state == JobState::kFailed) {
      return absl::AbortedError(
          absl::StrCat("step ", k, " aborted: job failed: ", job->failure));
    }
    if (!all) {
      std::vector<std::string> missing;
      for (const auto& [g, r] : job->ranks) {
        if (r->next_step <= k) missing.push_back(RankString(r->coords));
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "step ", k, ": local rank(s) ", absl::StrJoin(missing, ", "),
          " did not call Step within ",
          absl::FormatDuration(options_.step_timeout)));
    }
    return absl::OkStatus();
  }();
  v1::StepResponse response;
  response.mutable_seconds()->set_wait(Seconds(start, absl::Now()));
  if (status.ok()) status = Pipeline(*job, *rank, *jp, request, &response);
  if (!status.ok()) {
    if (shutting_down_) {
      status = Unavailable();
    } else if (job->failed() &&
               status.code() != absl::StatusCode::kUnavailable &&
               status.code() != absl::StatusCode::kAborted) {
      // A broken group after another rank's failure, or a collective that
      // ran into its timeout because Abort cannot wake a Gloo send already
      // waiting on a dead peer: report the cause.
      absl::MutexLock lock(&job->mu);
      status = absl::AbortedError(
          absl::StrCat("step ", k, " aborted: job failed: ", job->failure));
    } else {
      status =
          absl::Status(status.code(), absl::StrCat("step ", k, " on rank ",
                                                   RankString(rank->coords),
                                                   ": ", status.message()));
      FailJob(*job, status);
    }
    spdlog::error("step failed: job={} rank={} step={}: {}", job->id,
                  RankString(rank->coords), k, status.ToString());
    done(status);
    RunAfterStep(*job, *rank, -1);
    return;
  }
  response.mutable_seconds()->set_total(Seconds(start, absl::Now()));
  {
    double comm = 0, exposed = 0;
    rank->pipeline->TakeTimes(&comm, &exposed);
    response.mutable_seconds()->set_dp_comm(comm);
    response.mutable_seconds()->set_dp_comm_exposed(exposed);
  }
  if (rank->rt->metrics != nullptr) {
    rank->rt->metrics->RecordStep(response, rank->rt->tp_comm_s,
                                  rank->rt->tp_hidden_s);
  }
  {
    absl::MutexLock lock(&job->mu);
    rank->steps_done = k;
    rank->last = response.seconds();
  }
  done(response);
  RunAfterStep(*job, *rank, k);
}

absl::Status EngineImpl::Pipeline(Job& job, LocalRank& rank, const JobPlan& jp,
                                  const v1::StepRequest& request,
                                  v1::StepResponse* response) {
  RankRuntime& rt = *rank.rt;
  rt.tp_comm_s = rt.tp_hidden_s = 0;
  v1::PhaseTimes* times = response->mutable_seconds();
  const int d = rt.shard_pos;
  const int DP = job.layout.dp();
  std::map<std::string, float> lr;
  for (const auto& [group, value] : request.lr())
    lr[group] = static_cast<float>(value);
  auto options_for = [&](int i) {
    StepOptions o;
    auto it = lr.find(jp.params[i].group);
    if (it != lr.end()) o.lr = it->second;
    return o;
  };

  // 1. The DP gradient sums (ReduceBucket on the communication thread,
  // started by GradReady or by Step), then the average: my slice, or the
  // whole bucket when every rank holds every sum.
  const int64_t k = request.step();
  double waited = 0;
  CANZONA_RETURN_IF_ERROR(rank.pipeline->WaitReduced(
      k, absl::Now() + options_.step_timeout, &waited));
  absl::Time t0 = absl::Now();
  Backend& staging = *rt.staging;
  const double scale = request.grad_scale() == 0 ? 1.0 : request.grad_scale();
  const float factor = static_cast<float>(scale / DP);
  for (const RankRuntime::Bucket& b : rt.buckets) {
    const int64_t begin = rt.sliced ? b.my_start : 0;
    const int64_t end = rt.sliced ? b.my_start + b.counts[d] : b.elements;
    CANZONA_RETURN_IF_ERROR(
        staging.Scale(end - begin, factor, rt.gstage.data() + b.base + begin));
  }
  times->set_reduce_scatter(waited + Seconds(t0, absl::Now()));

  // 2. Non-finite check and the squared gradient norm, one world
  // all-reduce: [any non-finite, sum of squares counted once].
  double sumsq = 0;
  float nonfinite = 0;
  for (int i : rt.local_params) {
    if (!rt.dp_owned[i]) continue;
    const float* g = rt.gstage.data() + rt.offset[i];
    const int64_t n = jp.params[i].local_numel;
    CANZONA_ASSIGN_OR_RETURN(bool finite, staging.AllFinite(n, g));
    if (!finite) nonfinite = 1;
    if (rt.counted[i]) {
      CANZONA_ASSIGN_OR_RETURN(double s, staging.SumSquares(n, g));
      sumsq += s;
    }
  }
  float flags[2] = {nonfinite, static_cast<float>(sumsq)};
  CANZONA_RETURN_IF_ERROR(WorldSum(rt, flags, 2));
  if (flags[0] > 0) {
    // Nothing changed: the trainer's parameters stay as they are.
    rank.pipeline->StartGathers(k, rt.gather_order, false);
    response->set_skipped_nonfinite(true);
    response->set_grad_norm(std::nan(""));
    spdlog::warn("step skipped (non-finite gradient): job={} rank={} step={}",
                 job.id, RankString(rank.coords), request.step());
    return absl::OkStatus();
  }
  response->set_grad_norm(std::sqrt(static_cast<double>(flags[1])));
  CANZONA_RETURN_IF_ERROR(
      staging.Copy(rt.pstage.data(), rt.pstage.size(), rt.pold.data()));

  // 3. Local updates of owned, non-hosted parameters.
  t0 = absl::Now();
  for (int i : rt.local_params) {
    if (!rt.dp_owned[i] || rt.mode[i] != Mode::kLocal) continue;
    CANZONA_RETURN_IF_ERROR(StepRule(rt, i, rt.pstage.data() + rt.offset[i],
                                     rt.gstage.data() + rt.offset[i],
                                     options_for(i)));
  }
  times->set_local_compute(Seconds(t0, absl::Now()));

  // 4. TP: hosted micro groups (sliced strategies), or every TP rank
  // gathering whole matrices and updating them redundantly (sc, layerwise).
  CANZONA_RETURN_IF_ERROR(RunMicroGroups(job, rank, jp, lr, times));
  const int TP = job.layout.tp(), t = rank.coords.tp_rank();
  for (int i : rt.redundant) {
    const ParamMeta& m = jp.params[i];
    const int64_t ln = m.local_numel;
    absl::Time g0 = absl::Now();
    float* send = rt.send.data();
    float* recv = rt.recv.data();
    CANZONA_RETURN_IF_ERROR(
        staging.Copy(rt.gstage.data() + rt.offset[i], ln, send));
    CANZONA_RETURN_IF_ERROR(
        staging.Copy(rt.pstage.data() + rt.offset[i], ln, send + ln));
    CANZONA_RETURN_IF_ERROR(staging.Synchronize());  // tp reads it
    const std::vector<int64_t> counts(TP, 2 * ln);
    CANZONA_RETURN_IF_ERROR(rt.tp->AllGatherV(send, counts, recv));
    for (int j = 0; j < TP; ++j) {
      float* frag = recv + 2 * ln * j;
      CANZONA_RETURN_IF_ERROR(
          MoveFragment(staging, m, TP, j, frag, rt.full_g.data(), true));
      CANZONA_RETURN_IF_ERROR(
          MoveFragment(staging, m, TP, j, frag + ln, rt.full_p.data(), true));
    }
    absl::Time c0 = absl::Now();
    times->set_tp_gather(times->tp_gather() + Seconds(g0, c0));
    CANZONA_RETURN_IF_ERROR(
        StepRule(rt, i, rt.full_p.data(), rt.full_g.data(), options_for(i)));
    CANZONA_RETURN_IF_ERROR(MoveFragment(staging, m, TP, t,
                                         rt.pstage.data() + rt.offset[i],
                                         rt.full_p.data(), false));
    times->set_tp_compute(times->tp_compute() + Seconds(c0, absl::Now()));
  }

  // 5. Update RMS over every element once: the owners' slots are final
  // now, so it does not wait for the all-gathers. (pold becomes the
  // difference: it is rewritten from pstage at the next step.)
  double usq = 0;
  for (int i : rt.local_params) {
    if (!rt.counted[i]) continue;
    const int64_t n = jp.params[i].local_numel;
    float* diff = rt.pold.data() + rt.offset[i];
    CANZONA_RETURN_IF_ERROR(
        staging.Axpby(n, 1.0f, rt.pstage.data() + rt.offset[i], -1.0f, diff));
    CANZONA_ASSIGN_OR_RETURN(double s, staging.SumSquares(n, diff));
    usq += s;
  }
  float u = static_cast<float>(usq);
  CANZONA_RETURN_IF_ERROR(WorldSum(rt, &u, 1));
  response->set_update_rms(
      jp.total_numel > 0 ? std::sqrt(static_cast<double>(u) / jp.total_numel)
                         : 0);
  // The communication thread reads pstage from here on.
  CANZONA_RETURN_IF_ERROR(staging.Synchronize());

  // 6. Parameters back to every DP rank and into the trainer's buffers
  // (GatherBucket on the communication thread, the last bucket first, as
  // the next forward needs them). With async_params the trainer waits per
  // bucket (WaitParams) instead.
  rank.pipeline->StartGathers(k, rt.gather_order, true);
  if (!request.async_params()) {
    CANZONA_RETURN_IF_ERROR(rank.pipeline->WaitGathered(
        k, absl::Now() + options_.step_timeout, &waited));
    times->set_all_gather(waited);
  }
  return absl::OkStatus();
}

namespace {

// The three parts of one micro group. Gather and Scatter touch only the TP
// communicator and the group's own buffers and parameter slots (disjoint
// from every other group's), so they can run on the comm thread while
// Compute of a neighbouring group runs on the worker.

// Packs [grad, param] of every fragment per host (on the tp copier) for
// the fused all-to-all that brings each host its matrices' fragments.
absl::Status PackGroup(RankRuntime& rt, const JobPlan& jp, int TP,
                       const plan::MicroGroup& group,
                       RankRuntime::GroupBuffers& b) {
  StageCopier& copier = *rt.tp_copier;
  float* send = b.send.data();
  for (int h = 0; h < TP; ++h) {
    for (int i : group.params) {
      if (jp.plan.tp_host[i] != h) continue;
      const int64_t n = jp.params[i].local_numel;
      CANZONA_RETURN_IF_ERROR(copier.Copy(send, rt.gstage.data() + rt.offset[i],
                                          n * sizeof(float)));
      CANZONA_RETURN_IF_ERROR(copier.Copy(
          send + n, rt.pstage.data() + rt.offset[i], n * sizeof(float)));
      send += 2 * n;
    }
  }
  return absl::OkStatus();
}

absl::Status GatherGroup(RankRuntime& rt, const JobPlan& jp, int TP,
                         const plan::MicroGroup& group,
                         RankRuntime::GroupBuffers& b) {
  CANZONA_RETURN_IF_ERROR(PackGroup(rt, jp, TP, group, b));
  return rt.tp->AllToAllV(b.send.data(), b.send_counts, b.recv.data(),
                          b.recv_counts);
}

// On the host rank: assembles each whole matrix (dim 1 fragments interleave
// rows), runs its rule, and packs the updated fragments per rank.
absl::Status ComputeGroup(RankRuntime& rt, const JobPlan& jp, int TP, int t,
                          const plan::MicroGroup& group,
                          const std::map<std::string, float>& lr,
                          RankRuntime::GroupBuffers& b) {
  Backend& staging = *rt.staging;
  int64_t at = 0;  // offset of the parameter in each rank's slice
  for (int i : group.params) {
    if (jp.plan.tp_host[i] != t) continue;
    const ParamMeta& m = jp.params[i];
    const int64_t n = m.local_numel;
    for (int j = 0; j < TP; ++j) {
      float* frag = b.recv.data() + 2 * b.hosted_here * j + 2 * at;
      CANZONA_RETURN_IF_ERROR(
          MoveFragment(staging, m, TP, j, frag, rt.full_g.data(), true));
      CANZONA_RETURN_IF_ERROR(
          MoveFragment(staging, m, TP, j, frag + n, rt.full_p.data(), true));
    }
    StepOptions o;
    auto it = lr.find(m.group);
    if (it != lr.end()) o.lr = it->second;
    CANZONA_RETURN_IF_ERROR(
        StepRule(rt, i, rt.full_p.data(), rt.full_g.data(), o));
    for (int j = 0; j < TP; ++j) {
      CANZONA_RETURN_IF_ERROR(MoveFragment(
          staging, m, TP, j, b.back.data() + b.hosted_here * j + at,
          rt.full_p.data(), false));
    }
    at += n;
  }
  return absl::OkStatus();
}

// Writes the updated fragments the scatter brought back in place (on the
// tp copier).
absl::Status UnpackGroup(RankRuntime& rt, const JobPlan& jp, int TP,
                         const plan::MicroGroup& group,
                         RankRuntime::GroupBuffers& b) {
  StageCopier& copier = *rt.tp_copier;
  const float* in = b.back_in.data();
  for (int h = 0; h < TP; ++h) {
    for (int i : group.params) {
      if (jp.plan.tp_host[i] != h) continue;
      const int64_t n = jp.params[i].local_numel;
      CANZONA_RETURN_IF_ERROR(
          copier.Copy(rt.pstage.data() + rt.offset[i], in, n * sizeof(float)));
      in += n;
    }
  }
  return absl::OkStatus();
}

// Returns the updated fragments to their ranks and writes them in place.
absl::Status ScatterGroup(RankRuntime& rt, const JobPlan& jp, int TP,
                          const plan::MicroGroup& group,
                          RankRuntime::GroupBuffers& b) {
  CANZONA_RETURN_IF_ERROR(rt.tp->AllToAllV(b.back.data(), b.back_send,
                                           b.back_in.data(), b.back_recv));
  CANZONA_RETURN_IF_ERROR(UnpackGroup(rt, jp, TP, group, b));
  return rt.tp_copier->Finish();
}

// The NCCL data plane's micro-group pipeline on one thread: every gather,
// compute and scatter is enqueued in pipeline order (G0 G1 C0 S0 G2 C1 S1
// ...) on two streams, the tp stream (packing copies, all-to-alls,
// unpacking) and the compute stream, which order each other with events:
// compute i waits for gather i, scatter i for compute i, the first gather
// for the local updates. The host waits once, at the end. (Where the
// compute backend has no stream, e.g. the cpu backend over a fake NCCL in
// tests, it waits for the gather's event on the host instead.)
absl::Status RunMicroGroupsOnStreams(RankRuntime& rt, const JobPlan& jp, int TP,
                                     int t,
                                     const std::map<std::string, float>& lr,
                                     absl::Duration timeout,
                                     v1::PhaseTimes* times) {
  NcclApi& api = *rt.nccl_api;
  NcclCommunicator& tp = *rt.tp_nccl;
  StageCopier& copier = *rt.tp_copier;
  const int n = static_cast<int>(rt.groups.size());
  const NcclStream compute =
      static_cast<NcclStream>(rt.backend->native_stream());
  auto gathered = [&](int i) { return rt.events[2 * i]; };
  auto computed = [&](int i) { return rt.events[2 * i + 1]; };
  const NcclEvent local_done = rt.events[2 * n];
  // Work enqueued on the compute stream from here on waits for `event`.
  auto compute_waits = [&](NcclEvent event) -> absl::Status {
    CANZONA_RETURN_IF_ERROR(api.SetDevice(rt.device));
    if (compute != nullptr) return api.StreamWaitEvent(compute, event);
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      CANZONA_ASSIGN_OR_RETURN(bool done, api.EventQuery(event));
      if (done) return absl::OkStatus();
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "TP gather did not complete within ", absl::FormatDuration(timeout),
            " (a peer did not take part)"));
      }
      std::this_thread::yield();
    }
  };
  auto record = [&](NcclEvent event, NcclStream stream) -> absl::Status {
    CANZONA_RETURN_IF_ERROR(api.SetDevice(rt.device));
    return api.EventRecord(event, stream);
  };
  auto all_to_all = [&](const float* send, absl::Span<const int64_t> sc,
                        float* recv,
                        absl::Span<const int64_t> rc) -> absl::Status {
    CANZONA_RETURN_IF_ERROR(tp.EnqueueAllToAll(send, sc, recv, rc));
    if (rt.tp_counting != nullptr) rt.tp_counting->CountAllToAll(sc);
    return absl::OkStatus();
  };
  auto gather = [&](int i) -> absl::Status {
    RankRuntime::GroupBuffers& b = rt.group_buffers[i];
    CANZONA_RETURN_IF_ERROR(PackGroup(rt, jp, TP, *rt.groups[i], b));
    CANZONA_RETURN_IF_ERROR(
        all_to_all(b.send.data(), b.send_counts, b.recv.data(), b.recv_counts));
    return record(gathered(i), tp.stream());
  };
  auto scatter = [&](int i) -> absl::Status {
    RankRuntime::GroupBuffers& b = rt.group_buffers[i];
    CANZONA_RETURN_IF_ERROR(copier.WaitEvent(computed(i)));
    CANZONA_RETURN_IF_ERROR(
        all_to_all(b.back.data(), b.back_send, b.back_in.data(), b.back_recv));
    return UnpackGroup(rt, jp, TP, *rt.groups[i], b);
  };
  auto compute_group = [&](int i) -> absl::Status {
    CANZONA_RETURN_IF_ERROR(compute_waits(gathered(i)));
    CANZONA_RETURN_IF_ERROR(
        ComputeGroup(rt, jp, TP, t, *rt.groups[i], lr, rt.group_buffers[i]));
    return record(computed(i), compute);
  };

  const absl::Time start = absl::Now();
  CANZONA_RETURN_IF_ERROR(record(local_done, compute));
  CANZONA_RETURN_IF_ERROR(copier.WaitEvent(local_done));
  CANZONA_RETURN_IF_ERROR(gather(0));
  for (int i = 0; i < n; ++i) {
    if (i + 1 < n) CANZONA_RETURN_IF_ERROR(gather(i + 1));
    CANZONA_RETURN_IF_ERROR(compute_group(i));
    CANZONA_RETURN_IF_ERROR(scatter(i));
  }
  const absl::Time enqueued = absl::Now();
  // The tp stream ends with the last unpack, after every compute.
  CANZONA_RETURN_IF_ERROR(tp.Flush());
  // Host-side times: the enqueueing (compute includes the waits inside the
  // rules), then the wait for both streams to drain. Device-side overlap is
  // not measured here, so canzona_tp_overlap_ratio reads 0.
  times->set_tp_compute(times->tp_compute() + Seconds(start, enqueued));
  times->set_tp_scatter(times->tp_scatter() + Seconds(enqueued, absl::Now()));
  rt.tp_comm_s = rt.tp_hidden_s = 0;
  return absl::OkStatus();
}

}  // namespace

absl::Status EngineImpl::RunMicroGroups(Job& job, LocalRank& rank,
                                        const JobPlan& jp,
                                        const std::map<std::string, float>& lr,
                                        v1::PhaseTimes* times) {
  RankRuntime& rt = *rank.rt;
  const int TP = job.layout.tp(), t = rank.coords.tp_rank();
  const int n = static_cast<int>(rt.groups.size());
  if (n == 0) return absl::OkStatus();
  if (rt.tp_nccl != nullptr) {
    return RunMicroGroupsOnStreams(rt, jp, TP, t, lr, options_.step_timeout,
                                   times);
  }
  // The gathers read what the worker's local updates wrote.
  CANZONA_RETURN_IF_ERROR(rt.staging->Synchronize());
  double gather_s = 0, compute_s = 0, scatter_s = 0;
  auto gather = [&](int i) {
    const absl::Time t0 = absl::Now();
    absl::Status s =
        GatherGroup(rt, jp, TP, *rt.groups[i], rt.group_buffers[i]);
    gather_s += Seconds(t0, absl::Now());
    return s;
  };
  auto scatter = [&](int i) {
    const absl::Time t0 = absl::Now();
    absl::Status s =
        ScatterGroup(rt, jp, TP, *rt.groups[i], rt.group_buffers[i]);
    scatter_s += Seconds(t0, absl::Now());
    return s;
  };
  auto compute = [&](int i) {
    const absl::Time t0 = absl::Now();
    absl::Status s =
        ComputeGroup(rt, jp, TP, t, *rt.groups[i], lr, rt.group_buffers[i]);
    // The scatter (another thread, another stream) reads b.back.
    if (s.ok()) s = rt.staging->Synchronize();
    compute_s += Seconds(t0, absl::Now());
    return s;
  };
  const absl::Time pipeline_start = absl::Now();
  auto publish = [&]() {
    times->set_tp_gather(times->tp_gather() + gather_s);
    times->set_tp_compute(times->tp_compute() + compute_s);
    times->set_tp_scatter(times->tp_scatter() + scatter_s);
    // Comm hidden behind compute: what the serial sum exceeds the wall
    // time by (0 for one group: nothing overlaps).
    const double wall = Seconds(pipeline_start, absl::Now());
    rt.tp_comm_s = gather_s + scatter_s;
    rt.tp_hidden_s =
        std::clamp(gather_s + scatter_s + compute_s - wall, 0.0, rt.tp_comm_s);
  };
  if (n == 1) {
    CANZONA_RETURN_IF_ERROR(gather(0));
    CANZONA_RETURN_IF_ERROR(compute(0));
    CANZONA_RETURN_IF_ERROR(scatter(0));
    publish();
    return absl::OkStatus();
  }

  // Two-deep pipeline: the comm thread issues G0, G1, S0, G2, S1, ...,
  // G(n-1), S(n-2), S(n-1) on the TP communicator (the same order on every
  // TP rank, and only this thread touches it meanwhile), so the gather of
  // group i+1 and the scatter of group i-1 overlap the compute of group i.
  absl::Mutex mu;
  absl::CondVar cv;
  int gathered = 0, computed = 0;
  absl::Status error;
  std::thread comm([&] {
    auto fail = [&](absl::Status s) {
      absl::MutexLock lock(&mu);
      if (error.ok()) error = std::move(s);
      gathered = n;  // releases the worker
      cv.SignalAll();
    };
    auto wait_computed = [&](int k) {
      absl::MutexLock lock(&mu);
      while (computed < k && error.ok()) cv.Wait(&mu);
      return error.ok();
    };
    for (int i = 0; i < n; ++i) {
      if (absl::Status s = gather(i); !s.ok()) return fail(std::move(s));
      {
        absl::MutexLock lock(&mu);
        gathered = i + 1;
        cv.SignalAll();
      }
      if (i >= 1) {
        if (!wait_computed(i)) return;
        if (absl::Status s = scatter(i - 1); !s.ok()) return fail(std::move(s));
      }
    }
    if (!wait_computed(n)) return;
    if (absl::Status s = scatter(n - 1); !s.ok()) return fail(std::move(s));
  });
  for (int i = 0; i < n; ++i) {
    {
      absl::MutexLock lock(&mu);
      while (gathered <= i && error.ok()) cv.Wait(&mu);
      if (!error.ok()) break;
    }
    absl::Status s = compute(i);
    absl::MutexLock lock(&mu);
    if (!s.ok()) {
      if (error.ok()) error = std::move(s);
      cv.SignalAll();
      break;
    }
    computed = i + 1;
    cv.SignalAll();
  }
  comm.join();
  publish();
  return error;
}

// ---------------------------------------------------------------------------
// Overlap with the trainer: bucket events.

void EngineImpl::GradReady(const v1::GradReadyRequest& request,
                           Callback<v1::GradReadyResponse> done) {
  if (shutting_down_) return done(Unavailable());
  auto found = FindReadyRank(request.job_id(), request.rank());
  if (!found.ok()) return done(found.status());
  auto [job, rank] = *std::move(found);
  const int buckets = rank->pipeline->buckets();
  for (int j = 0; j < request.buckets_size(); ++j) {
    const int b = request.buckets(j);
    if (b < 0 || b >= buckets) {
      return done(absl::InvalidArgumentError(absl::StrCat(
          "buckets[", j, "] = ", b, " outside [0, ", buckets, ")")));
    }
  }
  {
    absl::MutexLock lock(&job->mu);
    if (request.step() != rank->next_step) {
      return done(absl::FailedPreconditionError(absl::StrCat(
          "step ", request.step(), ": GradReady must name the next step, ",
          rank->next_step, ", before its Step call")));
    }
    // Under job->mu: ordered with Step's MarkAllReady of the step before.
    rank->pipeline->MarkReady(request.step(), request.buckets());
  }
  done(v1::GradReadyResponse());
}

void EngineImpl::WaitParams(const v1::WaitParamsRequest& request,
                            Callback<v1::WaitParamsResponse> done) {
  if (shutting_down_) return done(Unavailable());
  // Also once the job failed: a peer that finished and deregistered fails
  // the job, but this rank's last all-gathers still complete (the peer
  // lingers) or fail, and the pipeline reports which.
  auto found = FindReadyRank(request.job_id(), request.rank(),
                             /*after_failure=*/true);
  if (!found.ok()) return done(found.status());
  auto [job, rank] = *std::move(found);
  const int buckets = rank->pipeline->buckets();
  if (request.bucket() < -1 || request.bucket() >= buckets) {
    return done(absl::InvalidArgumentError(absl::StrCat(
        "bucket ", request.bucket(), " outside [-1, ", buckets, ")")));
  }
  {
    absl::MutexLock lock(&job->mu);
    if (request.step() < 1 || request.step() >= rank->next_step) {
      return done(absl::FailedPreconditionError(
          absl::StrCat("step ", request.step(),
                       ": WaitParams needs a step Step was called "
                       "for (the last is ",
                       rank->next_step - 1, ")")));
    }
  }
  // The pipeline calls back from its thread (or at once); nothing here
  // holds the rank, so the last reference never dies on that thread.
  rank->pipeline->WhenGathered(
      request.step(), request.bucket(),
      [done = std::move(done)](absl::Status status, double waited) {
        if (!status.ok()) return done(status);
        v1::WaitParamsResponse response;
        response.set_waited_seconds(waited);
        done(response);
      });
}

// ---------------------------------------------------------------------------
// Queries and teardown.

absl::StatusOr<v1::GetPlanResponse> EngineImpl::GetPlan(
    const v1::GetPlanRequest& request) {
  absl::StatusOr<std::shared_ptr<Job>> found = FindJob(request.job_id());
  if (!found.ok()) {
    absl::MutexLock lock(&mu_);
    for (const auto& failed : failed_jobs_) {
      if (failed->id == request.job_id()) found = failed;
    }
  }
  CANZONA_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, std::move(found));
  std::shared_ptr<const JobPlan> jp;
  {
    absl::MutexLock lock(&job->mu);
    jp = job->plan;
  }
  if (!jp) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job->id, "' has no plan yet: ranks are registering"));
  }
  v1::GetPlanResponse response;
  response.set_plan_json(plan::PlanToJson(jp->plan, true).dump());
  response.set_digest(jp->plan.digest);
  return response;
}

absl::Status EngineImpl::Deregister(const v1::DeregisterRequest& request) {
  if (shutting_down_) return Unavailable();
  CANZONA_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(request.job_id()));
  const v1::RankCoordinates& r = request.rank();
  const v1::WorldLayout& l = job->layout;
  if (request.job_token() != job->token) {
    return absl::UnauthenticatedError(
        absl::StrCat("job_token does not match job '", job->id, "'"));
  }
  const bool inside = r.pp_rank() >= 0 && r.pp_rank() < l.pp() &&
                      r.dp_rank() >= 0 && r.dp_rank() < l.dp() &&
                      r.tp_rank() >= 0 && r.tp_rank() < l.tp();
  const int global =
      inside ? (r.pp_rank() * l.dp() + r.dp_rank()) * l.tp() + r.tp_rank() : -1;
  if (!inside ||
      !RemoveLocalRank(job, global,
                       absl::StrCat("rank ", RankString(r), " deregistered"),
                       /*graceful=*/true)) {
    return absl::NotFoundError(absl::StrCat("rank ", RankString(r), " of job '",
                                            job->id,
                                            "' is not registered with this "
                                            "daemon"));
  }
  return absl::OkStatus();
}

bool EngineImpl::RemoveLocalRank(const std::shared_ptr<Job>& job, int global,
                                 const std::string& reason, bool graceful) {
  std::shared_ptr<LocalRank> rank;
  Callback<v1::RegisterResponse> pending;
  {
    absl::MutexLock lock(&mu_);
    absl::MutexLock job_lock(&job->mu);
    auto rit = job->ranks.find(global);
    if (rit == job->ranks.end()) return false;
    rank = rit->second;
    // Only between steps, on a set-up rank: a step in flight fails now.
    graceful = graceful && rank->setup_done && rank->rt != nullptr &&
               rank->steps_done + 1 == rank->next_step;
    job->ranks.erase(rit);
    job->mapped_bytes -= rank->mapped_bytes;
    pending = std::move(rank->register_done);
    rank->register_done = nullptr;
    if (job->state != JobState::kFailed) {
      // The job cannot step without this rank any more; failing it also
      // ends a registration still waiting on the control plane.
      job->state = JobState::kFailed;
      job->failure = reason;
      job->cv.SignalAll();
    }
    auto jit = jobs_.find(job->id);
    if (job->ranks.empty() && jit != jobs_.end() && jit->second == job) {
      jobs_.erase(jit);
      if (!absl::EndsWith(job->failure, " deregistered")) {
        failed_jobs_.push_back(job);
        if (failed_jobs_.size() > 16) failed_jobs_.pop_front();
      }
    }
  }
  spdlog::info("rank removed: job={} rank={} daemon={}: {}", job->id,
               RankString(rank->coords), options_.daemon_id, reason);
  if (graceful) {
    // The worker is idle between steps; the communication thread finishes
    // what it has queued (the last all-gathers) while the rank lingers.
    if (rank->worker) rank->worker->StopAndJoin();
    CancelAfterStep(*job, *rank);
    rank->rt->rules.clear();
    if (pending) pending(absl::AbortedError(reason));
    // Long enough for peers to drain what was already sent to them (at
    // most a few socket buffers) and for the queued all-gathers; short
    // enough that peers stepping on without this rank fail soon.
    const absl::Duration linger =
        std::min(options_.step_timeout, absl::Seconds(5));
    absl::MutexLock lock(&mu_);
    lingering_.emplace_back(absl::Now() + linger, std::move(rank));
    return true;
  }
  // Unblocks a step still running on the rank, then joins its worker (which
  // cancels its queued calls) and unmaps its buffers when `rank` goes.
  rank->AbortComms();
  rank->FailPipeline(absl::AbortedError(reason));
  if (rank->worker) rank->worker->StopAndJoin();
  CancelAfterStep(*job, *rank);
  if (pending) pending(absl::AbortedError(reason));
  return true;
}

void EngineImpl::WatchTrainers() {
  constexpr absl::Duration kPeriod = absl::Milliseconds(200);
  while (true) {
    // The rank pointer keeps its pidfd open while it is polled.
    std::vector<std::tuple<std::shared_ptr<Job>, int, pid_t, int,
                           std::shared_ptr<LocalRank>>>
        watched;
    std::vector<std::unique_ptr<Worker>> retired;
    std::vector<std::shared_ptr<LocalRank>> expired;
    {
      absl::MutexLock lock(&mu_);
      if (!shutting_down_) watcher_cv_.WaitWithTimeout(&mu_, kPeriod);
      if (shutting_down_) return;
      // Workers of rejected registrations stopped themselves; reap them.
      retired.swap(retired_);
      const absl::Time now = absl::Now();
      for (size_t i = 0; i < lingering_.size();) {
        if (lingering_[i].first <= now) {
          expired.push_back(std::move(lingering_[i].second));
          lingering_[i] = std::move(lingering_.back());
          lingering_.pop_back();
        } else {
          ++i;
        }
      }
      for (auto& [id, job] : jobs_) {
        absl::MutexLock job_lock(&job->mu);
        for (auto& [g, r] : job->ranks) {
          if (r->trainer_pid.has_value()) {
            watched.emplace_back(job, g, *r->trainer_pid, r->trainer_pidfd, r);
          }
        }
      }
    }
    for (auto& worker : retired) worker->StopAndJoin();
    for (auto& rank : expired) {
      rank->AbortComms();
      rank->FailPipeline(absl::AbortedError("the rank left"));
    }
    expired.clear();  // joins their communication threads, unmaps buffers
    for (auto& [job, global, pid, pidfd, keep] : watched) {
      bool exited = false;
      if (pidfd >= 0) {
        pollfd fd{pidfd, POLLIN, 0};
        exited = ::poll(&fd, 1, 0) > 0;
      } else {
        exited = ::kill(pid, 0) != 0 && errno == ESRCH;
      }
      if (!exited) continue;
      std::string coords;
      {
        absl::MutexLock lock(&job->mu);
        auto it = job->ranks.find(global);
        if (it == job->ranks.end()) continue;
        coords = RankString(it->second->coords);
      }
      RemoveLocalRank(job, global,
                      absl::StrCat("the trainer of rank ", coords, " (pid ",
                                   pid, ") exited without deregistering"));
    }
  }
}

v1::GetStatusResponse EngineImpl::GetStatus() {
  v1::GetStatusResponse response;
  response.set_version(kVersion);
  response.set_backend(options_.backend);
  response.set_comm(options_.comm);
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, job] : jobs_) jobs.push_back(job);
    for (auto& job : failed_jobs_) jobs.push_back(job);
  }
  for (auto& job : jobs) {
    absl::MutexLock lock(&job->mu);
    v1::JobStatus* js = response.add_jobs();
    js->set_job_id(job->id);
    *js->mutable_layout() = job->layout;
    js->set_strategy(job->strategy_name);
    if (job->plan) js->set_plan_digest(job->plan->plan.digest);
    js->set_state(StateString(*job));
    js->set_registered_ranks(
        job->barrier_passed ? job->world : static_cast<int>(job->ranks.size()));
    for (auto& [g, r] : job->ranks) {
      v1::RankStatus* rs = js->add_local_ranks();
      *rs->mutable_rank() = r->coords;
      rs->set_steps_done(r->steps_done);
      *rs->mutable_last_step_seconds() = r->last;
    }
  }
  return response;
}

// ---------------------------------------------------------------------------
// Checkpoints and state export / import.

namespace {

// How rank `rt` takes part in saving parameter i.
enum class Holding {
  kNone,      // no state here
  kWhole,     // the whole matrix's state (or a TP-replicated copy)
  kFragment,  // this TP rank's fragment of element-wise state
};

Holding HoldingOf(const RankRuntime& rt, const JobPlan& jp, int TP, int i) {
  if (!rt.dp_owned[i] || !rt.rules.count(i)) return Holding::kNone;
  const ParamMeta& m = jp.params[i];
  if (rt.mode[i] == Mode::kLocal && m.split >= 0 && TP > 1) {
    return Holding::kFragment;
  }
  return Holding::kWhole;
}

// Whether this rank writes parameter i's record: one writer per parameter
// in the whole job (the DP owner, or DP rank 0 when every rank owns it;
// the TP host, or TP rank 0 for replicated and gathered state).
bool WritesRecord(const RankRuntime& rt, const plan::Plan& plan, int d, int t,
                  int i) {
  if (plan.dp_owner[i] < 0 && d != 0) return false;
  // Hierarchical sharding: the other shard groups hold replicas.
  if (rt.shard_group != 0) return false;
  return rt.mode[i] == Mode::kHosted || t == 0;
}

// Tensors of `state` that are TP fragments of `m` (shape == local shape,
// which differs from the whole shape when TP splits it).
bool IsFragmentTensor(const ParamMeta& m, const StateTensor& tensor) {
  return tensor.shape == m.local_shape && m.local_shape != m.shape;
}

// An agreement value through the control plane: "<code>\n<text>".
std::string AgreementValue(const absl::Status& status,
                           absl::string_view payload) {
  return absl::StrCat(static_cast<int>(status.code()), "\n",
                      status.ok() ? payload : status.message());
}

absl::Status ParseAgreement(absl::string_view value, std::string* payload) {
  const size_t nl = value.find('\n');
  int code = 0;
  if (nl == absl::string_view::npos ||
      !absl::SimpleAtoi(value.substr(0, nl), &code)) {
    return absl::InternalError(
        absl::StrCat("bad agreement value '", value, "' on the control plane"));
  }
  if (payload != nullptr) *payload = std::string(value.substr(nl + 1));
  return absl::Status(static_cast<absl::StatusCode>(code),
                      value.substr(nl + 1));
}

// The TP all-gather of host data (checkpoints, not the step): through
// staging buffers allocated for the call when staging is device memory.
absl::Status HostAllGather(RankRuntime& rt, const float* send,
                           absl::Span<const int64_t> counts, float* recv) {
  if (!rt.resident()) return rt.tp->AllGatherV(send, counts, recv);
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  const int64_t mine = counts[rt.tp->rank()];
  Backend& staging = *rt.staging;
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer in, staging.Allocate(mine));
  CANZONA_ASSIGN_OR_RETURN(DeviceBuffer out, staging.Allocate(total));
  CANZONA_RETURN_IF_ERROR(staging.CopyFromHost(send, mine, in.data()));
  CANZONA_RETURN_IF_ERROR(staging.Synchronize());
  CANZONA_RETURN_IF_ERROR(rt.tp->AllGatherV(in.data(), counts, out.data()));
  return staging.CopyToHost(out.data(), total, recv);
}

// Puts back the states saved before a load that is being undone.
void Restore(RankRuntime& rt,
             std::vector<std::pair<int, OptimizerState>>& backups) {
  for (auto& [i, state] : backups) {
    absl::Status s = rt.rules.at(i)->LoadState(state);
    if (!s.ok()) {
      spdlog::error("restoring the state of parameter {} failed: {}", i,
                    s.ToString());
    }
  }
}

}  // namespace

absl::StatusOr<std::pair<std::shared_ptr<Job>, std::shared_ptr<LocalRank>>>
EngineImpl::FindReadyRank(const std::string& job_id,
                          const v1::RankCoordinates& r, bool after_failure) {
  CANZONA_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  const v1::WorldLayout& l = job->layout;
  if (r.pp_rank() < 0 || r.pp_rank() >= l.pp() || r.dp_rank() < 0 ||
      r.dp_rank() >= l.dp() || r.tp_rank() < 0 || r.tp_rank() >= l.tp()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", RankString(r), " outside the layout"));
  }
  const int global =
      (r.pp_rank() * l.dp() + r.dp_rank()) * l.tp() + r.tp_rank();
  absl::MutexLock lock(&job->mu);
  auto it = job->ranks.find(global);
  const bool whole = it != job->ranks.end() && it->second->setup_done &&
                     it->second->steps_done + 1 == it->second->next_step;
  if (job->state == JobState::kFailed && !(after_failure && whole)) {
    return absl::FailedPreconditionError(
        absl::StrCat("job failed: ", job->failure));
  }
  if (job->state == JobState::kRegistering) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job->id, "' is not ready: ranks are still registering"));
  }
  if (it == job->ranks.end()) {
    return absl::NotFoundError(
        absl::StrCat("rank ", RankString(r), " of job '", job->id,
                     "' is not registered with this daemon"));
  }
  return std::make_pair(job, it->second);
}

template <typename Response>
void EngineImpl::RunOnRank(
    const std::string& job_id, const v1::RankCoordinates& coords,
    Callback<Response> done,
    std::function<absl::StatusOr<Response>(Job&, LocalRank&)> work,
    int64_t at_step, bool after_failure) {
  if (shutting_down_) return done(Unavailable());
  auto found = FindReadyRank(job_id, coords, after_failure);
  if (!found.ok()) return done(found.status());
  auto [job, rank] = *std::move(found);
  auto shared_done = std::make_shared<Callback<Response>>(std::move(done));
  Worker::Task task;
  task.run = [this, job = job, rank = rank, work = std::move(work),
              shared_done]() {
    // The last step's background all-gathers finish first: checkpoints
    // and imports must not race the communication thread.
    rank->pipeline->WaitIdle();
    absl::StatusOr<Response> result = work(*job, *rank);
    if (!result.ok() && shutting_down_) result = Unavailable();
    (*shared_done)(std::move(result));
  };
  task.cancel = [this, shared_done]() { (*shared_done)(Unavailable()); };
  if (at_step > 0) {
    absl::Status past;
    {
      absl::MutexLock lock(&job->mu);
      if (rank->next_step > at_step + 1) {
        past = absl::FailedPreconditionError(absl::StrCat(
            "at_step ", at_step, ": rank ", RankString(rank->coords),
            " is already past it (step ", rank->next_step - 1, " was called)"));
      } else if (rank->steps_done < at_step) {
        rank->after_step[at_step].push_back(std::move(task));
        return;
      }
    }
    if (!past.ok()) return (*shared_done)(past);
  }
  if (!rank->worker->Post(task)) task.cancel();
}

void EngineImpl::RunAfterStep(Job& job, LocalRank& rank, int64_t k) {
  std::vector<Worker::Task> tasks;
  {
    absl::MutexLock lock(&job.mu);
    // After a failed step (k < 0) everything waiting runs now and fails on
    // the failed job instead of waiting forever.
    auto end = k < 0 ? rank.after_step.end() : rank.after_step.upper_bound(k);
    for (auto it = rank.after_step.begin(); it != end; ++it) {
      for (Worker::Task& task : it->second) tasks.push_back(std::move(task));
    }
    rank.after_step.erase(rank.after_step.begin(), end);
  }
  for (Worker::Task& task : tasks) task.run();
}

absl::StatusOr<std::string> EngineImpl::CheckpointDir(
    const std::string& dir) const {
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("dir '", dir, "' must be an absolute path"));
  }
  for (const auto& part : std::filesystem::path(dir)) {
    if (part == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("dir '", dir, "' must not contain '..'"));
    }
  }
  std::string normal = std::filesystem::path(dir).lexically_normal().string();
  while (normal.size() > 1 && normal.back() == '/') normal.pop_back();
  if (!options_.checkpoint_root.empty()) {
    std::string root = std::filesystem::path(options_.checkpoint_root)
                           .lexically_normal()
                           .string();
    while (root.size() > 1 && root.back() == '/') root.pop_back();
    if (normal != root && !absl::StartsWith(normal, root + "/")) {
      return absl::PermissionDeniedError(
          absl::StrCat("dir '", dir,
                       "' is outside this daemon's checkpoint "
                       "root ",
                       root, " (--checkpoint-root)"));
    }
  }
  return normal;
}

absl::Status EngineImpl::Agree(
    Job& job, const LocalRank& rank, const std::string& key,
    const absl::Status& local, const std::string& payload, absl::Time deadline,
    const std::function<absl::Status(const std::vector<std::string>&)>&
        decide) {
  const std::string mine = AgreementValue(local, payload);
  const std::string result_key = key + "result";
  CANZONA_RETURN_IF_ERROR(
      options_.control->Set(absl::StrCat(key, rank.global), mine));
  if (rank.global != 0) {
    CANZONA_ASSIGN_OR_RETURN(
        std::string result,
        WaitGet(job, result_key, deadline, "the checkpoint decision"));
    return ParseAgreement(result, nullptr);
  }
  absl::Status decision;
  std::vector<std::string> payloads(job.world);
  for (int g = 0; g < job.world && decision.ok(); ++g) {
    absl::StatusOr<std::string> value =
        g == rank.global
            ? mine
            : WaitGet(job, absl::StrCat(key, g), deadline,
                      absl::StrCat("rank ", g, " of the checkpoint"));
    if (!value.ok()) {
      decision = value.status();
      break;
    }
    absl::Status theirs = ParseAgreement(*value, &payloads[g]);
    if (!theirs.ok()) {
      decision = absl::Status(theirs.code(),
                              absl::StrCat("rank ", g, ": ", theirs.message()));
    }
  }
  if (decision.ok()) decision = decide(payloads);
  // Published even when it failed: the other ranks wait for it.
  absl::Status published =
      options_.control->Set(result_key, AgreementValue(decision, ""));
  return decision.ok() ? published : decision;
}

void EngineImpl::SaveCheckpoint(const v1::SaveCheckpointRequest& request,
                                Callback<v1::SaveCheckpointResponse> done) {
  absl::StatusOr<std::string> dir = CheckpointDir(request.dir());
  if (!dir.ok()) return done(dir.status());
  if (request.at_step() < 0) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("at_step ", request.at_step(), " must be >= 0")));
  }
  RunOnRank<v1::SaveCheckpointResponse>(
      request.job_id(), request.rank(), std::move(done),
      [this, dir = *dir](Job& job, LocalRank& rank) {
        return RunSave(job, rank, dir);
      },
      request.at_step());
}

void EngineImpl::LoadCheckpoint(const v1::LoadCheckpointRequest& request,
                                Callback<v1::LoadCheckpointResponse> done) {
  absl::StatusOr<std::string> dir = CheckpointDir(request.dir());
  if (!dir.ok()) return done(dir.status());
  RunOnRank<v1::LoadCheckpointResponse>(
      request.job_id(), request.rank(), std::move(done),
      [this, dir = *dir](Job& job, LocalRank& rank) {
        return RunLoad(job, rank, dir);
      });
}

absl::StatusOr<v1::SaveCheckpointResponse> EngineImpl::RunSave(
    Job& job, LocalRank& rank, const std::string& dir) {
  if (job.failed()) {
    absl::MutexLock lock(&job.mu);
    return absl::AbortedError(absl::StrCat("job failed: ", job.failure));
  }
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options_.checkpoint_timeout;
  RankRuntime& rt = *rank.rt;
  std::shared_ptr<const JobPlan> jp;
  int64_t steps = 0;
  {
    absl::MutexLock lock(&job.mu);
    jp = job.plan;
    steps = rank.steps_done;
  }
  const int TP = job.layout.tp(), d = rank.coords.dp_rank(),
            t = rank.coords.tp_rank();
  const std::string key =
      absl::StrCat(JobPrefix(job.id), "ckpt/", rank.collective_seq++, "/save/");

  // 1. This rank's shard. TP fragments are gathered even after a local
  // error so that the TP group's collectives stay matched.
  absl::Status local;
  std::unique_ptr<CheckpointWriter> writer;
  {
    auto created = CheckpointWriter::Create(dir, std::to_string(rank.global));
    if (created.ok()) {
      writer = *std::move(created);
    } else {
      local = created.status();
    }
  }
  int records = 0;
  std::vector<float> gathered, whole;
  for (int i : rt.local_params) {
    const Holding holding = HoldingOf(rt, *jp, TP, i);
    if (holding == Holding::kNone) continue;
    const ParamMeta& m = jp->params[i];
    const bool writes = WritesRecord(rt, jp->plan, d, t, i);
    if (holding == Holding::kWhole && !writes) continue;
    const UpdateRule& rule = *rt.rules.at(i);
    absl::StatusOr<OptimizerState> state = rule.SaveState();
    if (!state.ok()) return state.status();  // a bug: fail loudly
    if (holding == Holding::kFragment) {
      const std::vector<int64_t> counts(TP, m.local_numel);
      for (StateTensor& tensor : state->tensors) {
        if (!IsFragmentTensor(m, tensor)) continue;
        gathered.resize(TP * m.local_numel);
        CANZONA_RETURN_IF_ERROR(
            HostAllGather(rt, tensor.data.data(), counts, gathered.data()));
        whole.assign(m.numel, 0.0f);
        for (int j = 0; j < TP; ++j) {
          CANZONA_RETURN_IF_ERROR(
              MoveFragment(*rt.host, m, TP, j,
                           gathered.data() + j * m.local_numel, whole.data(),
                           /*to_full=*/true));
        }
        tensor.shape = m.shape;
        tensor.data = whole;
      }
      if (!writes) continue;
    }
    if (local.ok()) {
      local = writer->Add(m.name, rule.config(), *state);
      ++records;
    }
  }
  ShardInfo shard;
  if (local.ok()) {
    absl::StatusOr<ShardInfo> finished = writer->Finish();
    if (finished.ok()) {
      shard = *std::move(finished);
    } else {
      local = finished.status();
    }
  }
  writer.reset();

  // 2. Every rank's shard reaches global rank 0, which commits the
  // manifest only if every rank wrote its shard at the same step.
  nlohmann::json mine = {{"step", steps},
                         {"file", shard.file},
                         {"bytes", shard.bytes},
                         {"crc32c", shard.crc32c},
                         {"params", shard.params}};
  const absl::Status decision = Agree(
      job, rank, key, local, mine.dump(), deadline,
      [&](const std::vector<std::string>& payloads) -> absl::Status {
        CheckpointManifest manifest;
        manifest.layout = {job.layout.pp(), job.layout.dp(), job.layout.tp()};
        manifest.strategy = job.strategy_name;
        manifest.plan_digest = jp->plan.digest;
        manifest.step = steps;
        for (int g = 0; g < job.world; ++g) {
          const nlohmann::json j =
              nlohmann::json::parse(payloads[g], nullptr, false);
          if (j.is_discarded() || j.value("step", int64_t{-1}) != steps) {
            return absl::FailedPreconditionError(absl::StrCat(
                "ranks saved at different steps: rank 0 has done ", steps,
                " steps, rank ", g, " ",
                j.is_discarded() ? "?" : std::to_string(j.value("step", -1))));
          }
          ShardInfo info;
          info.file = j.value("file", "");
          info.bytes = j.value("bytes", uint64_t{0});
          info.crc32c = j.value("crc32c", uint32_t{0});
          info.params = j.value("params", std::vector<std::string>());
          manifest.shards.push_back(std::move(info));
        }
        return CommitCheckpoint(dir, manifest);
      });
  if (!local.ok()) return local;
  if (!decision.ok()) {
    return absl::Status(decision.code(),
                        absl::StrCat("checkpoint ", dir,
                                     " not committed: ", decision.message()));
  }
  spdlog::info("checkpoint saved: job={} rank={} dir={} step={} records={}",
               job.id, RankString(rank.coords), dir, steps, records);
  v1::SaveCheckpointResponse response;
  response.set_step(steps);
  response.set_records(records);
  response.set_bytes(static_cast<int64_t>(shard.bytes));
  response.set_seconds(Seconds(start, absl::Now()));
  return response;
}

absl::StatusOr<v1::LoadCheckpointResponse> EngineImpl::RunLoad(
    Job& job, LocalRank& rank, const std::string& dir) {
  if (job.failed()) {
    absl::MutexLock lock(&job.mu);
    return absl::AbortedError(absl::StrCat("job failed: ", job.failure));
  }
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options_.checkpoint_timeout;
  RankRuntime& rt = *rank.rt;
  std::shared_ptr<const JobPlan> jp;
  {
    absl::MutexLock lock(&job.mu);
    jp = job.plan;
  }
  const int TP = job.layout.tp(), t = rank.coords.tp_rank();
  const std::string key =
      absl::StrCat(JobPrefix(job.id), "ckpt/", rank.collective_seq++, "/load/");

  // 1. Validate the whole checkpoint and load what this rank owns, keeping
  // the old state to undo it if any rank fails.
  std::vector<std::pair<int, OptimizerState>> backups;
  int64_t step = 0;
  absl::Status local = [&]() -> absl::Status {
    CANZONA_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                             CheckpointReader::Open(dir));
    step = reader->manifest().step;
    for (int i : rt.local_params) {
      if (HoldingOf(rt, *jp, TP, i) == Holding::kNone) continue;
      const ParamMeta& m = jp->params[i];
      UpdateRule& rule = *rt.rules.at(i);
      absl::StatusOr<CheckpointRecord> record = reader->Load(m.name);
      if (absl::IsNotFound(record.status())) {
        return absl::NotFoundError(absl::StrCat(
            "checkpoint ", dir, " has no state for parameter '", m.name, "'"));
      }
      CANZONA_RETURN_IF_ERROR(record.status());
      if (record->config.kind != rule.config().kind) {
        return absl::FailedPreconditionError(absl::StrCat(
            "parameter '", m.name, "': checkpoint ", dir, " holds ",
            OptimizerKindName(record->config.kind), " state, this job uses ",
            OptimizerKindName(rule.config().kind)));
      }
      CANZONA_ASSIGN_OR_RETURN(OptimizerState current, rule.SaveState());
      OptimizerState& next = record->state;
      for (StateTensor& tensor : next.tensors) {
        const StateTensor* mine = current.FindTensor(tensor.name);
        if (mine == nullptr || !IsFragmentTensor(m, *mine) ||
            tensor.shape != m.shape) {
          continue;
        }
        std::vector<float> fragment(m.local_numel);
        CANZONA_RETURN_IF_ERROR(MoveFragment(
            *rt.host, m, TP, t, fragment.data(), tensor.data.data(),
            /*to_full=*/false));
        tensor.shape = m.local_shape;
        tensor.data = std::move(fragment);
      }
      absl::Status loaded = rule.LoadState(next);
      if (!loaded.ok()) {
        return absl::Status(loaded.code(),
                            absl::StrCat("parameter '", m.name, "' from ", dir,
                                         ": ", loaded.message()));
      }
      backups.emplace_back(i, std::move(current));
    }
    return absl::OkStatus();
  }();

  // 2. All or nothing across the job.
  const absl::Status decision =
      Agree(job, rank, key, local, "", deadline,
            [](const std::vector<std::string>&) { return absl::OkStatus(); });
  if (!local.ok() || !decision.ok()) {
    Restore(rt, backups);
    if (!local.ok()) return local;
    return absl::Status(
        decision.code(),
        absl::StrCat("checkpoint ", dir, " not loaded: ", decision.message()));
  }
  {
    absl::MutexLock lock(&job.mu);
    rank.steps_done = step;
    rank.next_step = step + 1;
    rank.pipeline->Reset(step);
  }
  spdlog::info("checkpoint loaded: job={} rank={} dir={} step={} records={}",
               job.id, RankString(rank.coords), dir, step, backups.size());
  v1::LoadCheckpointResponse response;
  response.set_step(step);
  response.set_records(static_cast<int>(backups.size()));
  response.set_seconds(Seconds(start, absl::Now()));
  return response;
}

void EngineImpl::ExportState(const v1::ExportStateRequest& request,
                             Callback<v1::ExportStateResponse> done) {
  RunOnRank<v1::ExportStateResponse>(
      request.job_id(), request.rank(), std::move(done),
      [](Job& job, LocalRank& rank) -> absl::StatusOr<v1::ExportStateResponse> {
        RankRuntime& rt = *rank.rt;
        std::shared_ptr<const JobPlan> jp;
        v1::ExportStateResponse response;
        {
          absl::MutexLock lock(&job.mu);
          jp = job.plan;
          response.set_step(rank.steps_done);
        }
        std::vector<CheckpointRecord> records;
        for (const auto& [i, rule] : rt.rules) {
          CANZONA_ASSIGN_OR_RETURN(OptimizerState state, rule->SaveState());
          records.push_back(
              {jp->params[i].name, rule->config(), std::move(state)});
        }
        CANZONA_ASSIGN_OR_RETURN(std::string blob, EncodeStateBlob(records));
        response.set_state(std::move(blob));
        response.set_plan_digest(jp->plan.digest);
        response.set_records(static_cast<int>(records.size()));
        return response;
      },
      /*at_step=*/0, /*after_failure=*/true);
}

void EngineImpl::ImportState(const v1::ImportStateRequest& request,
                             Callback<v1::ImportStateResponse> done) {
  if (request.step() < 0) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("step ", request.step(), " must be >= 0")));
  }
  RunOnRank<v1::ImportStateResponse>(
      request.job_id(), request.rank(), std::move(done),
      [request](Job& job,
                LocalRank& rank) -> absl::StatusOr<v1::ImportStateResponse> {
        RankRuntime& rt = *rank.rt;
        std::shared_ptr<const JobPlan> jp;
        {
          absl::MutexLock lock(&job.mu);
          jp = job.plan;
        }
        if (request.plan_digest() != jp->plan.digest) {
          return absl::FailedPreconditionError(absl::StrCat(
              "plan_digest: the state was exported under plan ",
              request.plan_digest(), ", this job's plan is ", jp->plan.digest,
              " (load a checkpoint to change layout or strategy)"));
        }
        CANZONA_ASSIGN_OR_RETURN(std::vector<CheckpointRecord> records,
                                 DecodeStateBlob(request.state()));
        std::map<std::string, const CheckpointRecord*> by_name;
        for (const CheckpointRecord& r : records) by_name[r.name] = &r;
        std::set<std::string> expected;
        for (const auto& [i, rule] : rt.rules) {
          const std::string& name = jp->params[i].name;
          expected.insert(name);
          if (!by_name.count(name)) {
            return absl::NotFoundError(
                absl::StrCat("state: no record for parameter '", name,
                             "', which this rank owns"));
          }
        }
        for (const auto& [name, r] : by_name) {
          if (!expected.count(name)) {
            return absl::InvalidArgumentError(absl::StrCat(
                "state: parameter '", name, "' is not owned by this rank"));
          }
        }
        std::vector<std::pair<int, OptimizerState>> backups;
        // (No structured bindings here: clang 14 cannot capture them.)
        for (const auto& entry : rt.rules) {
          const int i = entry.first;
          UpdateRule* rule = entry.second.get();
          const CheckpointRecord& r = *by_name.at(jp->params[i].name);
          absl::Status status = [&]() -> absl::Status {
            if (r.config.kind != rule->config().kind) {
              return absl::FailedPreconditionError(absl::StrCat(
                  "state: parameter '", r.name, "' holds ",
                  OptimizerKindName(r.config.kind), " state, this job uses ",
                  OptimizerKindName(rule->config().kind)));
            }
            CANZONA_ASSIGN_OR_RETURN(OptimizerState current, rule->SaveState());
            absl::Status loaded = rule->LoadState(r.state);
            if (!loaded.ok()) {
              return absl::Status(loaded.code(),
                                  absl::StrCat("state: parameter '", r.name,
                                               "': ", loaded.message()));
            }
            backups.emplace_back(i, std::move(current));
            return absl::OkStatus();
          }();
          if (!status.ok()) {
            Restore(rt, backups);
            return status;
          }
        }
        {
          absl::MutexLock lock(&job.mu);
          rank.steps_done = request.step();
          rank.next_step = request.step() + 1;
          rank.pipeline->Reset(request.step());
        }
        v1::ImportStateResponse response;
        response.set_step(request.step());
        response.set_records(static_cast<int>(backups.size()));
        return response;
      });
}

void EngineImpl::Shutdown() {
  std::vector<std::shared_ptr<Job>> jobs;
  std::vector<std::unique_ptr<Worker>> retired;
  std::vector<std::shared_ptr<LocalRank>> lingered;
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_.exchange(true)) return;
    watcher_cv_.SignalAll();
    for (auto& [id, job] : jobs_) jobs.push_back(job);
    jobs_.clear();
    retired.swap(retired_);
    for (auto& [when, rank] : lingering_) lingered.push_back(std::move(rank));
    lingering_.clear();
  }
  spdlog::info("engine shutting down: daemon={} jobs={}", options_.daemon_id,
               jobs.size());
  std::vector<std::shared_ptr<LocalRank>> ranks;
  std::vector<Callback<v1::RegisterResponse>> pending;
  for (auto& job : jobs) {
    absl::MutexLock lock(&job->mu);
    if (job->state != JobState::kFailed) {
      job->state = JobState::kFailed;
      job->failure = "canzonad is shutting down";
    }
    for (auto& [g, r] : job->ranks) {
      ranks.push_back(r);
      if (r->register_done) pending.push_back(std::move(r->register_done));
      r->register_done = nullptr;
    }
    job->cv.SignalAll();
  }
  for (auto& r : lingered) ranks.push_back(r);
  for (auto& r : ranks) r->AbortComms();
  for (auto& r : ranks) r->FailPipeline(Unavailable());
  for (auto& r : ranks) {
    if (r->worker) r->worker->StopAndJoin();
  }
  for (auto& job : jobs) {
    std::vector<std::shared_ptr<LocalRank>> job_ranks;
    {
      absl::MutexLock lock(&job->mu);
      for (auto& [g, r] : job->ranks) job_ranks.push_back(r);
    }
    for (auto& r : job_ranks) CancelAfterStep(*job, *r);
  }
  for (auto& w : retired) w->StopAndJoin();
  for (auto& cb : pending) cb(Unavailable());
  if (watcher_.joinable()) watcher_.join();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(EngineOptions options) {
  if (options.control == nullptr) {
    return absl::InvalidArgumentError("control: a KvStore is required");
  }
  if (options.daemon_id.empty()) {
    return absl::InvalidArgumentError("daemon_id must not be empty");
  }
  if (options.backend != "cpu" && options.backend != "auto" &&
      options.backend != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat(
        "backend '", options.backend, "': expected auto, cpu or cuda"));
  }
  if (options.comm != "gloo" && options.comm != "nccl") {
    return absl::InvalidArgumentError(
        absl::StrCat("comm '", options.comm, "': expected gloo or nccl"));
  }
  if (options.comm == "nccl" && options.nccl_api == nullptr) {
    if (absl::StatusOr<NcclApi*> api = RealNcclApi(); !api.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("comm 'nccl': ", api.status().message()));
    }
    const int devices = NodeCudaDevices(options);
    if (options.backend == "cpu" || devices == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "comm 'nccl' keeps the step in GPU memory: it needs backend cuda "
          "(backend is '",
          options.backend, "', ", devices, " GPU(s) present)"));
    }
  }
  if (options.register_timeout <= absl::ZeroDuration() ||
      options.step_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("timeouts must be positive");
  }
  if (options.max_jobs < 1 || options.max_parameters_per_job < 1 ||
      options.max_bytes_per_job < 1) {
    return absl::InvalidArgumentError("limits must be positive");
  }
  spdlog::info("engine started: daemon={} backend={} comm={} comm_host={}",
               options.daemon_id, options.backend, options.comm,
               options.comm_host);
  return std::unique_ptr<Engine>(
      std::make_unique<EngineImpl>(std::move(options)));
}

}  // namespace canzona
