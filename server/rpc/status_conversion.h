// absl::Status <-> grpc::Status. The two code enums share their numbering
// (both follow google.rpc.Code); the static_asserts in the .cc keep it so.
//
// Thread-safety: stateless functions.
#ifndef CANZONA_SERVER_RPC_STATUS_CONVERSION_H_
#define CANZONA_SERVER_RPC_STATUS_CONVERSION_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace canzona {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace canzona

#endif  // CANZONA_SERVER_RPC_STATUS_CONVERSION_H_
