// The Engine facade: validates each call, finds its job and rank, and
// hands the work to the rank's worker; the parts live in their own files
// (see the table in server/DESIGN.md section 2.5).
#include "server/engine/engine_impl.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/base/status_macros.h"
#include "kernels/cuda/cuda_backend.h"
#include "proto/names/rank_names.h"
#include "server/engine/cuda_ipc_registry.h"
#include "server/engine/job.h"
#include "server/engine/job_agreement.h"
#include "server/engine/job_registry.h"
#include "server/engine/phase_seconds.h"
#include "server/engine/rank_checkpoint.h"
#include "server/engine/rank_step.h"
#include "server/engine/register_request.h"
#include "server/engine/registration.h"
#include "server/engine/step_messages.h"
#include "server/engine/trainer_buffers.h"
#include "server/engine/trainer_watcher.h"
#include "server/plan/plan_json.h"
#include "spdlog/spdlog.h"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;

constexpr char kVersion[] = "0.1.0";

class EngineImpl final : public Engine {
 public:
  explicit EngineImpl(EngineOptions options);
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
  // Validates the job and rank, then runs `work` on the rank's worker (in
  // order with its steps, after its DP lane is idle) and hands its result
  // to `done`. With at_step > 0, `work` runs right after the rank's step
  // at_step.
  template <typename Response>
  void RunOnRank(const std::string& job_id, const v1::RankCoordinates& coords,
                 Callback<Response> done,
                 std::function<absl::StatusOr<Response>(Job&, LocalRank&)> work,
                 int64_t at_step = 0, bool after_failure = false);
  // Runs (or, when the rank is gone, cancels) what waited for step k.
  void RunAfterStep(Job& job, LocalRank& rank, int64_t k);
  // The worker's step task.
  void RunStep(std::shared_ptr<Job> job, std::shared_ptr<LocalRank> rank,
               const RankStepRequest& request, Callback<v1::StepResponse> done);
  // Step's checks before the rank accepts step k; `accepted` receives
  // what the step reads. `repeated`: the request names the rank's last
  // accepted step again, which does not run again (AnswerRepeatedStep).
  absl::StatusOr<std::shared_ptr<LocalRank>> AcceptStep(
      Job& job, const v1::StepRequest& request, RankStepRequest* accepted,
      bool* repeated);
  // Answers a Step that named the rank's step k again with k's own answer,
  // once k completed.
  void AnswerRepeatedStep(std::shared_ptr<Job> job,
                          std::shared_ptr<LocalRank> rank, int64_t k,
                          Callback<v1::StepResponse> done);
  JobAgreement AgreementFor(Job& job);
  absl::Status Unavailable() const { return JobRegistry::Unavailable(); }

  const EngineOptions options_;
  // CUDA IPC buffers of GPU trainers (opened once per allocation).
  CudaIpcOpener* const cuda_ipc_;
  const std::unique_ptr<CudaIpcRegistry> ipc_registry_;
  JobRegistry registry_;
  std::unique_ptr<Registration> registration_;
  // Declared last: stopped first.
  std::unique_ptr<TrainerWatcher> watcher_;
};

EngineImpl::EngineImpl(EngineOptions options)
    : options_(std::move(options)),
      cuda_ipc_(options_.cuda_ipc != nullptr ? options_.cuda_ipc
                                             : RealCudaIpcOpener()),
      ipc_registry_(std::make_unique<CudaIpcRegistry>(cuda_ipc_)),
      registry_(JobRegistry::Options{
          options_.daemon_id, options_.control, options_.max_jobs,
          options_.max_bytes_per_job,
          std::min(options_.step_timeout, absl::Seconds(5)), options_.metrics,
          options_.metrics_retention}) {
  registration_ = std::make_unique<Registration>(
      options_, &registry_, cuda_ipc_,
      [this](Job& job) { return AgreementFor(job); });
  watcher_ = std::make_unique<TrainerWatcher>(absl::Milliseconds(200),
                                              [this] { registry_.Tick(); });
}

JobAgreement EngineImpl::AgreementFor(Job& job) {
  return JobAgreement(options_.control, job.id, [this, &job]() -> absl::Status {
    if (registry_.closed()) return Unavailable();
    if (job.failed()) return job.FailedError();
    return absl::OkStatus();
  });
}

// ---------------------------------------------------------------------------
// Register: validation and mapping (inline), then the worker's part.

void EngineImpl::Register(const v1::RegisterRequest& request,
                          const PeerInfo& peer,
                          Callback<v1::RegisterResponse> done) {
  if (registry_.closed()) return done(Unavailable());
  auto rejected = [&](const absl::Status& s, bool with_peer) {
    spdlog::warn("register rejected: job={} rank=({},{},{}){}: {}",
                 request.job_id(), request.rank().pp_rank(),
                 request.rank().dp_rank(), request.rank().tp_rank(),
                 with_peer ? absl::StrCat(" peer=", peer.address) : "",
                 s.ToString());
    done(s);
  };
  absl::StatusOr<RankSpec> spec = ValidateRegisterRequest(
      request, {options_.required_token, options_.max_parameters_per_job});
  if (!spec.ok()) return rejected(spec.status(), true);
  TrainerBuffers::Options map_options;
  map_options.owner_uid = peer.uid;
  map_options.registry = ipc_registry_.get();
  map_options.opener = cuda_ipc_;
  map_options.cuda_devices = [this] { return NodeCudaDevices(options_); };
  map_options.max_bytes = options_.max_bytes_per_job;
  map_options.event_timeout = options_.step_timeout;
  absl::StatusOr<std::unique_ptr<TrainerBuffers>> buffers =
      TrainerBuffers::Map(request, spec->fragment_numel, map_options);
  if (!buffers.ok()) return rejected(buffers.status(), true);
  auto rank = std::make_shared<LocalRank>(spec->coords, spec->global,
                                          TrainerProcess::Watch(peer.pid),
                                          *std::move(buffers));
  absl::StatusOr<std::shared_ptr<Job>> job =
      registry_.Admit(request, *spec, rank);
  if (!job.ok()) return rejected(job.status(), false);
  spdlog::info("rank registering: job={} rank={} global={} daemon={}",
               (*job)->id, RankString(rank->coords), rank->global,
               options_.daemon_id);
  auto shared_done =
      std::make_shared<Callback<v1::RegisterResponse>>(std::move(done));
  Worker::Task task;
  task.run = [this, job = *job, rank, plist = spec->plist, shared_done]() {
    registration_->Run(job, rank, plist, std::move(*shared_done));
  };
  task.cancel = [this, shared_done]() { (*shared_done)(Unavailable()); };
  if (!rank->worker->Post(task)) task.cancel();
}

// ---------------------------------------------------------------------------
// Step.

absl::StatusOr<std::shared_ptr<LocalRank>> EngineImpl::AcceptStep(
    Job& job, const v1::StepRequest& request, RankStepRequest* accepted,
    bool* repeated) {
  const v1::RankCoordinates& r = request.rank();
  const v1::WorldLayout& l = job.settings.layout;
  CANZONA_RETURN_IF_ERROR(CheckRankInLayout(l, r));
  if (!(request.grad_scale() >= 0) || !std::isfinite(request.grad_scale())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grad_scale ", request.grad_scale(), " must be finite and >= 0"));
  }
  // What the step reads, checked before anything changes.
  CANZONA_ASSIGN_OR_RETURN(*accepted,
                           ToRankStepRequest(request, job.settings.configs));
  absl::MutexLock lock(&job.mu);
  if (job.state == JobState::kFailed) {
    return absl::FailedPreconditionError(
        absl::StrCat("job failed: ", job.failure));
  }
  if (job.state != JobState::kReady) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id, "' is not ready: ranks are still registering"));
  }
  auto it = job.ranks.find(GlobalRank(l, r));
  if (it == job.ranks.end()) {
    return absl::NotFoundError(
        absl::StrCat("rank ", RankString(r), " of job '", job.id,
                     "' is not registered with this daemon"));
  }
  std::shared_ptr<LocalRank> rank = it->second;
  for (size_t k = 0; k < accepted->reload_params.size(); ++k) {
    const int j = accepted->reload_params[k];
    if (j < 0 || j >= rank->buffers->count()) {
      return absl::InvalidArgumentError(
          absl::StrCat("reload_params[", k, "] = ", j, " outside [0, ",
                       rank->buffers->count(), ")"));
    }
  }
  RankProgress& progress = job.progress(*rank);
  // The trainer asks again for the step it last called (Ctrl-C in a
  // notebook interrupted its wait, or its answer was lost): the step runs
  // once, and this call gets its answer.
  *repeated =
      progress.last_accepted > 0 && request.step() == progress.last_accepted;
  if (*repeated) return rank;
  if (request.step() != progress.next_step) {
    return absl::FailedPreconditionError(
        absl::StrCat("step out of order: expected step ", progress.next_step,
                     ", got ", request.step()));
  }
  progress.last_accepted = progress.next_step++;
  ++job.arrivals[request.step()];
  job.cv.SignalAll();
  // Every gradient is final now: reduce what GradReady did not start.
  // Under job.mu, so that a GradReady of the next step (accepted once
  // next_step moved) can never reach the lane first.
  rank->lane().MarkAllReady(request.step());
  return rank;
}

void EngineImpl::Step(const v1::StepRequest& request,
                      Callback<v1::StepResponse> done) {
  if (registry_.closed()) return done(Unavailable());
  if (!std::isfinite(request.max_grad_norm()) || request.max_grad_norm() < 0) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("max_grad_norm ", request.max_grad_norm(),
                     " must be finite and > 0 (0: the job's)")));
  }
  absl::StatusOr<std::shared_ptr<Job>> job =
      registry_.FindJob(request.job_id());
  if (!job.ok()) return done(job.status());
  auto accepted = std::make_shared<RankStepRequest>();
  bool repeated = false;
  absl::StatusOr<std::shared_ptr<LocalRank>> rank =
      AcceptStep(**job, request, accepted.get(), &repeated);
  if (!rank.ok()) return done(rank.status());
  if (repeated) {
    return AnswerRepeatedStep(*job, *rank, request.step(), std::move(done));
  }
  auto shared_done =
      std::make_shared<Callback<v1::StepResponse>>(std::move(done));
  Worker::Task task;
  task.run = [this, job = *job, rank = *rank, accepted, shared_done]() {
    RunStep(job, rank, *accepted, std::move(*shared_done));
  };
  task.cancel = [this, shared_done]() { (*shared_done)(Unavailable()); };
  if (!(*rank)->worker->Post(task)) task.cancel();
}

void EngineImpl::AnswerRepeatedStep(std::shared_ptr<Job> job,
                                    std::shared_ptr<LocalRank> rank, int64_t k,
                                    Callback<v1::StepResponse> done) {
  auto shared_done =
      std::make_shared<Callback<v1::StepResponse>>(std::move(done));
  Worker::Task task;
  // RunAfterStep runs it after k's answer, or after k failed.
  task.run = [job, rank, k, shared_done]() {
    (*shared_done)(job->CompletedStep(*rank, k));
  };
  task.cancel = [this, shared_done]() { (*shared_done)(Unavailable()); };
  {
    absl::MutexLock lock(&job->mu);
    RankProgress& progress = job->progress(*rank);
    if (progress.steps_done < k) {
      progress.after_step[k].push_back(std::move(task));
      return;
    }
  }
  task.run();
}

void EngineImpl::RunStep(std::shared_ptr<Job> job,
                         std::shared_ptr<LocalRank> rank,
                         const RankStepRequest& request,
                         Callback<v1::StepResponse> done) {
  const absl::Time start = absl::Now();
  const int64_t k = request.step;
  absl::Status status =
      job->AwaitLocalArrivals(k, start + options_.step_timeout,
                              options_.step_timeout, registry_.closed_flag());
  RankStepResult result;
  result.seconds.wait = Seconds(start, absl::Now());
  if (status.ok()) {
    const StepContext context{job->id, job->settings.layout.dp(),
                              job->settings.world, job->settings.max_grad_norm,
                              options_.step_timeout};
    status = RunRankStep(*rank, rank->rt->plan(), context, request, &result);
  }
  if (!status.ok()) {
    if (registry_.closed()) {
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
      registry_.FailJob(*job, status);
    }
    spdlog::error("step failed: job={} rank={} step={}: {}", job->id,
                  RankString(rank->coords), k, status.ToString());
    done(status);
    RunAfterStep(*job, *rank, -1);
    return;
  }
  PhaseSeconds& times = result.seconds;
  times.total = Seconds(start, absl::Now());
  rank->lane().TakeTimes(&times.dp_comm, &times.dp_comm_exposed);
  if (RankRuntime& rt = *rank->rt; rt.metrics() != nullptr) {
    const bool skipped = result.skipped_nonfinite;
    rt.metrics()->RecordStep(result, skipped ? 0 : rt.tp_lane().comm_seconds(),
                             skipped ? 0 : rt.tp_lane().hidden_seconds());
  }
  const v1::StepResponse response = ToStepResponse(result);
  {
    absl::MutexLock lock(&job->mu);
    RankProgress& progress = job->progress(*rank);
    progress.steps_done = k;
    progress.last_response = response;
    progress.last = response.seconds();
    progress.pageable_copies += response.pageable_copies();
  }
  done(response);
  RunAfterStep(*job, *rank, k);
}

// ---------------------------------------------------------------------------
// Overlap with the trainer: bucket events.

void EngineImpl::GradReady(const v1::GradReadyRequest& request,
                           Callback<v1::GradReadyResponse> done) {
  if (registry_.closed()) return done(Unavailable());
  auto found = registry_.FindReadyRank(request.job_id(), request.rank());
  if (!found.ok()) return done(found.status());
  auto [job, rank] = *std::move(found);
  const int buckets = rank->lane().buckets();
  for (int j = 0; j < request.buckets_size(); ++j) {
    const int b = request.buckets(j);
    if (b < 0 || b >= buckets) {
      return done(absl::InvalidArgumentError(absl::StrCat(
          "buckets[", j, "] = ", b, " outside [0, ", buckets, ")")));
    }
  }
  {
    absl::MutexLock lock(&job->mu);
    const int64_t next = job->progress(*rank).next_step;
    if (request.step() != next) {
      return done(absl::FailedPreconditionError(absl::StrCat(
          "step ", request.step(), ": GradReady must name the next step, ",
          next, ", before its Step call")));
    }
    // What the trainer's gradients event means now, before the lane may
    // take these buckets (and before the trainer can record it again).
    rank->rt->buckets().CaptureGradients(
        request.step(), absl::MakeConstSpan(request.buckets().data(),
                                            request.buckets_size()));
    // Under job->mu: ordered with Step's MarkAllReady of the step before.
    rank->lane().MarkReady(request.step(), request.buckets());
  }
  done(v1::GradReadyResponse());
}

void EngineImpl::WaitParams(const v1::WaitParamsRequest& request,
                            Callback<v1::WaitParamsResponse> done) {
  if (registry_.closed()) return done(Unavailable());
  // Also once the job failed: a peer that finished and deregistered fails
  // the job, but this rank's last all-gathers still complete (the peer
  // lingers) or fail, and the lane reports which.
  auto found = registry_.FindReadyRank(request.job_id(), request.rank(),
                                       /*after_failure=*/true);
  if (!found.ok()) return done(found.status());
  auto [job, rank] = *std::move(found);
  const int buckets = rank->lane().buckets();
  if (request.bucket() < -1 || request.bucket() >= buckets) {
    return done(absl::InvalidArgumentError(absl::StrCat(
        "bucket ", request.bucket(), " outside [-1, ", buckets, ")")));
  }
  {
    absl::MutexLock lock(&job->mu);
    const int64_t next = job->progress(*rank).next_step;
    if (request.step() < 1 || request.step() >= next) {
      return done(absl::FailedPreconditionError(absl::StrCat(
          "step ", request.step(),
          ": WaitParams needs a step Step was called for (the last is ",
          next - 1, ")")));
    }
  }
  // The lane calls back from its thread (or at once); nothing here holds
  // the rank, so the last reference never dies on that thread.
  rank->lane().WhenGathered(
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
  CANZONA_ASSIGN_OR_RETURN(std::shared_ptr<Job> job,
                           registry_.FindJobOrRecord(request.job_id()));
  const std::shared_ptr<const JobPlan> jp = job->current_plan();
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
  if (registry_.closed()) return Unavailable();
  CANZONA_ASSIGN_OR_RETURN(std::shared_ptr<Job> job,
                           registry_.FindJob(request.job_id()));
  const v1::RankCoordinates& r = request.rank();
  if (request.job_token() != job->token) {
    return absl::UnauthenticatedError(
        absl::StrCat("job_token does not match job '", job->id, "'"));
  }
  const v1::WorldLayout& l = job->settings.layout;
  const bool inside = CheckRankInLayout(l, r).ok();
  if (!inside || !registry_.RemoveLocalRank(
                     job, GlobalRank(l, r),
                     absl::StrCat("rank ", RankString(r), " deregistered"),
                     /*graceful=*/true)) {
    return absl::NotFoundError(
        absl::StrCat("rank ", RankString(r), " of job '", job->id,
                     "' is not registered with this daemon"));
  }
  return absl::OkStatus();
}

v1::GetStatusResponse EngineImpl::GetStatus() {
  v1::GetStatusResponse response;
  response.set_version(kVersion);
  response.set_backend(options_.backend);
  response.set_comm(options_.comm);
  for (const std::shared_ptr<Job>& job : registry_.Jobs()) {
    absl::MutexLock lock(&job->mu);
    v1::JobStatus* js = response.add_jobs();
    js->set_job_id(job->id);
    *js->mutable_layout() = job->settings.layout;
    js->set_strategy(job->settings.strategy_name);
    if (job->plan) js->set_plan_digest(job->plan->plan.digest);
    js->set_state(job->StateString());
    js->set_registered_ranks(job->barrier_passed
                                 ? job->settings.world
                                 : static_cast<int>(job->ranks.size()));
    for (auto& [g, r] : job->ranks) {
      v1::RankStatus* rs = js->add_local_ranks();
      *rs->mutable_rank() = r->coords;
      const RankProgress& progress = job->progress(*r);
      rs->set_steps_done(progress.steps_done);
      *rs->mutable_last_step_seconds() = progress.last;
      rs->set_device(progress.device);
      rs->set_pci_bus_id(progress.pci_bus_id);
      rs->set_pageable_host_bytes(progress.pageable_host_bytes);
      rs->set_pageable_copies(progress.pageable_copies);
    }
  }
  return response;
}

void EngineImpl::Shutdown() {
  registry_.Close();
  watcher_->Stop();
}

// ---------------------------------------------------------------------------
// Work on a ready rank: checkpoints and state transfers.

template <typename Response>
void EngineImpl::RunOnRank(
    const std::string& job_id, const v1::RankCoordinates& coords,
    Callback<Response> done,
    std::function<absl::StatusOr<Response>(Job&, LocalRank&)> work,
    int64_t at_step, bool after_failure) {
  if (registry_.closed()) return done(Unavailable());
  auto found = registry_.FindReadyRank(job_id, coords, after_failure);
  if (!found.ok()) return done(found.status());
  auto [job, rank] = *std::move(found);
  auto shared_done = std::make_shared<Callback<Response>>(std::move(done));
  Worker::Task task;
  task.run = [this, job = job, rank = rank, work = std::move(work), shared_done,
              after_failure]() {
    // The last step's background all-gathers finish first: checkpoints
    // and imports must not race the DP lane; nor its copies in flight
    // (reductions of a next step's buckets leave theirs so). The hand-over
    // drives the DP copier, so it runs on the lane's thread: an
    // overlapping trainer may have the lane reduce its next step's buckets
    // by now.
    rank->lane().WaitIdle();
    RankRuntime* rt = rank->rt.get();
    absl::Status handed =
        rank->lane().RunOnLane([rt] { return rt->AfterReductions(); });
    if (!handed.ok() && !after_failure) return (*shared_done)(handed);
    if (!handed.ok()) {
      spdlog::warn("rank {}: the DP lane's copies: {}",
                   RankString(rank->coords), handed.ToString());
    }
    absl::StatusOr<Response> result = work(*job, *rank);
    if (!result.ok() && registry_.closed()) result = Unavailable();
    (*shared_done)(std::move(result));
  };
  task.cancel = [this, shared_done]() { (*shared_done)(Unavailable()); };
  if (at_step > 0) {
    absl::Status past;
    {
      absl::MutexLock lock(&job->mu);
      RankProgress& progress = job->progress(*rank);
      if (progress.next_step > at_step + 1) {
        past = absl::FailedPreconditionError(
            absl::StrCat("at_step ", at_step, ": rank ",
                         RankString(rank->coords), " is already past it (step ",
                         progress.next_step - 1, " was called)"));
      } else if (progress.steps_done < at_step) {
        progress.after_step[at_step].push_back(std::move(task));
        return;
      }
    }
    if (!past.ok()) return (*shared_done)(past);
  }
  if (!rank->worker->Post(task)) task.cancel();
}

void EngineImpl::RunAfterStep(Job& job, LocalRank& rank, int64_t k) {
  // After a failed step (k < 0) everything waiting runs now and fails on
  // the failed job instead of waiting forever.
  for (Worker::Task& task : job.TakeAfterStep(rank, k)) task.run();
}

void EngineImpl::SaveCheckpoint(const v1::SaveCheckpointRequest& request,
                                Callback<v1::SaveCheckpointResponse> done) {
  absl::StatusOr<std::string> dir =
      ValidateCheckpointDir(request.dir(), options_.checkpoint_root);
  if (!dir.ok()) return done(dir.status());
  if (request.at_step() < 0) {
    return done(absl::InvalidArgumentError(
        absl::StrCat("at_step ", request.at_step(), " must be >= 0")));
  }
  RunOnRank<v1::SaveCheckpointResponse>(
      request.job_id(), request.rank(), std::move(done),
      [this, dir = *dir](Job& job, LocalRank& rank) {
        return SaveRankCheckpoint(job, rank, AgreementFor(job), dir,
                                  options_.checkpoint_timeout);
      },
      request.at_step());
}

void EngineImpl::LoadCheckpoint(const v1::LoadCheckpointRequest& request,
                                Callback<v1::LoadCheckpointResponse> done) {
  absl::StatusOr<std::string> dir =
      ValidateCheckpointDir(request.dir(), options_.checkpoint_root);
  if (!dir.ok()) return done(dir.status());
  RunOnRank<v1::LoadCheckpointResponse>(
      request.job_id(), request.rank(), std::move(done),
      [this, dir = *dir, allow_missing = request.allow_missing()](
          Job& job, LocalRank& rank) {
        return LoadRankCheckpoint(job, rank, AgreementFor(job), dir,
                                  options_.checkpoint_timeout, allow_missing);
      });
}

void EngineImpl::ExportState(const v1::ExportStateRequest& request,
                             Callback<v1::ExportStateResponse> done) {
  RunOnRank<v1::ExportStateResponse>(
      request.job_id(), request.rank(), std::move(done),
      [request](Job& job, LocalRank& rank) {
        return rank.transfer.Read(
            request, [&job, &rank] { return ExportRankState(job, rank); });
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
        CANZONA_ASSIGN_OR_RETURN(std::optional<v1::ImportStateRequest> whole,
                                 rank.transfer.Add(request));
        if (!whole.has_value()) {
          v1::ImportStateResponse received;
          received.set_step(request.step());
          received.set_received_bytes(rank.transfer.received_bytes());
          return received;
        }
        CANZONA_ASSIGN_OR_RETURN(v1::ImportStateResponse imported,
                                 ImportRankState(job, rank, *whole));
        imported.set_received_bytes(
            static_cast<int64_t>(whole->state().size()));
        return imported;
      });
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
