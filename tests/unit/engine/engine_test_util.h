// Test harness for the Engine: "two daemons" in one process (two Engines
// sharing one InMemoryKvStore as the control plane), trainer ranks as
// threads with POSIX shm buffers, a small Qwen3-shaped model, and a
// single-process reference (update rules on whole matrices with the
// DP-averaged full gradients).
//
// The definitions: the models and their TP layout in engine_test_model.cc,
// the reference in engine_test_reference.cc, FakeCudaIpc in
// fake_cuda_ipc.cc, the cluster, trainer ranks and job runs in
// engine_test_util.cc.
//
//   Cluster cluster;
//   JobRun run(MakeJobConfig("t1", /*dp=*/2, /*tp=*/2, "cost"));
//   ASSERT_OK(run.Init());
//   ASSERT_OK(run.RunAll(cluster, /*steps=*/5));
//   ASSERT_OK_AND_ASSIGN(auto ref, Reference(run.config(), 5, {}));
//   EXPECT_OK(run.Compare(ref, /*bitwise=*/true));
//
// or, the same steps in one call (RunMatchesReference):
//
//   EXPECT_OK(RunMatchesReference(cluster, run, /*steps=*/5,
//                                 /*bitwise=*/true, /*deregister=*/true));
//
// Thread-safety: a JobRun is driven by its own rank threads inside RunAll;
// its other methods are for the test thread.
#ifndef CANZONA_TESTS_UNIT_ENGINE_ENGINE_TEST_UTIL_H_
#define CANZONA_TESTS_UNIT_ENGINE_ENGINE_TEST_UTIL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/base/dtype.h"
#include "kernels/cuda/cuda_ipc.h"
#include "proto/shared_memory/shared_memory.h"
#include "server/comm/nccl_api.h"
#include "server/control/kv_store.h"
#include "server/engine/engine.h"
#include "server/metrics/registry.h"
#include "server/optim/matrix_blocks.h"

namespace canzona::engine_test {

// The GPUs a test "node" has (FakeCudaIpc::devices, and what a Cluster on
// the fake NCCL plane reports): each rank of a job up to this size gets a
// GPU of its own, as NCCL needs, so a device mix-up fails the fakes' device
// checks.
inline constexpr int kFakeGpus = 8;

// Every value of the reference: full matrices per parameter, by name.
using Params = std::map<std::string, std::vector<float>>;

// Rows [first, first + count) of a separate parameter `name` of `shape`.
struct RowsOf {
  std::string name;
  std::vector<int64_t> shape;
  int64_t first = 0;
  int64_t count = 0;
};

struct ModelParam {
  std::string name;
  std::vector<int64_t> shape;
  int split = -1;
  std::string group;
  // A fused matrix's blocks (RegisterRequest Parameter.blocks); under TP
  // the trainer shards it as Megatron does (a pattern that does not repeat
  // is split block by block: [gate_t; up_t]).
  BlockSpec blocks;
  // A fused matrix's rows in order, taken from the separate parameters of
  // the same model in an unfused layout: its initial values and gradients
  // are theirs, so both layouts train on the same numbers.
  std::vector<RowsOf> fused;
  // The pipeline stage that holds it (JobConfig::pp).
  int stage = 0;
};

// The separate (unfused) parameters of `fused_params` with the values of
// `fused` (by fused name); the other parameters as they are.
Params Unfuse(const std::vector<ModelParam>& fused_params, const Params& fused);
// `p`'s values from the separate parameters' (p's own when not fused).
std::vector<float> Fused(const ModelParam& p, const Params& separate);

// hidden 64, 2 layers, 4 query heads and 2 kv heads of 16, ffn 128, vocab
// 128; fused qkv / gate_up (Megatron) or separate projections (HF).
std::vector<ModelParam> MegatronModel();
std::vector<ModelParam> HfModel();
// One model (hidden 64; 8 query heads in 4 query groups of 8; ffn 64; 2
// layers) in two layouts, every matrix on `optimizer`: Hugging Face's
// separate q, k, v, gate and up, and Megatron's fused linear_qkv and
// linear_fc1 (with blocks named after the separate parameters, or none).
// The other parameters share names, and the fused ones take their values
// from the separate ones (ModelParam::fused): both train on the same
// numbers.
struct FusedLayouts {
  std::vector<ModelParam> hf;
  std::vector<ModelParam> megatron;
};
FusedLayouts FusedAndSeparate(const std::string& optimizer, bool blocks = true);
// A small MoE model: per layer a router and `experts` experts of one
// shape (fc1 [64, 64], fc2 [64, 32]) on Muon, attention on Muon, the rest
// AdamW; the experts are TP-replicated (expert parallelism's habit).
std::vector<ModelParam> MoeModel(int experts, int layers = 2);
// A small convolutional net: filters (out, in, kh, kw) in Muon, Shampoo and
// SOAP groups, whole or split along out or in, and one in AdamW; and two
// stacks of experts (E, rows, cols) in Muon and SOAP.
std::vector<ModelParam> ConvModel();
// MegatronModel with Muon for every matrix (AdamW for the rest).
std::vector<ModelParam> MuonModel();

// Tensor-parallel layout (engine_test_model.cc): the elements of `shape`;
// `p`'s shape on one of `tp` ranks; TP rank j's fragment of a full tensor
// (Megatron's: split along p.split, a fused matrix's blocks each split)
// and its inverse, which writes the fragment into `full`.
int64_t Numel(const std::vector<int64_t>& shape);
std::vector<int64_t> LocalShape(const ModelParam& p, int tp);
std::vector<float> Fragment(const ModelParam& p, int tp, int j,
                            const std::vector<float>& full);
void PutFragment(const ModelParam& p, int tp, int j,
                 const std::vector<float>& frag, std::vector<float>* full);
// The optimizer settings the tests give parameter group `group`.
std::vector<std::pair<std::string, std::string>> GroupSettings(
    const std::string& group);

struct JobConfig {
  std::string job_id;
  // Pipeline stages: rank g is (g / (dp tp), g / tp % dp, g % tp); a stage
  // registers its parameters only (ModelParam::stage). Overlapped steps
  // (RunStepsOverlapped) need pp 1.
  int pp = 1;
  int dp = 1;
  int tp = 1;
  std::string strategy = "cost";
  std::vector<ModelParam> params;
  bool exact = true;  // gradients: small multiples of 2^-12 (exact sums)
  uint64_t seed = 1;
  std::string token = "secret";
  // Gradient bucket size in elements (small, so the models span buckets).
  int64_t bucket_size = 20000;
  // Step at which (dp, tp) = nan_rank injects a NaN gradient (0: never).
  int nan_step = 0;
  int nan_global_rank = 0;
  // Gradients whose DP average is the same for every DP size (rank d adds
  // (2d + 1 - dp) times a second pattern, which sums to zero): runs in
  // different layouts then share one reference (resharding tests).
  bool layout_free_grads = false;
  // Hierarchical sharding (RegisterRequest.shard_group_size; 0 = flat).
  int shard_group_size = 0;
  // Muon's ns_precision setting sent to the engine (empty: the default;
  // the reference always runs fp32 on cpu).
  std::string muon_ns_precision;
  // Buffers described as CUDA IPC (the rank's shm object standing in for
  // the device allocation; needs a Cluster with a FakeCudaIpc).
  bool cuda_ipc = false;
  // RegisterRequest.params_events: on the NCCL plane the daemon answers
  // without waiting for its writes of the parameters, and RunSteps /
  // RunStepsOverlapped wait for its "parameters written" events after each
  // answer (as the trainer's stream would), unless skip_params_event_wait
  // (the negative control).
  bool params_event = false;
  bool skip_params_event_wait = false;
  // The GPU the CUDA IPC buffers name by PCI bus id (empty: each rank's
  // own, FakeCudaIpc::BusId(global rank % kFakeGpus), as on a node whose
  // trainers each have a GPU).
  std::string pci_bus_id;
  // The trainer's parameters and gradients (bf16 / fp16: mixed precision,
  // the daemon keeps fp32 master weights).
  DType dtype = DType::kFloat32;
  // The trainer lays its parameters out in one run and its gradients in
  // another, both in reverse parameter order (bucket order), as Megatron
  // and canzona.torch do: the daemon's DP collectives then work on them in
  // place. False: [param, grad] interleaved per parameter (the bucket
  // slot path).
  bool bucket_order = false;
  // RegisterRequest.max_grad_norm and grad_reduce_dtype (fp32: true);
  // StepRequest.max_grad_norm per step.
  double max_grad_norm = 0;
  std::map<int64_t, double> step_max_grad_norm;
  // StepRequest.settings per step: group -> setting -> value (torch.optim's
  // param_groups changed by a schedule); the reference steps with the same.
  std::map<int64_t, std::map<std::string, std::map<std::string, double>>>
      step_settings;
  bool grad_reduce_fp32 = false;
  int world() const { return pp * dp * tp; }
};

// CUDA IPC over host memory: a "handle" carries a pointer and size in this
// process, copies are memcpy. Counts what the engine does with it.
// Thread-safety: counters are atomic.
class FakeCudaIpc final : public CudaIpcOpener {
 public:
  static std::string Handle(void* base, uint64_t size);
  static std::string EventHandle(int id);
  absl::StatusOr<CudaIpcOpened> Open(const std::string& handle,
                                     int device) override;
  void Close(const CudaIpcOpened& opened, int device) override;
  absl::StatusOr<void*> OpenEvent(const std::string& handle,
                                  int device) override;
  absl::Status WaitEvent(void* event, int device,
                         absl::Time deadline) override;
  void CloseEvent(void* event, int device) override;
  absl::Status CopyToHost(int device, const void* src, size_t bytes,
                          void* dst) override;
  absl::Status CopyFromHost(int device, const void* src, size_t bytes,
                            void* dst) override;
  // With `pinned` set: outside what it calls page-locked.
  bool HostPageable(int, const void* host, size_t bytes) override {
    return pinned && !pinned(host, bytes);
  }
  // GPUs "0000:0d:00.0" for device d < devices.
  absl::StatusOr<int> DeviceOfPciBusId(const std::string& pci_bus_id) override;
  absl::StatusOr<std::string> PciBusIdOf(int device) override;
  static std::string BusId(int device);

  // How many GPUs this "daemon" sees (set before use).
  int devices = kFakeGpus;
  std::atomic<int> opens{0}, closes{0}, events_open{0}, event_waits{0};
  // False: host waits for an opened event last until their deadline.
  std::atomic<bool> events_complete{true};
  std::atomic<int> last_open_device{-1};
  std::atomic<int64_t> copied_bytes{0};
  // The synchronous copies out of (to_host) and into (from_host) the
  // "device" memory, and their bytes.
  std::atomic<int64_t> to_host{0}, to_host_bytes{0};
  std::atomic<int64_t> from_host{0}, from_host_bytes{0};
  // Set: whether a copy's host side is page-locked; copies whose host side
  // is not are counted (a GPU stages them through a bounce buffer).
  std::function<bool(const void*, size_t)> pinned;
  std::atomic<int64_t> pageable_copies{0};

  // Whether [p, p + bytes) lies inside one "device" buffer opened so far
  // (a GPU trainer's memory, host memory underneath).
  bool InsideOpened(const void* p, size_t bytes) const;
  // Whether `event` is one of the events OpenEvent handed out, still open.
  bool IsOpenEvent(const void* event) const;

 private:
  mutable absl::Mutex mu_;
  std::vector<std::pair<const char*, uint64_t>> opened_ ABSL_GUARDED_BY(mu_);
  // CUDA's lifetime rules, enforced: a process maps an exported allocation
  // once per device (a second cudaIpcOpenMemHandle of it fails) until it
  // closes it, and closes or waits on only what it has open (a violation
  // aborts the test). (device,
  // allocation base) pairs open now, and the events open now (each open
  // gets a cookie of its own, never dereferenced, as a cudaEvent_t).
  std::set<std::pair<int, const void*>> open_memory_ ABSL_GUARDED_BY(mu_);
  std::set<const void*> open_events_ ABSL_GUARDED_BY(mu_);
  uintptr_t next_event_ ABSL_GUARDED_BY(mu_) = 0x1000;
};

// Waits until `done` holds, asking every 50 ms, at most `timeout` (the
// caller then asserts what it waited for): for what a deregistered rank
// releases once its linger ends (JobRegistry::Options::linger, 5 s), in
// the background.
void Eventually(const std::function<bool()>& done, absl::Duration timeout);

// A unique job id (pid + counter): shm names never collide across tests.
std::string UniqueJobId(const std::string& stem);

// A job of the given layout and strategy under a unique id (the other
// settings at their defaults).
JobConfig MakeJobConfig(const std::string& stem, int dp, int tp,
                        const std::string& strategy,
                        std::vector<ModelParam> params = MegatronModel());

struct Cluster {
  // `backend`: the engines' compute backend (cpu: the bitwise tests must
  // not move to a GPU where one exists).
  // `cuda_ipc`: a fake IPC layer for jobs with JobConfig::cuda_ipc.
  // `nccl`: the engines run comm "nccl" over this NcclApi (a FakeNcclApi
  // in data mode: host memory as device memory).
  // `batch_updates`: EngineOptions::batch_updates.
  // `device_like_cpu`: EngineOptions::device_like_cpu (the cpu backend as
  // a GPU beside host staging on the Gloo plane); also when the
  // environment sets CANZONA_TEST_DEVICE_LIKE_CPU=1.
  // `gloo`: the Gloo plane even with `nccl`, which then stands in only for
  // the CUDA runtime calls beside it (the gradients-event snapshots).
  // `metrics_retention`: EngineOptions::metrics_retention.
  explicit Cluster(absl::Duration step_timeout = absl::Seconds(20),
                   absl::Duration register_timeout = absl::Seconds(20),
                   const std::string& backend = "cpu",
                   CudaIpcOpener* cuda_ipc = nullptr, NcclApi* nccl = nullptr,
                   bool batch_updates = true, bool device_like_cpu = false,
                   bool gloo = false,
                   absl::Duration metrics_retention = absl::Minutes(5));
  ~Cluster();
  InMemoryKvStore kv;
  // Each engine's metrics (server/metrics/README.md), as a daemon's.
  MetricsRegistry metrics[2];
  std::unique_ptr<Engine> engines[2];
  NcclApi* nccl = nullptr;  // the engines' (null: the Gloo plane)
  // The engines page-lock host staging (through `nccl`'s cudaHostRegister
  // on either plane, or the CUDA runtime's with cuda compute): the steps
  // then check the compute backend's copies (kernels/pageable_copies.h).
  bool page_locked = false;
};

// The initial full parameters and the full gradient of (step, dp rank).
std::vector<float> InitialParam(const JobConfig& config, const ModelParam& p);
std::vector<float> FullGrad(const JobConfig& config, const ModelParam& p,
                            int step, int dp_rank);

// The single-process reference after `steps` (skipping `skip_steps`). With
// `fragment_param`, that parameter is updated per TP fragment instead of
// whole (the negative control). In mixed precision it runs on fp32 master
// weights initialised from the trainer's rounded parameters, with the
// trainer's rounded gradients, and returns the masters (Compare rounds
// them); `round_each_step` rounds the masters after every step instead
// (no master weights: the negative control).
// `first_step`: the parameters start from their initial values with fresh
// state at that step, stepping on its gradients and those after (a
// parameter a checkpoint had no record of, from the load on).
absl::StatusOr<Params> Reference(const JobConfig& config, int steps,
                                 const std::set<int>& skip_steps,
                                 const std::string& fragment_param = "",
                                 bool round_each_step = false,
                                 int first_step = 1);

// The DP-averaged gradient of every parameter at `step` as the daemon
// forms it (the trainer's rounded gradients, summed in the reduce dtype),
// in config.params order; and its global L2 norm.
std::vector<std::vector<float>> AveragedGrads(const JobConfig& config,
                                              int step);
double ReferenceGradNorm(const JobConfig& config, int step);

// `values` as the trainer's dtype holds them (rounded, then widened).
std::vector<float> Rounded(DType dtype, std::vector<float> values);

template <typename T>
struct Result {
  Result() : future(promise->get_future()) {}
  std::shared_ptr<std::promise<absl::StatusOr<T>>> promise =
      std::make_shared<std::promise<absl::StatusOr<T>>>();
  std::future<absl::StatusOr<T>> future;
  Callback<T> callback() {
    auto p = promise;
    return [p](absl::StatusOr<T> r) { p->set_value(std::move(r)); };
  }
  absl::StatusOr<T> Get() { return future.get(); }
};

// One trainer rank: its shm object, register request and step calls.
class TrainerRank {
 public:
  TrainerRank(const JobConfig& config, int global);
  absl::Status Init();  // creates and fills the shm object

  int global() const { return global_; }
  int pp_rank() const { return pp_; }
  int dp_rank() const { return dp_; }
  int tp_rank() const { return tp_; }
  // Which of the two engines serves it: the first half of the world on 0.
  int engine_index() const;
  canzona::v1::RegisterRequest MakeRegister() const;
  // Whether this rank's pipeline stage holds `p`.
  bool Holds(const ModelParam& p) const;
  canzona::v1::StepRequest MakeStep(int64_t step) const;
  void WriteGrads(int step);
  // Only the gradients of these parameters (indices into config().params):
  // what backward has produced when a bucket completes.
  void WriteGrads(int step, const std::vector<int>& params);
  // This rank's shard of the parameter / its buffer.
  std::vector<float> Shard(const ModelParam& p,
                           const std::vector<float>& full) const;
  std::vector<float> ParamBuffer(int index) const;
  // Overwrites the parameter buffers with this rank's shards of `full`
  // (what a trainer does when it restores its model checkpoint).
  void SetParams(const std::map<std::string, std::vector<float>>& full);
  const JobConfig& config() const { return config_; }

 private:
  JobConfig config_;
  int global_, pp_, dp_, tp_;
  // Elements written in the job's dtype at element `at` of the shm object,
  // and read back widened.
  void Put(int64_t at, const std::vector<float>& values);
  std::vector<float> Get(int64_t at, int64_t n) const;

  // Per param, in elements of the dtype: param at off, grad at off + n.
  std::vector<int64_t> offsets_;       // of each parameter's values
  std::vector<int64_t> grad_offsets_;  // of each parameter's gradient
  std::vector<int64_t> local_numel_;
  std::unique_ptr<SharedMemory> shm_;
};

// A job: its ranks on the two engines, run to completion.
class JobRun {
 public:
  explicit JobRun(JobConfig config);
  absl::Status Init();
  // Registers every rank, runs `steps` steps on all, from threads.
  absl::Status RunAll(Cluster& cluster, int steps);
  absl::Status RegisterAll(Cluster& cluster);
  // Steps first..last on every rank (registered already). INTERNAL when a
  // copy of the compute backend met pageable host memory meanwhile
  // (RunStepsOverlapped too) where the engines page-lock
  // (Cluster::page_locked): every host range that meets the GPU then is.
  // `edit` (when set) changes each request before it goes.
  using StepEdit =
      std::function<void(const TrainerRank&, canzona::v1::StepRequest&)>;
  absl::Status RunSteps(Cluster& cluster, int first, int last,
                        const StepEdit& edit = nullptr);
  // The same steps the way an overlapping trainer drives them: per bucket
  // in backward order it writes the bucket's gradients and reports it with
  // GradReady (in `shuffled` mode every rank writes all first and reports
  // the buckets in its own random order, leaving some to Step); Step with
  // async_params; then WaitParams per bucket in forward order (or -1).
  // `seed` varies the orders and the sleeps between events.
  absl::Status RunStepsOverlapped(Cluster& cluster, int first, int last,
                                  bool shuffled, uint64_t seed,
                                  const StepEdit& edit = nullptr);
  // Runs `call` for every rank on its own thread (collectives), with the
  // engine serving it; the first error names its rank.
  absl::Status ForAll(
      Cluster& cluster,
      const std::function<absl::Status(TrainerRank&, Engine&)>& call);
  // The full parameters as the ranks hold them (TP fragments joined).
  Params GatherParams() const;
  // Compares every rank's parameter buffers with the reference shards
  // (bitwise, or within `tolerance` times the parameter's largest
  // magnitude); error names the first mismatching parameter and rank. In
  // mixed precision the reference is rounded to the dtype first, and the
  // tolerance is at least one ulp of the dtype at the reference value.
  absl::Status Compare(const Params& reference, bool bitwise,
                       float tolerance = 1e-6f) const;
  absl::Status Deregister(Cluster& cluster);
  // The copies with a pageable host side the answers so far reported
  // (StepResponse.pageable_copies), summed; FAILED_PRECONDITION naming the
  // rank and step where one answer reported fewer than `each`.
  absl::StatusOr<int64_t> ReportedPageableCopies(int64_t each) const;

  const JobConfig& config() const { return config_; }
  std::vector<std::unique_ptr<TrainerRank>>& ranks() { return ranks_; }
  // Step responses per rank (global rank) per step.
  std::vector<std::vector<canzona::v1::StepResponse>> responses;
  std::vector<canzona::v1::RegisterResponse> registered;

  // What a trainer's stream does after an answer that handed `rank` the
  // parameters of `bucket` (-1: all): waits for the daemon's "parameters
  // written" events (JobConfig::params_event; here the host waits, over
  // the cluster's FakeNcclApi). A no-op without handles.
  absl::Status AwaitParams(Cluster& cluster, const TrainerRank& rank,
                           int bucket) const;

 private:
  JobConfig config_;
  std::vector<std::unique_ptr<TrainerRank>> ranks_;
};

// The equivalence check most tests make: initializes `run`, registers it
// and runs steps 1..`steps` on `cluster` (RunAll), and compares every
// rank's parameters with Reference(run.config(), steps, {}), bitwise or
// within `tolerance` (JobRun::Compare); with `deregister`, then
// deregisters the job (also after a mismatch). The error names the stage
// that failed ("RunAll: rank 1: ...", "Compare (bitwise): rank 0 ...") and
// keeps its code; a failed Deregister after a mismatch is appended.
absl::Status RunMatchesReference(Cluster& cluster, JobRun& run, int steps,
                                 bool bitwise, bool deregister,
                                 float tolerance = 1e-6f);

// A trainer that loads new weights into its model between steps: every
// rank of `run` writes values exact in bf16 and fp16 into its parameters,
// then steps `step` at lr 0 (the masters stay as they are), listing every
// parameter in StepRequest.reload_params when `reload`. Returns how many
// parameter buffers, over all ranks, hold the written values afterwards:
// all of them when the daemon took them as its masters, none when it
// wrote its older masters over them.
absl::StatusOr<int> StepAfterLoadingParams(Cluster& cluster, JobRun& run,
                                           int step, bool reload);
// Lists in `request` (StepRequest.reload_params) every parameter of
// `params` that `rank` holds: a trainer that wrote its whole model.
void ReloadEveryHeldParam(const std::vector<ModelParam>& params,
                          const TrainerRank& rank,
                          canzona::v1::StepRequest& request);

}  // namespace canzona::engine_test

#endif  // CANZONA_TESTS_UNIT_ENGINE_ENGINE_TEST_UTIL_H_
