// One rank's part of the job's checkpoints and state transfers:
//  - SaveRankCheckpoint: writes the rank's shard (one record per
//    parameter, written by exactly one rank job-wide; TP fragments of
//    element-wise state are gathered to whole tensors first), then every
//    rank's shard reaches global rank 0, which commits the manifest only if
//    every rank saved at the same step;
//  - LoadRankCheckpoint: validates the checkpoint, loads what the rank
//    owns (cutting whole tensors into its TP fragment), and undoes it
//    unless every rank of the job loaded: all or nothing;
//  - ExportRankState / ImportRankState: one rank's state as a blob, under
//    the same plan (not collective).
// A checkpoint written under one layout or strategy loads under another.
//
//   CANZONA_ASSIGN_OR_RETURN(v1::SaveCheckpointResponse r,
//       SaveRankCheckpoint(job, rank, agreement, dir, timeout));
//
// Thread-safety: the rank's worker only, after the DP lane is idle.
#ifndef CANZONA_SERVER_ENGINE_RANK_CHECKPOINT_H_
#define CANZONA_SERVER_ENGINE_RANK_CHECKPOINT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "canzona/v1/optimizer_service.pb.h"
#include "server/engine/job.h"
#include "server/engine/job_agreement.h"

namespace canzona {

// INVALID_ARGUMENT for a relative path or one with "..", PERMISSION_DENIED
// outside `root` (when set); the normalized path otherwise.
absl::StatusOr<std::string> ValidateCheckpointDir(const std::string& dir,
                                                  const std::string& root);

absl::StatusOr<canzona::v1::SaveCheckpointResponse> SaveRankCheckpoint(
    Job& job, LocalRank& rank, const JobAgreement& agreement,
    const std::string& dir, absl::Duration timeout);
// `allow_missing`: LoadCheckpointRequest.allow_missing.
absl::StatusOr<canzona::v1::LoadCheckpointResponse> LoadRankCheckpoint(
    Job& job, LocalRank& rank, const JobAgreement& agreement,
    const std::string& dir, absl::Duration timeout, bool allow_missing);
absl::StatusOr<canzona::v1::ExportStateResponse> ExportRankState(
    Job& job, LocalRank& rank);
absl::StatusOr<canzona::v1::ImportStateResponse> ImportRankState(
    Job& job, LocalRank& rank, const canzona::v1::ImportStateRequest& request);

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_RANK_CHECKPOINT_H_
