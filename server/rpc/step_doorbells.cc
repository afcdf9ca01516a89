#include "server/rpc/step_doorbells.h"

#include <signal.h>

#include <atomic>
#include <cerrno>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "proto/names/rank_names.h"
#include "proto/shared_memory/shared_memory.h"
#include "proto/shared_memory/step_doorbell.h"
#include "spdlog/spdlog.h"

namespace canzona {
namespace {

namespace v1 = ::canzona::v1;

// How often an idle doorbell thread looks at its stop flag and whether its
// trainer is still alive (and beats the heartbeat the trainer watches).
constexpr absl::Duration kTick = absl::Milliseconds(100);

bool SameRank(const v1::RankCoordinates& a, const v1::RankCoordinates& b) {
  return a.pp_rank() == b.pp_rank() && a.dp_rank() == b.dp_rank() &&
         a.tp_rank() == b.tp_rank();
}

// NOT_FOUND unless the engine holds the rank of the job on this daemon.
absl::Status CheckLocalRank(Engine& engine, const std::string& job_id,
                            const v1::RankCoordinates& rank) {
  const v1::GetStatusResponse status = engine.GetStatus();
  for (const v1::JobStatus& job : status.jobs()) {
    if (job.job_id() != job_id) continue;
    for (const v1::RankStatus& local : job.local_ranks()) {
      if (SameRank(local.rank(), rank)) return absl::OkStatus();
    }
    return absl::NotFoundError(absl::StrCat("rank: ", RankString(rank),
                                            " of job '", job_id,
                                            "' is not registered here"));
  }
  return absl::NotFoundError(
      absl::StrCat("job_id: no job '", job_id, "' on this daemon"));
}

// One call's answer, written once: by the engine's completion, or by the
// doorbell thread when it stops before the engine answered.
struct Answer {
  std::atomic<bool> given{false};
  absl::Notification done;
};

template <typename Response>
void Give(StepDoorbell& bell, Answer& answer, uint32_t seq,
          const absl::StatusOr<Response>& result) {
  if (answer.given.exchange(true)) return;
  if (!result.ok()) {
    bell.Respond(seq, result.status(), {});
  } else if (std::string bytes; !result->SerializeToString(&bytes) ||
                                bytes.size() > StepDoorbell::kMaxPayloadBytes) {
    bell.Respond(seq,
                 absl::InternalError(
                     absl::StrCat("the ", Response::descriptor()->name(),
                                  " does not fit the doorbell; use gRPC")),
                 {});
  } else {
    bell.Respond(seq, absl::OkStatus(), bytes);
  }
  answer.done.Notify();
}

}  // namespace

// One attached doorbell and the thread that serves it.
class StepDoorbells::Served {
 public:
  Served(Engine* engine, std::shared_ptr<StepDoorbell> bell,
         v1::AttachStepDoorbellRequest request, std::optional<pid_t> pid)
      : engine_(engine),
        bell_(std::move(bell)),
        request_(std::move(request)),
        pid_(pid),
        thread_([this] { Serve(); }) {}
  ~Served() { Stop(); }

  void Stop() {
    stop_.store(true);
    bell_->WakeWaiter();
    if (thread_.joinable()) thread_.join();
  }
  bool finished() const { return finished_.load(); }

 private:
  bool TrainerGone() const {
    return pid_.has_value() && ::kill(*pid_, 0) != 0 && errno == ESRCH;
  }

  void Serve() {
    while (!stop_.load()) {
      std::optional<StepDoorbell::Request> got = bell_->WaitRequest(kTick);
      if (!got.has_value()) {
        if (TrainerGone()) {
          // Killed before it could remove the object: /dev/shm would keep
          // it until the node reboots.
          if (absl::Status s = bell_->RemoveNameIfOurs(); !s.ok()) {
            spdlog::warn("step doorbell {}: {}", bell_->name(), s.ToString());
          }
          break;
        }
        continue;
      }
      Handle(*got);
    }
    finished_.store(true);
  }

  void Handle(const StepDoorbell::Request& got) {
    using Method = StepDoorbell::Method;
    switch (got.method) {
      case static_cast<uint32_t>(Method::kStep):
        return Serve(got, &Engine::Step);
      case static_cast<uint32_t>(Method::kGradReady):
        return Serve(got, &Engine::GradReady);
      case static_cast<uint32_t>(Method::kWaitParams):
        return Serve(got, &Engine::WaitParams);
      default:
        bell_->Respond(got.seq,
                       absl::InvalidArgumentError(absl::StrCat(
                           "step doorbell: unknown method ", got.method)),
                       {});
    }
  }

  // Parses the request the method takes, checks it is the attached rank's
  // and hands it to the engine, whose completion answers the trainer.
  template <typename Request, typename Response>
  void Serve(const StepDoorbell::Request& got,
             void (Engine::*method)(const Request&, Callback<Response>)) {
    Request request;
    if (!request.ParseFromString(got.bytes)) {
      bell_->Respond(got.seq,
                     absl::InvalidArgumentError(
                         absl::StrCat("step doorbell: the request is not a ",
                                      Request::descriptor()->full_name())),
                     {});
      return;
    }
    if (request.job_id() != request_.job_id() ||
        !SameRank(request.rank(), request_.rank())) {
      bell_->Respond(
          got.seq,
          absl::InvalidArgumentError(absl::StrCat(
              "job_id/rank: this step doorbell serves job '", request_.job_id(),
              "' rank ", RankString(request_.rank()), ", not job '",
              request.job_id(), "' rank ", RankString(request.rank()))),
          {});
      return;
    }
    auto answer = std::make_shared<Answer>();
    const uint32_t seq = got.seq;
    (engine_->*method)(
        request, [bell = bell_, answer, seq](absl::StatusOr<Response> result) {
          Give(*bell, *answer, seq, result);
        });
    while (!answer->done.WaitForNotificationWithTimeout(kTick)) {
      bell_->Heartbeat();
      if (stop_.load()) {
        Give(*bell_, *answer, seq,
             absl::StatusOr<Response>(absl::UnavailableError(
                 "canzonad stopped serving this doorbell")));
        return;
      }
    }
  }

  Engine* const engine_;
  // Shared with the completions of steps in flight.
  const std::shared_ptr<StepDoorbell> bell_;
  const v1::AttachStepDoorbellRequest request_;
  const std::optional<pid_t> pid_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> finished_{false};
  std::thread thread_;  // last: starts once the rest is set
};

StepDoorbells::StepDoorbells(Engine* engine, int max_doorbells)
    : engine_(engine), max_doorbells_(max_doorbells) {}

StepDoorbells::~StepDoorbells() { StopAll(); }

absl::Status StepDoorbells::Attach(const v1::AttachStepDoorbellRequest& request,
                                   const PeerInfo& peer) {
  if (!peer.uid.has_value()) {
    return absl::FailedPreconditionError(
        "AttachStepDoorbell: a step doorbell is shared memory on the "
        "daemon's node: call it on the daemon's unix socket");
  }
  if (absl::Status s = ValidateShmName(request.shm_name()); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("shm_name: ", s.message()));
  }
  if (absl::Status s =
          CheckLocalRank(*engine_, request.job_id(), request.rank());
      !s.ok()) {
    return s;
  }
  absl::StatusOr<SharedMemory> shm =
      SharedMemory::Open(request.shm_name(), {.expected_owner_uid = *peer.uid});
  if (!shm.ok()) {
    return absl::Status(shm.status().code(),
                        absl::StrCat("shm_name: ", shm.status().message()));
  }
  absl::StatusOr<StepDoorbell> bell = StepDoorbell::Attach(*std::move(shm));
  if (!bell.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm_name: ", bell.status().message()));
  }
  const std::string key = RankKey(request.job_id(), request.rank());
  std::vector<std::unique_ptr<Served>> retired;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return absl::UnavailableError("canzonad is shutting down");
    // The limit counts the doorbells that stay: not the ones whose trainer
    // is gone, nor the one this attach replaces.
    int staying = 0;
    for (const auto& [k, served] : served_) {
      if (!served->finished() && k != key) ++staying;
    }
    if (staying >= max_doorbells_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this daemon serves at most ", max_doorbells_, " step doorbells"));
    }
    for (auto it = served_.begin(); it != served_.end();) {
      if (it->second->finished() || it->first == key) {
        retired.push_back(std::move(it->second));
        it = served_.erase(it);
      } else {
        ++it;
      }
    }
    served_.emplace(
        key, std::make_unique<Served>(
                 engine_, std::make_shared<StepDoorbell>(*std::move(bell)),
                 request, peer.pid));
  }
  retired.clear();  // joins outside the lock
  spdlog::info("step doorbell {} attached: job={} rank={} ({})",
               request.shm_name(), request.job_id(), RankString(request.rank()),
               peer.address);
  return absl::OkStatus();
}

void StepDoorbells::Detach(const std::string& job_id,
                           const v1::RankCoordinates& rank) {
  std::unique_ptr<Served> retired;
  {
    absl::MutexLock lock(&mu_);
    auto it = served_.find(RankKey(job_id, rank));
    if (it == served_.end()) return;
    retired = std::move(it->second);
    served_.erase(it);
  }
}

void StepDoorbells::StopAll() {
  std::map<std::string, std::unique_ptr<Served>> retired;
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    retired.swap(served_);
  }
}

int StepDoorbells::size() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [key, served] : served_) n += served->finished() ? 0 : 1;
  return n;
}

}  // namespace canzona
