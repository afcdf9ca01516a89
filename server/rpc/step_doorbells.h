// StepDoorbells: the step doorbells (proto/shared_memory/step_doorbell.h) that local
// trainers attached, the second thin adapter (beside the gRPC service) in
// front of Engine::Step, Engine::GradReady and Engine::WaitParams. Each
// doorbell has its own thread: it reads a request, parses it as the
// request its method word names, checks that it is the attached rank's,
// hands it to the engine and waits for the answer, which the engine's
// completion writes straight into the shared memory (so the trainer wakes
// from the worker thread, with no gRPC completion between). One call per
// doorbell is in flight at a time.
//
//   StepDoorbells doorbells(engine.get());
//   absl::Status s = doorbells.Attach(request, peer);  // AttachStepDoorbell
//   doorbells.Detach(job_id, rank);                     // Deregister
//   engine->Shutdown(); doorbells.StopAll();            // shutdown
//
// A doorbell's thread ends on Detach / StopAll / a new doorbell for the same
// rank, or by itself once the trainer process that attached it is gone.
//
// Owns: the mapped doorbells and their threads. Thread-safety: thread-safe;
// Attach, Detach and StopAll join threads that are woken first, so they
// return within a step's completion or a 100 ms tick.
#ifndef CANZONA_SERVER_RPC_STEP_DOORBELLS_H_
#define CANZONA_SERVER_RPC_STEP_DOORBELLS_H_

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "server/engine/engine.h"

namespace canzona {

class StepDoorbells {
 public:
  static constexpr int kDefaultMaxDoorbells = 1024;

  explicit StepDoorbells(Engine* engine,
                         int max_doorbells = kDefaultMaxDoorbells);
  ~StepDoorbells();
  StepDoorbells(const StepDoorbells&) = delete;
  StepDoorbells& operator=(const StepDoorbells&) = delete;

  // FAILED_PRECONDITION off the unix socket (no uid); INVALID_ARGUMENT /
  // NOT_FOUND / PERMISSION_DENIED naming shm_name, job_id or rank;
  // RESOURCE_EXHAUSTED past the limit; UNAVAILABLE after StopAll. Nothing
  // changes on error.
  absl::Status Attach(const canzona::v1::AttachStepDoorbellRequest& request,
                      const PeerInfo& peer) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops serving the rank's doorbell, if it has one.
  void Detach(const std::string& job_id,
              const canzona::v1::RankCoordinates& rank)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Stops every doorbell; later Attach calls fail with UNAVAILABLE. Call
  // after Engine::Shutdown, which answers the steps in flight.
  void StopAll() ABSL_LOCKS_EXCLUDED(mu_);
  // Doorbells being served (not counting ones whose trainer is gone).
  int size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Served;

  Engine* const engine_;
  const int max_doorbells_;
  mutable absl::Mutex mu_;
  // By "<job_id>/<pp>.<dp>.<tp>".
  std::map<std::string, std::unique_ptr<Served>> served_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_RPC_STEP_DOORBELLS_H_
