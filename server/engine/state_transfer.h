// StateTransfer: one rank's state moving through ExportState and
// ImportState in parts, each within the gRPC message size (a rank's state
// is as large as what it owns; the daemon receives 64 MiB by default and
// protobuf caps a message at 2 GiB). It owns the blob an export at offset 0
// made, until its last byte was read, and the parts of an import, until
// the last one arrives and the whole request goes to ImportRankState.
//
//   CANZONA_ASSIGN_OR_RETURN(v1::ExportStateResponse part,
//       rank.transfer.Read(request, [&] { return ExportRankState(job, rank);
//       }));
//   CANZONA_ASSIGN_OR_RETURN(std::optional<v1::ImportStateRequest> whole,
//       rank.transfer.Add(request));
//   if (whole.has_value()) return ImportRankState(job, rank, *whole);
//
// Thread-safety: none; the rank's worker owns it (RunOnRank).
#ifndef CANZONA_SERVER_ENGINE_STATE_TRANSFER_H_
#define CANZONA_SERVER_ENGINE_STATE_TRANSFER_H_

#include <cstdint>
#include <functional>
#include <optional>

#include "absl/status/statusor.h"
#include "canzona/v1/optimizer_service.pb.h"

namespace canzona {

class StateTransfer {
 public:
  // The most bytes a part carries (max_bytes 0: the whole blob, which
  // protobuf bounds at 2 GiB).
  static constexpr int64_t kMaxPartBytes = int64_t{1} << 30;

  // The part of the rank's state the request asks for: at offset 0
  // `export_whole` exports it anew and the blob is kept; past 0 the kept
  // blob is read on (FAILED_PRECONDITION without one, INVALID_ARGUMENT
  // for an offset outside it or a negative max_bytes). The kept blob goes
  // once its last byte was read.
  absl::StatusOr<canzona::v1::ExportStateResponse> Read(
      const canzona::v1::ExportStateRequest& request,
      const std::function<absl::StatusOr<canzona::v1::ExportStateResponse>()>&
          export_whole);

  // Takes one part of an import: the whole request once its last part
  // arrived (at once for total_bytes 0), nullopt before. A part out of
  // order, or disagreeing with the first on step, plan_digest or
  // total_bytes, is INVALID_ARGUMENT naming the field and changes nothing;
  // offset 0 starts over.
  absl::StatusOr<std::optional<canzona::v1::ImportStateRequest>> Add(
      const canzona::v1::ImportStateRequest& part);
  // Bytes of the import received so far.
  int64_t received_bytes() const;

 private:
  std::optional<canzona::v1::ExportStateResponse> exported_;
  std::optional<canzona::v1::ImportStateRequest> importing_;
};

}  // namespace canzona

#endif  // CANZONA_SERVER_ENGINE_STATE_TRANSFER_H_
