#include "server/engine/registration.h"

#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/base/status_macros.h"
#include "proto/names/rank_names.h"
#include "server/engine/rank_setup.h"
#include "server/engine/register_request.h"
#include "server/metrics/canzona_metrics.h"
#include "server/plan/planner.h"
#include "spdlog/spdlog.h"

namespace canzona {

Registration::Registration(const EngineOptions& options, JobRegistry* registry,
                           CudaIpcOpener* cuda_ipc, AgreementFor agreement_for)
    : options_(options),
      registry_(registry),
      cuda_ipc_(cuda_ipc),
      agreement_for_(std::move(agreement_for)) {}

void Registration::Run(const std::shared_ptr<Job>& job,
                       const std::shared_ptr<LocalRank>& rank,
                       const std::string& plist,
                       Callback<v1::RegisterResponse> done) const {
  if (absl::Status s = Agree(*job, *rank, plist); !s.ok()) {
    spdlog::warn("register rejected: job={} rank={}: {}", job->id,
                 RankString(rank->coords), s.ToString());
    registry_->RemoveRefused(job, rank);
    return done(s);
  }
  if (absl::Status s = Setup(*job, *rank); !s.ok()) {
    registry_->FailJob(*job, s);
    return done(s);
  }
  MarkReady(*job, *rank, std::move(done));
}

absl::Status Registration::Agree(Job& job, LocalRank& rank,
                                 const std::string& plist) const {
  registry_->FlushDepartures();
  const JobAgreement agreement = agreement_for_(job);
  const absl::Time deadline = absl::Now() + options_.register_timeout;
  // The first rank of the job (on any daemon) publishes the job settings
  // and a hash of the token; every other rank compares. The data plane is
  // the daemons' setting, but all must agree: Gloo and NCCL ranks cannot
  // form a group.
  const std::string meta = absl::StrCat(
      "token=", plan::Fnv1a64Hex(absl::StrCat("canzona-token:", job.token)),
      "\n", job.settings.meta, "\ncomm=", options_.comm);
  CANZONA_RETURN_IF_ERROR(agreement.CheckSettings(meta, deadline));
  CANZONA_RETURN_IF_ERROR(
      agreement.CheckParameterList(rank.coords.pp_rank(), plist, deadline));
  CANZONA_RETURN_IF_ERROR(agreement.ClaimRank(rank.global, rank.coords));
  absl::MutexLock lock(&job.mu);
  job.progress(rank).claimed = true;
  return absl::OkStatus();
}

absl::Status Registration::Setup(Job& job, LocalRank& rank) const {
  const JobAgreement agreement = agreement_for_(job);
  CANZONA_RETURN_IF_ERROR(agreement.AwaitAllRanks(
      job.settings.world, absl::Now() + options_.register_timeout));
  int local_ranks = 0;
  // On the NCCL plane, the local ranks' GPUs (RankGpu; taken while the
  // ranks are surely alive). The Gloo plane asks CUDA nothing here.
  const bool nccl = options_.comm == "nccl";
  const int devices = nccl ? NodeCudaDevices(options_) : 0;
  std::map<int, LocalGpu> gpus;  // by global rank
  {
    absl::MutexLock lock(&job.mu);
    job.barrier_passed = true;
    local_ranks = static_cast<int>(job.ranks.size());
    for (const auto& [global, r] : job.ranks) {
      const TrainerBuffers* trainer = r->buffers.get();
      if (nccl) {
        gpus[global] = {RankGpu(trainer, global, devices),
                        trainer != nullptr && trainer->on_device()};
      }
    }
  }
  if (nccl) CANZONA_RETURN_IF_ERROR(CheckOneRankPerGpu(job.id, gpus, devices));
  CANZONA_ASSIGN_OR_RETURN(std::shared_ptr<const JobPlan> jp, EnsurePlan(job));
  CANZONA_RETURN_IF_ERROR(
      agreement.CheckDigest(rank.global, job.settings.world, jp->plan.digest,
                            absl::Now() + options_.register_timeout));

  RankSetup setup;
  setup.job_id = job.id;
  setup.settings = &job.settings;
  setup.coords = rank.coords;
  setup.global = rank.global;
  setup.plan = jp;
  setup.trainer = rank.buffers.get();
  setup.local_ranks = local_ranks;
  setup.control = options_.control;
  setup.backend = options_.backend;
  setup.nccl = options_.comm == "nccl";
  setup.nccl_api = options_.nccl_api;
  setup.device_like_cpu = options_.device_like_cpu;
  setup.cuda_devices = [this] { return NodeCudaDevices(options_); };
  setup.pci_bus_id = [this](int device) {
    return cuda_ipc_->PciBusIdOf(device);
  };
  setup.comm_host = options_.comm_host;
  setup.step_timeout = options_.step_timeout;
  setup.metrics = options_.metrics;
  setup.batch_updates = options_.batch_updates;
  setup.on_communicator = [&rank](Communicator* c) { rank.AddComm(c); };
  setup.on_failure = [&rank] { rank.ForgetComms(); };
  CANZONA_ASSIGN_OR_RETURN(rank.rt, SetupRank(setup, &rank.response));
  BucketCollectives* buckets = &rank.rt->buckets();
  rank.SetLane(std::make_unique<DpLane>(
      static_cast<int>(rank.rt->layout().buckets.size()),
      [buckets](int64_t k, int b) { return buckets->Reduce(b, k); },
      [buckets](int64_t, int b) { return buckets->Gather(b); }));
  return absl::OkStatus();
}

// NCCL runs one rank of a communicator per GPU: 2.28 refuses two with
// "Duplicate GPU detected", and only once the whole group has connected.
// The job's local ranks each know their GPU (RankGpu) before that.
absl::Status Registration::CheckOneRankPerGpu(
    const std::string& job_id, const std::map<int, LocalGpu>& gpus,
    int devices) const {
  std::map<int, int> rank_on_gpu;
  for (const auto& [global, gpu] : gpus) {
    auto [other, first] = rank_on_gpu.emplace(gpu.device, global);
    if (first) continue;
    const bool ipc = gpu.ipc || gpus.at(other->second).ipc;
    return absl::FailedPreconditionError(absl::StrCat(
        "comm 'nccl' runs one rank per GPU: ranks ", other->second, " and ",
        global, " of job '", job_id, "' both use GPU ", gpu.device,
        ipc ? " (their tensors' param.cuda_ipc.pci_bus_id)"
            : absl::StrCat(" (global rank modulo the ", devices, " GPUs)"),
        "; give each trainer its own GPU (torch.cuda.set_device(local_rank)) "
        "or run the daemon with --comm=gloo"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const JobPlan>> Registration::EnsurePlan(
    Job& job) const {
  absl::MutexLock plan_lock(&job.plan_mu);
  if (std::shared_ptr<const JobPlan> built = job.current_plan()) return built;
  const JobAgreement agreement = agreement_for_(job);
  CANZONA_ASSIGN_OR_RETURN(
      std::vector<std::string> lists,
      agreement.StageParameterLists(job.settings.layout.pp(),
                                    absl::Now() + options_.register_timeout));
  CANZONA_ASSIGN_OR_RETURN(std::shared_ptr<const JobPlan> jp,
                           BuildJobPlan(job.settings, lists));
  spdlog::info(
      "plan built: job={} daemon={} strategy={} params={} buckets={} "
      "micro_groups={} makespan/mean={:.3f} digest={}",
      job.id, options_.daemon_id, job.settings.strategy_name, jp->params.size(),
      jp->plan.buckets.size(), jp->plan.micro_groups.size(),
      jp->plan.max_over_mean(), jp->plan.digest);
  absl::MutexLock lock(&job.mu);
  job.plan = jp;
  return jp;
}

void Registration::MarkReady(Job& job, LocalRank& rank,
                             Callback<v1::RegisterResponse> done) const {
  std::vector<std::pair<Callback<v1::RegisterResponse>, v1::RegisterResponse>>
      fire;
  absl::Status failed;
  {
    absl::MutexLock lock(&job.mu);
    if (job.state == JobState::kFailed) {
      failed = absl::AbortedError(absl::StrCat("job failed: ", job.failure));
    } else {
      RankProgress& progress = job.progress(rank);
      progress.setup_done = true;
      if (!rank.rt->pci_bus_id().empty()) {
        progress.device = rank.rt->device();
        progress.pci_bus_id = rank.rt->pci_bus_id();
      }
      progress.pageable_host_bytes = rank.rt->pageable_host_bytes();
      progress.register_done = std::move(done);
      ++job.setup_done;
      if (job.setup_done == static_cast<int>(job.ranks.size())) {
        job.state = JobState::kReady;
        for (auto& [g, r] : job.ranks) {
          RankProgress& p = job.progress(*r);
          fire.emplace_back(std::move(p.register_done), r->response);
          p.register_done = nullptr;
        }
        job.cv.SignalAll();
      }
    }
  }
  if (!failed.ok()) return done(failed);
  if (!fire.empty()) {
    spdlog::info("job ready: job={} daemon={} local_ranks={} digest={}", job.id,
                 options_.daemon_id, fire.size(), rank.response.plan_digest());
    const std::shared_ptr<const JobPlan> jp = job.current_plan();
    if (options_.metrics != nullptr && jp != nullptr) {
      const CanzonaMetrics m = CanzonaMetrics::Register(options_.metrics);
      m.plan_max_over_mean->Shared({job.id})->Set(jp->plan.max_over_mean());
      m.plan_makespan_over_lb->Shared({job.id})->Set(
          jp->plan.makespan_over_lb());
      m.registered_parameters->Shared({job.id})->Set(
          static_cast<double>(jp->params.size()));
    }
  }
  for (auto& [cb, response] : fire) cb(response);
}

}  // namespace canzona
