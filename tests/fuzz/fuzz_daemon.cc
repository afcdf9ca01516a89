#include "tests/fuzz/fuzz_daemon.h"

#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "server/engine/engine_impl.h"

namespace canzona::fuzz {

Daemon::Daemon() {
  EngineOptions options;
  options.control = &kv_;
  options.daemon_id = "fuzz";
  options.register_timeout = kRegisterTimeout;
  options.step_timeout = kStepTimeout;
  options.required_token = kToken;
  options.max_jobs = kMaxJobs;
  options.max_parameters_per_job = kMaxParameters;
  options.max_bytes_per_job = kMaxBytesPerJob;
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      CreateEngine(std::move(options));
  if (!engine.ok()) Die(engine.status().ToString());
  engine_ = *std::move(engine);
}

Daemon::~Daemon() {
  engine_->Shutdown();
  engine_.reset();
}

Code RegisterAndWait(Tracker& tracker, Engine& engine,
                     const v1::RegisterRequest& request, const PeerInfo& peer) {
  auto [callback, slot] = tracker.Track<v1::RegisterResponse>(Call::kRegister);
  Dump(request);
  engine.Register(request, peer, std::move(callback));
  tracker.WaitAll();
  return slot->code;
}

void GetPlanChecked(Engine& engine, const v1::GetPlanRequest& request) {
  absl::StatusOr<v1::GetPlanResponse> plan = engine.GetPlan(request);
  CheckStatus(Call::kGetPlan, plan.status());
  if (plan.ok() && (plan->digest().empty() || plan->plan_json().empty())) {
    Die("GetPlan OK without a plan");
  }
}

void GetStatusChecked(Engine& engine) {
  v1::GetStatusResponse status = engine.GetStatus();
  for (const v1::JobStatus& job : status.jobs()) {
    if (job.job_id().empty()) Die("GetStatus: a job without an id");
  }
}

void DeregisterChecked(Engine& engine, const v1::DeregisterRequest& request) {
  CheckStatus(Call::kDeregister, engine.Deregister(request));
}

}  // namespace canzona::fuzz
