#include "tests/unit/engine/engine_test_util.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/backend.h"
#include "kernels/base/status_macros.h"
#include "kernels/pageable_copies.h"
#include "server/engine/engine_impl.h"
#include "tests/unit/comm/fake_nccl_api.h"

namespace canzona::engine_test {

namespace v1 = ::canzona::v1;
using ::canzona::testing::FakeNcclApi;

void Eventually(const std::function<bool()>& done, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
}

std::string UniqueJobId(const std::string& stem) {
  // pid and counter alone collide with the leftovers (in /dev/shm) of an
  // earlier process with the same pid that was killed mid-test.
  static std::atomic<int> counter{0};
  static const uint64_t salt =
      absl::ToUnixNanos(absl::Now()) & 0xffffff;  // per process
  return absl::StrCat(stem, "-", getpid(), absl::Hex(salt), "-", counter++);
}

JobConfig MakeJobConfig(const std::string& stem, int dp, int tp,
                        const std::string& strategy,
                        std::vector<ModelParam> params) {
  JobConfig c;
  c.job_id = UniqueJobId(stem);
  c.dp = dp;
  c.tp = tp;
  c.strategy = strategy;
  c.params = std::move(params);
  return c;
}

Cluster::Cluster(absl::Duration step_timeout, absl::Duration register_timeout,
                 const std::string& backend, CudaIpcOpener* cuda_ipc,
                 NcclApi* nccl, bool batch_updates, bool device_like_cpu,
                 bool gloo, absl::Duration metrics_retention)
    : nccl(gloo ? nullptr : nccl),
      page_locked(nccl != nullptr || backend == "cuda") {
  // A GPU trainer's opened buffers are device memory to the runtime too.
  auto* fake_nccl = dynamic_cast<FakeNcclApi*>(nccl);
  auto* fake_ipc = dynamic_cast<FakeCudaIpc*>(cuda_ipc);
  if (fake_nccl != nullptr && fake_ipc != nullptr) {
    fake_nccl->set_other_device_memory([fake_ipc](const void* p, int64_t n) {
      return fake_ipc->InsideOpened(p, static_cast<size_t>(n));
    });
  }
  for (int i = 0; i < 2; ++i) {
    EngineOptions options;
    options.backend = backend;
    options.batch_updates = batch_updates;
    // CANZONA_TEST_DEVICE_LIKE_CPU=1: a whole suite on the device-like
    // compute beside host staging (tests/unit/engine/CMakeLists.txt).
    const char* everywhere = std::getenv("CANZONA_TEST_DEVICE_LIKE_CPU");
    options.device_like_cpu =
        device_like_cpu || (everywhere != nullptr && everywhere[0] == '1');
    if (nccl != nullptr) {
      options.comm = gloo ? "gloo" : "nccl";
      options.nccl_api = nccl;
      options.cuda_devices = kFakeGpus;
    }
    if (cuda_ipc != nullptr) {
      options.cuda_ipc = cuda_ipc;
      auto* fake = dynamic_cast<FakeCudaIpc*>(cuda_ipc);
      options.cuda_devices = fake != nullptr ? fake->devices : 1;
    }
    options.control = &kv;
    options.metrics = &metrics[i];
    options.metrics_retention = metrics_retention;
    options.daemon_id = absl::StrCat("daemon", i);
    options.step_timeout = step_timeout;
    options.register_timeout = register_timeout;
    engines[i] = *CreateEngine(std::move(options));
  }
}

Cluster::~Cluster() {
  for (auto& e : engines) e->Shutdown();
}

// ---------------------------------------------------------------------------

TrainerRank::TrainerRank(const JobConfig& config, int global)
    : config_(config), global_(global) {
  pp_ = global / (config.dp * config.tp);
  dp_ = (global / config.tp) % config.dp;
  tp_ = global % config.tp;
}

bool TrainerRank::Holds(const ModelParam& p) const { return p.stage == pp_; }

int TrainerRank::engine_index() const {
  return config_.world() == 1 ? 0 : (global_ < config_.world() / 2 ? 0 : 1);
}

absl::Status TrainerRank::Init() {
  int64_t total = 0;
  for (const ModelParam& p : config_.params) {
    // Another pipeline stage's parameter takes no room here.
    const int64_t n = Holds(p) ? Numel(LocalShape(p, config_.tp)) : 0;
    offsets_.push_back(total);
    grad_offsets_.push_back(total + n);
    local_numel_.push_back(n);
    total += 2 * n;
  }
  if (config_.bucket_order) {
    const int count = static_cast<int>(config_.params.size());
    const int64_t half = total / 2;
    int64_t at = 0;
    for (int i = count - 1; i >= 0; --i) {
      offsets_[i] = at;
      grad_offsets_[i] = half + at;
      at += local_numel_[i];
    }
  }
  CANZONA_ASSIGN_OR_RETURN(
      SharedMemory shm,
      SharedMemory::Create(
          ShmName(config_.job_id, global_, 0),
          static_cast<uint64_t>(total) * DTypeBytes(config_.dtype)));
  shm_ = std::make_unique<SharedMemory>(std::move(shm));
  for (size_t i = 0; i < config_.params.size(); ++i) {
    if (!Holds(config_.params[i])) continue;
    Put(offsets_[i],
        Shard(config_.params[i], InitialParam(config_, config_.params[i])));
  }
  return absl::OkStatus();
}

void TrainerRank::Put(int64_t at, const std::vector<float>& values) {
  char* base = static_cast<char*>(shm_->data());
  RoundFromFloat(values.data(), static_cast<int64_t>(values.size()),
                 config_.dtype, base + at * DTypeBytes(config_.dtype));
}

std::vector<float> TrainerRank::Get(int64_t at, int64_t n) const {
  const char* base = static_cast<const char*>(shm_->data());
  std::vector<float> out(n);
  WidenToFloat(config_.dtype, base + at * DTypeBytes(config_.dtype), n,
               out.data());
  return out;
}

std::vector<float> TrainerRank::Shard(const ModelParam& p,
                                      const std::vector<float>& full) const {
  return Fragment(p, config_.tp, tp_, full);
}

std::vector<float> TrainerRank::ParamBuffer(int index) const {
  return Get(offsets_[index], local_numel_[index]);
}

void TrainerRank::SetParams(
    const std::map<std::string, std::vector<float>>& full) {
  for (size_t i = 0; i < config_.params.size(); ++i) {
    const ModelParam& p = config_.params[i];
    if (Holds(p)) Put(offsets_[i], Shard(p, full.at(p.name)));
  }
}

void TrainerRank::WriteGrads(int step) {
  std::vector<int> all(config_.params.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
  WriteGrads(step, all);
}

void TrainerRank::WriteGrads(int step, const std::vector<int>& params) {
  for (int i : params) {
    if (!Holds(config_.params[i])) continue;
    std::vector<float> shard = Shard(
        config_.params[i], FullGrad(config_, config_.params[i], step, dp_));
    if (step == config_.nan_step && global_ == config_.nan_global_rank &&
        i == 3) {
      shard[0] = std::nanf("");
    }
    Put(grad_offsets_[i], shard);
  }
}

v1::RegisterRequest TrainerRank::MakeRegister() const {
  v1::RegisterRequest r;
  r.set_job_id(config_.job_id);
  r.set_params_events(config_.params_event);
  r.set_job_token(config_.token);
  r.mutable_layout()->set_pp(config_.pp);
  r.mutable_layout()->set_dp(config_.dp);
  r.mutable_layout()->set_tp(config_.tp);
  r.mutable_rank()->set_pp_rank(pp_);
  r.mutable_rank()->set_dp_rank(dp_);
  r.mutable_rank()->set_tp_rank(tp_);
  r.set_strategy(config_.strategy);
  r.set_bucket_size(config_.bucket_size);
  r.set_shard_group_size(config_.shard_group_size);
  r.set_max_grad_norm(config_.max_grad_norm);
  if (config_.grad_reduce_fp32) r.set_grad_reduce_dtype(v1::DTYPE_FLOAT32);
  for (const char* g : {"muon", "adamw", "shampoo", "soap"}) {
    v1::OptimizerGroup* group = r.add_groups();
    group->set_name(g);
    group->set_optimizer(g);
    for (const auto& [k, v] : GroupSettings(g)) {
      v1::Setting* s = group->add_settings();
      s->set_key(k);
      s->set_value(v);
    }
    if (std::string(g) == "muon" && !config_.muon_ns_precision.empty()) {
      v1::Setting* s = group->add_settings();
      s->set_key("ns_precision");
      s->set_value(config_.muon_ns_precision);
    }
  }
  const std::string pci_bus_id = config_.pci_bus_id.empty()
                                     ? FakeCudaIpc::BusId(global_ % kFakeGpus)
                                     : config_.pci_bus_id;
  for (size_t i = 0; i < config_.params.size(); ++i) {
    const ModelParam& p = config_.params[i];
    if (!Holds(p)) continue;  // another pipeline stage's
    v1::Parameter* q = r.add_parameters();
    q->set_name(p.name);
    for (int64_t d : p.shape) q->add_shape(d);
    q->set_dtype(config_.dtype == DType::kBFloat16  ? v1::DTYPE_BFLOAT16
                 : config_.dtype == DType::kFloat16 ? v1::DTYPE_FLOAT16
                                                    : v1::DTYPE_FLOAT32);
    q->set_tp_split_dim(p.split);
    q->set_group(p.group);
    if (!p.blocks.empty()) {
      v1::Blocks* b = q->mutable_blocks();
      b->set_dim(p.blocks.dim);
      for (int64_t size : p.blocks.sizes) b->add_sizes(size);
      b->set_repeat(p.blocks.repeat);
      b->set_merge_repeats(p.blocks.merge_repeats);
      for (const std::string& name : p.blocks.names) b->add_names(name);
    }
    const int unit = DTypeBytes(config_.dtype);
    const uint64_t bytes = static_cast<uint64_t>(local_numel_[i]) * unit;
    if (config_.cuda_ipc) {
      // The fake IPC "allocation" is this rank's whole shm object.
      const std::string handle =
          FakeCudaIpc::Handle(shm_->data(), shm_->size());
      v1::CudaIpcBufferRef* p_ref = q->mutable_param()->mutable_cuda_ipc();
      p_ref->set_mem_handle(handle);
      p_ref->set_offset(offsets_[i] * unit);
      p_ref->set_bytes(bytes);
      p_ref->set_pci_bus_id(pci_bus_id);
      v1::CudaIpcBufferRef* g_ref = q->mutable_grad()->mutable_cuda_ipc();
      g_ref->set_mem_handle(handle);
      g_ref->set_offset(grad_offsets_[i] * unit);
      g_ref->set_bytes(bytes);
      g_ref->set_event_handle(FakeCudaIpc::EventHandle(global_));
      g_ref->set_pci_bus_id(pci_bus_id);
      continue;
    }
    v1::ShmBufferRef* param = q->mutable_param()->mutable_shm();
    param->set_name(shm_->name());
    param->set_offset(offsets_[i] * unit);
    param->set_bytes(bytes);
    v1::ShmBufferRef* grad = q->mutable_grad()->mutable_shm();
    grad->set_name(shm_->name());
    grad->set_offset(grad_offsets_[i] * unit);
    grad->set_bytes(bytes);
  }
  return r;
}

v1::StepRequest TrainerRank::MakeStep(int64_t step) const {
  v1::StepRequest s;
  s.set_job_id(config_.job_id);
  s.mutable_rank()->set_pp_rank(pp_);
  s.mutable_rank()->set_dp_rank(dp_);
  s.mutable_rank()->set_tp_rank(tp_);
  s.set_step(step);
  auto clip = config_.step_max_grad_norm.find(step);
  if (clip != config_.step_max_grad_norm.end()) {
    s.set_max_grad_norm(clip->second);
  }
  auto settings = config_.step_settings.find(step);
  if (settings != config_.step_settings.end()) {
    for (const auto& [group, values] : settings->second) {
      for (const auto& [key, value] : values) {
        (*(*s.mutable_settings())[group].mutable_values())[key] = value;
      }
    }
  }
  return s;
}

// ---------------------------------------------------------------------------

JobRun::JobRun(JobConfig config) : config_(std::move(config)) {}

absl::Status JobRun::Init() {
  for (int g = 0; g < config_.world(); ++g) {
    ranks_.push_back(std::make_unique<TrainerRank>(config_, g));
    CANZONA_RETURN_IF_ERROR(ranks_.back()->Init());
  }
  responses.assign(config_.world(), {});
  registered.assign(config_.world(), {});
  return absl::OkStatus();
}

absl::Status JobRun::ForAll(
    Cluster& cluster,
    const std::function<absl::Status(TrainerRank&, Engine&)>& call) {
  std::vector<absl::Status> status(config_.world());
  std::vector<std::thread> threads;
  for (int g = 0; g < config_.world(); ++g) {
    threads.emplace_back([&, g] {
      TrainerRank& rank = *ranks_[g];
      status[g] = call(rank, *cluster.engines[rank.engine_index()]);
    });
  }
  for (auto& t : threads) t.join();
  for (int g = 0; g < config_.world(); ++g) {
    if (!status[g].ok()) {
      return absl::Status(status[g].code(),
                          absl::StrCat("rank ", g, ": ", status[g].message()));
    }
  }
  return absl::OkStatus();
}

absl::Status JobRun::RegisterAll(Cluster& cluster) {
  return ForAll(cluster, [&](TrainerRank& rank, Engine& engine) {
    Result<v1::RegisterResponse> reg;
    engine.Register(rank.MakeRegister(), PeerInfo{}, reg.callback());
    CANZONA_ASSIGN_OR_RETURN(registered[rank.global()], reg.Get());
    return absl::OkStatus();
  });
}

namespace {

// Where the engines page-lock (Cluster::page_locked), every host
// range that meets the GPU is page-locked (cudaHostRegister): a copy of the
// compute backend to or from pageable memory during a step
// (kernels/pageable_copies.h) is a defect, a wait a GPU would hide inside
// cudaMemcpyAsync. OK elsewhere.
class NoPageableCopies {
 public:
  explicit NoPageableCopies(const Cluster& cluster)
      : checked_(cluster.page_locked), before_(PageableCopies()) {}
  absl::Status Check(absl::Status steps) const {
    if (!steps.ok() || !checked_) return steps;
    const int64_t copies = PageableCopies() - before_;
    if (copies == 0) return absl::OkStatus();
    return absl::InternalError(
        absl::StrCat(copies,
                     " copies of the compute backend met pageable host memory "
                     "during the steps; the last: ",
                     LastPageableCopy()));
  }

 private:
  const bool checked_;
  const int64_t before_;
};

}  // namespace

absl::Status JobRun::RunSteps(Cluster& cluster, int first, int last,
                              const StepEdit& edit) {
  const NoPageableCopies pageable(cluster);
  return pageable.Check(ForAll(cluster, [&](TrainerRank& rank, Engine& engine) {
    for (int s = first; s <= last; ++s) {
      rank.WriteGrads(s);
      v1::StepRequest request = rank.MakeStep(s);
      if (edit) edit(rank, request);
      Result<v1::StepResponse> step;
      engine.Step(request, step.callback());
      CANZONA_ASSIGN_OR_RETURN(v1::StepResponse response, step.Get());
      responses[rank.global()].push_back(response);
      if (!config_.skip_params_event_wait) {
        CANZONA_RETURN_IF_ERROR(AwaitParams(cluster, rank, -1));
      }
    }
    return absl::OkStatus();
  }));
}

absl::Status JobRun::AwaitParams(Cluster& cluster, const TrainerRank& rank,
                                 int bucket) const {
  const v1::RegisterResponse& reg = registered[rank.global()];
  auto* fake = dynamic_cast<FakeNcclApi*>(cluster.nccl);
  for (int b = 0; b < reg.buckets_size(); ++b) {
    if (bucket >= 0 && b != bucket) continue;
    const std::string& handle = reg.buckets(b).params_event_handle();
    if (handle.empty()) continue;
    if (fake == nullptr) {
      return absl::FailedPreconditionError(
          "parameters-written events need a Cluster with a FakeNcclApi");
    }
    CANZONA_ASSIGN_OR_RETURN(NcclEvent event, fake->OpenEventHandle(handle));
    for (;;) {
      CANZONA_ASSIGN_OR_RETURN(bool done, fake->EventQuery(event));
      if (done) break;
      std::this_thread::yield();
    }
  }
  return absl::OkStatus();
}

absl::Status JobRun::RunStepsOverlapped(Cluster& cluster, int first, int last,
                                        bool shuffled, uint64_t seed,
                                        const StepEdit& edit) {
  const NoPageableCopies pageable(cluster);
  return pageable.Check(ForAll(cluster, [&](TrainerRank& rank, Engine& engine) {
    std::mt19937_64 rng(seed * 1000003 + rank.global());
    const v1::RegisterResponse& reg = registered[rank.global()];
    const int buckets = reg.buckets_size();
    auto pause = [&] {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
    };
    auto grad_ready = [&](int64_t s, std::vector<int> list) {
      v1::GradReadyRequest request;
      request.set_job_id(config_.job_id);
      *request.mutable_rank() = rank.MakeStep(s).rank();
      request.set_step(s);
      for (int b : list) request.add_buckets(b);
      Result<v1::GradReadyResponse> done;
      engine.GradReady(request, done.callback());
      return done.Get().status();
    };
    auto wait_params = [&](int64_t s, int b) {
      v1::WaitParamsRequest request;
      request.set_job_id(config_.job_id);
      *request.mutable_rank() = rank.MakeStep(s).rank();
      request.set_step(s);
      request.set_bucket(b);
      Result<v1::WaitParamsResponse> done;
      engine.WaitParams(request, done.callback());
      CANZONA_RETURN_IF_ERROR(done.Get().status());
      return AwaitParams(cluster, rank, b);
    };
    for (int s = first; s <= last; ++s) {
      if (shuffled) {
        rank.WriteGrads(s);
        std::vector<int> order(buckets);
        for (int b = 0; b < buckets; ++b) order[b] = b;
        std::shuffle(order.begin(), order.end(), rng);
        order.resize(buckets - static_cast<int>(rng() % 2));  // leave one
        for (size_t j = 0; j < order.size(); j += 2) {
          std::vector<int> two(order.begin() + j,
                               order.begin() + std::min(j + 2, order.size()));
          two.push_back(two.front());  // repeats are ignored
          CANZONA_RETURN_IF_ERROR(grad_ready(s, two));
          pause();
        }
      } else {
        for (int b = 0; b < buckets; ++b) {
          const v1::Bucket& bucket = reg.buckets(b);
          rank.WriteGrads(s, std::vector<int>(bucket.parameters().begin(),
                                              bucket.parameters().end()));
          CANZONA_RETURN_IF_ERROR(grad_ready(s, {b}));
          pause();
        }
      }
      v1::StepRequest step = rank.MakeStep(s);
      step.set_async_params(true);
      if (edit) edit(rank, step);
      Result<v1::StepResponse> done;
      engine.Step(step, done.callback());
      CANZONA_ASSIGN_OR_RETURN(v1::StepResponse response, done.Get());
      responses[rank.global()].push_back(response);
      if (s % 2 == 0) {
        CANZONA_RETURN_IF_ERROR(wait_params(s, -1));
      } else {
        for (int b = buckets - 1; b >= 0; --b) {
          CANZONA_RETURN_IF_ERROR(wait_params(s, b));
          pause();
        }
      }
    }
    return absl::OkStatus();
  }));
}

absl::Status JobRun::RunAll(Cluster& cluster, int steps) {
  CANZONA_RETURN_IF_ERROR(RegisterAll(cluster));
  return RunSteps(cluster, 1, steps);
}

Params JobRun::GatherParams() const {
  Params out;
  for (size_t i = 0; i < config_.params.size(); ++i) {
    const ModelParam& p = config_.params[i];
    std::vector<float> full(Numel(p.shape));
    for (const auto& rank : ranks_) {
      if (rank->dp_rank() != 0 || !rank->Holds(p)) continue;
      if (p.split < 0) {
        if (rank->tp_rank() == 0) full = rank->ParamBuffer(static_cast<int>(i));
        continue;
      }
      PutFragment(p, config_.tp, rank->tp_rank(),
                  rank->ParamBuffer(static_cast<int>(i)), &full);
    }
    out[p.name] = std::move(full);
  }
  return out;
}

absl::Status JobRun::Compare(const Params& reference, bool bitwise,
                             float tolerance) const {
  for (const auto& rank : ranks_) {
    for (size_t i = 0; i < config_.params.size(); ++i) {
      const ModelParam& p = config_.params[i];
      if (!rank->Holds(p)) continue;
      const std::vector<float> want =
          Rounded(config_.dtype, rank->Shard(p, reference.at(p.name)));
      const std::vector<float> got = rank->ParamBuffer(static_cast<int>(i));
      float scale = 0;
      for (float w : want) scale = std::max(scale, std::fabs(w));
      // One ulp of the dtype at |w| (2^-7 or 2^-10 relative).
      const int mantissa_bits = config_.dtype == DType::kBFloat16  ? 7
                                : config_.dtype == DType::kFloat16 ? 10
                                                                   : 23;
      for (size_t e = 0; e < want.size(); ++e) {
        int exponent = 0;
        std::frexp(want[e], &exponent);
        const float ulp = std::ldexp(1.0f, exponent - 1 - mantissa_bits);
        const float allowed = std::max(
            tolerance * scale, config_.dtype == DType::kFloat32 ? 0 : ulp);
        const bool ok = bitwise
                            ? std::memcmp(&want[e], &got[e], sizeof(float)) == 0
                            : std::fabs(want[e] - got[e]) <= allowed;
        if (!ok) {
          return absl::InternalError(absl::StrCat(
              "rank ", rank->global(), " parameter '", p.name, "' element ", e,
              ": got ", got[e], ", reference ", want[e]));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> JobRun::ReportedPageableCopies(int64_t each) const {
  int64_t sum = 0;
  for (size_t g = 0; g < responses.size(); ++g) {
    for (size_t k = 0; k < responses[g].size(); ++k) {
      const int64_t copies = responses[g][k].pageable_copies();
      if (copies < each) {
        return absl::FailedPreconditionError(
            absl::StrCat("rank ", g, " answer ", k + 1, " reported ", copies,
                         " pageable copies, fewer than ", each));
      }
      sum += copies;
    }
  }
  return sum;
}

absl::Status JobRun::Deregister(Cluster& cluster) {
  for (const auto& rank : ranks_) {
    v1::DeregisterRequest r;
    r.set_job_id(config_.job_id);
    r.set_job_token(config_.token);
    r.mutable_rank()->set_pp_rank(rank->pp_rank());
    r.mutable_rank()->set_dp_rank(rank->dp_rank());
    r.mutable_rank()->set_tp_rank(rank->tp_rank());
    CANZONA_RETURN_IF_ERROR(
        cluster.engines[rank->engine_index()]->Deregister(r));
  }
  return absl::OkStatus();
}

namespace {

// `status` with its message prefixed by the stage that returned it.
absl::Status InStage(const char* stage, const absl::Status& status) {
  return absl::Status(status.code(),
                      absl::StrCat(stage, ": ", status.message()));
}

}  // namespace

absl::Status RunMatchesReference(Cluster& cluster, JobRun& run, int steps,
                                 bool bitwise, bool deregister,
                                 float tolerance) {
  if (absl::Status s = run.Init(); !s.ok()) return InStage("Init", s);
  if (absl::Status s = run.RunAll(cluster, steps); !s.ok()) {
    return InStage("RunAll", s);
  }
  absl::StatusOr<Params> reference = Reference(run.config(), steps, {});
  if (!reference.ok()) return InStage("Reference", reference.status());
  absl::Status compared = run.Compare(*reference, bitwise, tolerance);
  if (!compared.ok()) {
    compared = InStage(bitwise ? "Compare (bitwise)" : "Compare", compared);
  }
  if (!deregister) return compared;
  absl::Status deregistered = run.Deregister(cluster);
  if (deregistered.ok()) return compared;
  if (compared.ok()) return InStage("Deregister", deregistered);
  return absl::Status(compared.code(),
                      absl::StrCat(compared.message(), "; then Deregister: ",
                                   deregistered.message()));
}

absl::StatusOr<int> StepAfterLoadingParams(Cluster& cluster, JobRun& run,
                                           int step, bool reload) {
  const std::vector<ModelParam>& params = run.config().params;
  std::map<std::string, std::vector<float>> loaded;
  for (size_t i = 0; i < params.size(); ++i) {
    int64_t n = 1;
    for (int64_t d : params[i].shape) n *= d;
    std::vector<float>& values = loaded[params[i].name];
    for (int64_t e = 0; e < n; ++e) {
      // k / 64 with k in [-64, 64]: exact in both dtypes.
      const int64_t k = (e * 37 + static_cast<int64_t>(i) * 11 + step) % 129;
      values.push_back(static_cast<float>(k - 64) / 64.0f);
    }
  }
  CANZONA_RETURN_IF_ERROR(
      run.ForAll(cluster, [&](TrainerRank& rank, Engine& engine) {
        rank.SetParams(loaded);
        rank.WriteGrads(step);
        v1::StepRequest request = rank.MakeStep(step);
        for (const ModelParam& p : params) {
          (*request.mutable_lr())[p.group] = 0;
        }
        if (reload) ReloadEveryHeldParam(params, rank, request);
        Result<v1::StepResponse> done;
        engine.Step(request, done.callback());
        CANZONA_RETURN_IF_ERROR(done.Get().status());
        return run.AwaitParams(cluster, rank, -1);
      }));
  int holding = 0;
  for (auto& rank : run.ranks()) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (rank->Holds(params[i]) &&
          rank->ParamBuffer(static_cast<int>(i)) ==
              rank->Shard(params[i], loaded.at(params[i].name))) {
        ++holding;
      }
    }
  }
  return holding;
}

void ReloadEveryHeldParam(const std::vector<ModelParam>& params,
                          const TrainerRank& rank, v1::StepRequest& request) {
  // Indices into this rank's RegisterRequest.parameters: the ones its
  // stage holds, in order.
  int registered = 0;
  for (const ModelParam& param : params) {
    if (rank.Holds(param)) request.add_reload_params(registered++);
  }
}

}  // namespace canzona::engine_test
