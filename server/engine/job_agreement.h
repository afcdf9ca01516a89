// JobAgreement: what the ranks of one job settle through the control plane
// (the coordinator's KvStore), under "canzona/job/<job_id>/":
//  - registration: the job settings (the first rank publishes, the others
//    compare; a token mismatch is UNAUTHENTICATED), each stage's parameter
//    list, one claim per rank, the barrier of all ranks, the stages' lists
//    for the plan, and every rank's plan digest;
//  - collective decisions (checkpoints): every rank publishes its status
//    and a payload, global rank 0 decides and publishes, all return it;
//  - the end: every rank that claimed its place counts itself out, and the
//    last one deletes the job's keys.
// Every wait is sliced so that `interrupted` (shutdown, the job failed)
// ends it promptly instead of after the whole timeout.
//
//   JobAgreement agreement(kv, job.id, [&] { return Interrupted(job); });
//   CANZONA_RETURN_IF_ERROR(agreement.CheckSettings(meta, deadline));
//
// A job id names one incarnation of a job: reusing an id while another
// daemon still holds the old job's keys is not supported.
//
// Thread-safety: thread-safe (the store is); one object per conversation.
#ifndef CANZONA_SERVER_ENGINE_JOB_AGREEMENT_H_
#define CANZONA_SERVER_ENGINE_JOB_AGREEMENT_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "server/control/kv_store.h"

namespace canzona {

// "canzona/job/<job_id>/": every control-plane key of the job starts so.
std::string JobKeyPrefix(absl::string_view job_id);

// Compares two canonical texts line by line and names the first line that
// differs ("<what>[i]: 'x' (this rank) vs 'y' (the job's other ranks)").
std::string FirstDifference(const std::string& mine, const std::string& theirs,
                            absl::string_view what);

class JobAgreement {
 public:
  // OK to go on waiting, else the status a wait returns.
  using Interrupted = std::function<absl::Status()>;

  JobAgreement(KvStore* control, absl::string_view job_id,
               Interrupted interrupted);

  const std::string& prefix() const { return prefix_; }

  // The value of `key` once set; DEADLINE_EXCEEDED naming `what` and the
  // key at the deadline.
  absl::StatusOr<std::string> WaitGet(const std::string& key,
                                      absl::Time deadline,
                                      absl::string_view what) const;

  // Registration, in this order.
  absl::Status CheckSettings(const std::string& meta,
                             absl::Time deadline) const;
  absl::Status CheckParameterList(int stage, const std::string& plist,
                                  absl::Time deadline) const;
  absl::Status ClaimRank(int global,
                         const canzona::v1::RankCoordinates& coords) const;
  absl::Status AwaitAllRanks(int world, absl::Time deadline) const;
  absl::StatusOr<std::vector<std::string>> StageParameterLists(
      int stages, absl::Time deadline) const;
  absl::Status CheckDigest(int global, int world, const std::string& digest,
                           absl::Time deadline) const;

  // A collective decision under `key` (unique per collective and job).
  absl::Status Decide(
      int global, int world, const std::string& key, const absl::Status& local,
      const std::string& payload, absl::Time deadline,
      const std::function<absl::Status(const std::vector<std::string>&)>&
          decide) const;

  // A rank that claimed its place leaves; the last of `world` deletes the
  // job's keys.
  absl::Status RankLeft(int world) const;
  // Deletes every key of the job (its record is gone on this daemon).
  absl::Status DeleteKeys() const;

 private:
  KvStore* const control_;
  const std::string job_id_;
  const std::string prefix_;
  const Interrupted interrupted_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_JOB_AGREEMENT_H_
