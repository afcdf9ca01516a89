// How a rank's coordinates are written, wherever they are written: in
// status messages ("(pp 0, dp 1, tp 0)") and as the key a job's rank is
// looked up by ("job/0.1.0"). Daemon and client both use them, so they sit
// beside the API they format.
//
// Thread-safety: pure functions.
#ifndef CANZONA_PROTO_NAMES_RANK_NAMES_H_
#define CANZONA_PROTO_NAMES_RANK_NAMES_H_

#include <string>

#include "absl/strings/string_view.h"
#include "canzona/v1/optimizer_service.pb.h"

namespace canzona {

// "(pp 0, dp 1, tp 0)", for messages.
std::string RankString(const canzona::v1::RankCoordinates& coords);

// "<job_id>/<pp>.<dp>.<tp>": one key per rank of one job.
std::string RankKey(absl::string_view job_id,
                    const canzona::v1::RankCoordinates& coords);

}  // namespace canzona

#endif  // CANZONA_PROTO_NAMES_RANK_NAMES_H_
