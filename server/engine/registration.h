// Registration: the part of Register that runs on the rank's worker, after
// validation and admission: (1) the agreement checks with the job's other
// ranks (settings, parameter list, the rank's claim; a failure here undoes
// this rank's admission), (2) the barrier of all the job's ranks on every
// daemon, (3) the plan, built once per job on this daemon from the stages'
// parameter lists, and the digests every rank must agree on, (4) the rank's
// runtime and DP lane, and (5) readiness: Register returns for every local
// rank together once all are set up, so no trainer steps into a half-built
// job.
//
//   Registration registration(options, &registry, cuda_ipc, agreement_for);
//   worker.Post({.run = [&] { registration.Run(job, rank, plist, done); }});
//
// Thread-safety: Run is called on the registering rank's worker; the
// object itself is immutable and shared by every rank.
#ifndef CANZONA_SERVER_ENGINE_REGISTRATION_H_
#define CANZONA_SERVER_ENGINE_REGISTRATION_H_

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "server/engine/engine_options.h"
#include "server/engine/job.h"
#include "server/engine/job_agreement.h"
#include "server/engine/job_registry.h"

namespace canzona {

class Registration {
 public:
  using AgreementFor = std::function<JobAgreement(Job&)>;

  // `options`, `registry` and `cuda_ipc` (which names GPUs by PCI bus id)
  // must outlive the object.
  Registration(const EngineOptions& options, JobRegistry* registry,
               CudaIpcOpener* cuda_ipc, AgreementFor agreement_for);

  void Run(const std::shared_ptr<Job>& job,
           const std::shared_ptr<LocalRank>& rank, const std::string& plist,
           Callback<canzona::v1::RegisterResponse> done) const;

 private:
  // (1) FAILED_PRECONDITION / UNAUTHENTICATED / ALREADY_EXISTS on
  // disagreement.
  absl::Status Agree(Job& job, LocalRank& rank, const std::string& plist) const;
  // (2)-(4).
  absl::Status Setup(Job& job, LocalRank& rank) const;
  // A local rank's GPU, and whether its trainer's tensors named it.
  struct LocalGpu {
    int device = 0;
    bool ipc = false;
  };
  // (2) FAILED_PRECONDITION where two of the job's local ranks (by global
  // rank) would run NCCL on one GPU (of the node's `devices`).
  absl::Status CheckOneRankPerGpu(const std::string& job_id,
                                  const std::map<int, LocalGpu>& gpus,
                                  int devices) const;
  // (3) The job's plan, built once on this daemon.
  absl::StatusOr<std::shared_ptr<const JobPlan>> EnsurePlan(Job& job) const;
  // (5) Marks the rank set up; the last local rank fires every Register.
  void MarkReady(Job& job, LocalRank& rank,
                 Callback<canzona::v1::RegisterResponse> done) const;

  const EngineOptions& options_;
  JobRegistry* const registry_;
  CudaIpcOpener* const cuda_ipc_;
  const AgreementFor agreement_for_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_REGISTRATION_H_
